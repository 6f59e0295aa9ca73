"""The API's request and response bodies (pydantic models: they are its process boundary and its OpenAPI schema).

A launch request is made of the domain's models (`AgentParams`, `LaunchOptions`, `ParentSnapshot`): each is
checked by the same code, with the same messages, as a launch from Python, and its schema is theirs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    model_validator,
)

from broker_config.settings import DEFAULT_TENANT
from workers.base.limits import MAX_TOKENS
from workers.errors import WorkspaceError
from workers.history.params import AgentParams, validate_agent_params
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot
from workers.records.fork import Status, Usage
from workers.store.replies import Decision, SendReply
from workers.subagents import launch
from workers.workspace.manifest import Entry

MAX_WAIT_S: Final = 60.0  # a long poll holds a connection, never a thread; under proxies' usual idle timeouts
DIGEST_PATTERN: Final = "^[0-9a-f]{64}$"
WORKSPACE_OPTIONS: Final = ("workspace", "workspace_manifest", "network")  # the API's options beyond LaunchOptions
LATER_OPTIONS: Final = (*WORKSPACE_OPTIONS, "max_tokens")  # in a body's digest only when given (`body_digest`)


def _agent_call(value: object) -> object:
    """An Agent call's arguments checked by the contract (its messages and field); anything else to pydantic."""
    return validate_agent_params(value) if isinstance(value, Mapping) else value


def _parent_snapshot(value: object) -> object:
    """A parent snapshot checked as `forkq launch --parent` checks its file; anything else to pydantic."""
    return parse_parent_snapshot(value) if isinstance(value, dict) else value


LaunchOptions = launch.LaunchOptions  # with the workspace options (`workspace`, `workspace_manifest`, `network`)


class LaunchRequest(BaseModel):
    """`POST /v1/forks`: the Agent tool call's arguments, the launch options, and the parent snapshot.

    Each part is the domain's own model, checked by its own code as it is read: a broken rule is a 422 with
    the message and field a launch from Python gets (`InvalidAgentParams`, `InvalidParentSnapshot`). The
    parts are read in the order `ForkClient.launch` checks them.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    agent: Annotated[AgentParams, BeforeValidator(_agent_call)] = Field(
        description="The Agent tool call's arguments: description, prompt, subagent_type, fork_turns, name, model, "
        "fork_tools."
    )
    options: LaunchOptions = Field(
        default_factory=LaunchOptions,
        description="The launch's options; one left out (or null) takes its default. An unknown option is refused.",
    )
    parent: Annotated[ParentSnapshot, BeforeValidator(_parent_snapshot)] = Field(
        description="The parent snapshot: session_id, system_instruction, tools, model, approval_mode, cwd, "
        "history (the parent's raw Contents, ending with the model Content holding the Agent call), depth."
    )
    # the body as sent, for `digest`: only a launch with an Idempotency-Key pays for hashing its snapshot
    _sent: Mapping[str, Any] | None = PrivateAttr(None)
    _digest: str | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_sent(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        request = handler(data)
        if isinstance(data, Mapping):
            request._sent = data
        return request

    @property
    def digest(self) -> str:
        """SHA-256 of the body's canonical JSON (keys sorted, options filled in), as the client sent it: equal
        bodies, however spaced or ordered, match (an Idempotency-Key's claim keeps it). Computed on first read."""
        if self._digest is None:
            self._digest = "" if self._sent is None else body_digest(self._sent)
        return self._digest


def body_digest(data: Mapping[str, Any]) -> str:
    """The digest of a valid launch body as sent: the parts as given, every option named (null when left out).

    The same JSON as the request's dump was before its parts were models, so an Idempotency-Key claimed by an
    earlier server matches a request sent again to this one; and no parsed snapshot is dumped to compute it.
    """
    options = data.get("options") or {}
    named = {name: options.get(name) for name in launch.LaunchOptions.model_fields if name not in LATER_OPTIONS}
    # the options added since digests were first kept, only when given: a body without them has the digest it had
    named |= {name: options[name] for name in LATER_OPTIONS if options.get(name) is not None}
    canonical = {"schema_version": 1, "parent": data["parent"], "agent": data["agent"], "options": named}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class Launched(BaseModel):
    """A launched fork: its id, and its status just after the launch."""

    fork_id: str
    status: Status


class ResultBody(BaseModel):
    """An ended fork's result, as `forkq result --json` prints it."""

    fork_id: str
    status: Status
    output: str | None = None
    usage: Usage
    error: str | None = None


class DecisionRequest(BaseModel):
    """A person's decision on a call a parked fork waits on."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    decision: Literal["approve", "deny"]
    reason: str | None = Field(None, max_length=10_000, description="Why (a denial's reason, which the model reads).")


class Decided(BaseModel):
    """The decision recorded, and what became of the fork."""

    fork_id: str
    call_id: str
    decision: Literal["approve", "deny"]
    outcome: Decision = Field(
        description="`queued`: no call waits any more, the fork goes on; `recorded`: other calls still wait."
    )
    status: Status


class Cancelled(BaseModel):
    """A fork's status after a cancel: `cancelled`, or the status it had ended with before."""

    fork_id: str
    status: Status


class Notification(BaseModel):
    """The `<task-notification>` the parent's model reads once the fork has ended."""

    fork_id: str
    status: Status
    notification: str


class SessionFork(BaseModel):
    """One fork of a parent session."""

    fork_id: str
    kind: str
    name: str | None = None
    description: str
    status: Status
    created_ms: int | None = Field(None, description="When it was launched (Unix ms, Redis's clock).")
    updated_ms: int | None = Field(None, description="Its latest event (Unix ms, Redis's clock).")
    tenant: str = Field(DEFAULT_TENANT, description="The tenant that launched it.")


class SessionForks(BaseModel):
    """The forks launched from one parent session that are still in Redis, newest first."""

    session_id: str
    forks: list[SessionFork]


class Health(BaseModel):
    """Whether this server can serve: its Redis answers and is fit for forkq (`forkq check`)."""

    ok: bool
    redis_reachable: bool
    redis_fit: bool


class BudgetRequest(BaseModel):
    """A parent session's token budget to set (`PUT /v1/sessions/{id}/budget`); raised, it resumes what it paused."""

    model_config = ConfigDict(extra="forbid")

    tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS, strict=True)] = Field(
        description="Tokens the session's forks and nested subagents may use in all (input plus output, cached "
        "input as the provider bills it: docs/capacity.md)."
    )


class MessageRequest(BaseModel):
    """A message for a fork (`send`): it continues a succeeded fork, or waits in a running or parked one's inbox."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    text: str = Field(description="The message, as the fork's model will read it (UTF-8, at most 256 KiB).")


class MessageSent(BaseModel):
    """What `send` did: `continued` (queued again) or `queued` (in its inbox), and how many messages wait."""

    fork_id: str
    outcome: Literal[SendReply.CONTINUED, SendReply.QUEUED]
    waiting: int


class Listing(BaseModel):
    """A list of subagent definitions or providers, as `forkq agents --json` / `forkq providers --json` print it."""

    items: list[dict[str, Any]]


def _entries(value: object) -> object:
    """A manifest's entries, each checked as the manifest module checks it (`field`: `entries[i].<field>`)."""
    if not isinstance(value, list):
        return value  # pydantic's own message: a list is expected
    parsed = []
    for index, raw in enumerate(value):
        try:
            parsed.append(Entry.parse(raw))
        except WorkspaceError as exc:
            field = f"entries[{index}]" + (f".{exc.field}" if exc.field else "")
            raise WorkspaceError(f"entries[{index}]: {exc.message}", field=field) from exc
    return parsed


class WorkspaceOffer(BaseModel):
    """`POST /v1/workspaces`: a tree's manifest, every file by path, mode, size and the SHA-256 of its bytes."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    entries: Annotated[list[Entry], BeforeValidator(_entries)] = Field(
        description="The files: `path` (relative, `/`-separated), `mode` (33188 a file, 33261 an executable, 40960 "
        "a symlink, whose bytes are its target), `size` (bytes) and `digest` (SHA-256 of the bytes, lowercase hex)."
    )


class WorkspaceOffered(BaseModel):
    """The manifest's digest, and the blobs the server lacks: upload them, then offer again; none: it is stored."""

    manifest: str = Field(description="The manifest's digest: the launch option `workspace_manifest`.")
    missing: list[str] = Field(description="The digests of the blobs to upload (PUT /v1/workspaces/blobs/{digest}).")


class ChangedFile(BaseModel):
    """One file a fork changed: its path, how (added, modified, deleted, ...), and its lines added and removed."""

    path: str
    status: str
    added: int
    removed: int
    binary: bool


class ChangesBody(BaseModel):
    """A fork's changes to its workspace: the files, and the patch `git apply` takes (null with `stat`)."""

    fork_id: str
    files: list[ChangedFile]
    patch: str | None = Field(
        description="The git patch (binary files as git binary patches); bytes that are not UTF-8 are replaced: "
        "ask for text/x-diff for the exact bytes. Null with `stat`."
    )

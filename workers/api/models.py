"""The API's request and response bodies (pydantic models: they are its process boundary and its OpenAPI schema).

The launch options are passed through to `ForkClient.launch` as they come: each is checked there, by the
same code and with the same messages as a launch from Python. Their declared JSON schemas document them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from workers.base.keys import FORK_ID_RE
from workers.errors import InvalidAgentParams
from workers.records.fork import Usage

MAX_WAIT_S: Final = 60.0  # a long poll holds a connection, never a thread; under proxies' usual idle timeouts


class LaunchOptions(BaseModel):
    """The launch's options; one left out (or null) takes its default. An unknown option is refused (422)."""

    model_config = ConfigDict(extra="forbid")

    approval_policy: Annotated[Any, WithJsonSchema({"type": "string", "enum": ["deny", "park"]})] = Field(
        None, description="A call that needs approval: `deny` it (default), or `park` the fork until approve/deny."
    )
    output_schema: Annotated[Any, WithJsonSchema({"type": "object"})] = Field(
        None, description="JSON schema the final answer must match."
    )
    max_turns: Annotated[Any, WithJsonSchema({"type": "integer", "minimum": 1})] = Field(
        None, description="Model calls at most (below the workers' own limit)."
    )
    max_wall_s: Annotated[Any, WithJsonSchema({"type": "number", "exclusiveMinimum": 0})] = Field(
        None, description="Wall-clock limit in seconds (below the workers' own limit)."
    )
    seed_mode: Annotated[Any, WithJsonSchema({"type": "string"})] = Field(
        None, description="How a fork's seed is taken from the parent's history (`fork_turns`, `completed_turns`)."
    )
    persona: Annotated[Any, WithJsonSchema({"type": "string"})] = Field(
        None, description="Persona text of the child's fresh scope."
    )
    tool_filter: Annotated[Any, WithJsonSchema({"type": "array", "items": {"type": "string"}})] = Field(
        None, description="Names of the tools the child may use."
    )
    max_depth: Annotated[Any, WithJsonSchema({"type": "integer", "minimum": 1})] = Field(
        None, description="Deepest nesting of the child's own subagents."
    )
    fork_id: Annotated[Any, WithJsonSchema({"type": "string", "pattern": f"^{FORK_ID_RE.pattern}$"})] = Field(
        None, description="The fork's id, chosen by the caller (default: a fresh one)."
    )

    def launch_kwargs(self, supported: Collection[str]) -> dict[str, Any]:
        """The options that are set, as keyword arguments of `ForkClient.launch`.

        Raises:
            InvalidAgentParams: an option is set that this version's `ForkClient.launch` does not take.
        """
        given = {name: value for name in type(self).model_fields if (value := getattr(self, name)) is not None}
        for name in given:
            if name not in supported:
                raise InvalidAgentParams(
                    f"option {name!r} is not supported by this server's forkq version; leave it out or upgrade the "
                    "server",
                    field=name,
                )
        return given


class LaunchRequest(BaseModel):
    """`POST /v1/forks`: the parent snapshot, the Agent tool call's arguments, and the launch options."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    parent: dict[str, Any] = Field(
        description="The parent snapshot: session_id, system_instruction, tools, model, approval_mode, cwd, "
        "history (the parent's raw Contents, ending with the model Content holding the Agent call), depth."
    )
    agent: dict[str, Any] = Field(
        description="The Agent tool call's arguments: description, prompt, subagent_type, fork_turns, name, model, "
        "fork_tools."
    )
    options: LaunchOptions = Field(default_factory=LaunchOptions)


class Launched(BaseModel):
    """A launched fork: its id, and its status just after the launch."""

    fork_id: str
    status: str


class ResultBody(BaseModel):
    """An ended fork's result, as `forkq result --json` prints it."""

    fork_id: str
    status: str
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
    outcome: Literal["queued", "recorded"] = Field(
        description="`queued`: no call waits any more, the fork goes on; `recorded`: other calls still wait."
    )
    status: str


class Cancelled(BaseModel):
    """A fork's status after a cancel: `cancelled`, or the status it had ended with before."""

    fork_id: str
    status: str


class Notification(BaseModel):
    """The `<task-notification>` the parent's model reads once the fork has ended."""

    fork_id: str
    status: str
    notification: str


class SessionFork(BaseModel):
    """One fork of a parent session."""

    fork_id: str
    kind: str
    name: str | None = None
    description: str
    status: str
    created_ms: int | None = Field(None, description="When it was launched (Unix ms, Redis's clock).")
    updated_ms: int | None = Field(None, description="Its latest event (Unix ms, Redis's clock).")


class SessionForks(BaseModel):
    """The forks launched from one parent session that are still in Redis, newest first."""

    session_id: str
    forks: list[SessionFork]


class Health(BaseModel):
    """Whether this server can serve: its Redis answers and is fit for forkq (`forkq check`)."""

    ok: bool
    redis_reachable: bool
    redis_fit: bool


class MessageRequest(BaseModel):
    """A message for a fork (`send`): it continues a succeeded fork, or waits in a running or parked one's inbox."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    text: str = Field(description="The message, as the fork's model will read it (UTF-8, at most 256 KiB).")


class MessageSent(BaseModel):
    """What `send` did: `continued` (queued again) or `queued` (in its inbox), and how many messages wait."""

    fork_id: str
    outcome: Literal["continued", "queued"]
    waiting: int


class Listing(BaseModel):
    """A list of subagent definitions or providers, as `forkq agents --json` / `forkq providers --json` print it."""

    items: list[dict[str, Any]]

"""The parent's side: `ForkClient` launches forks and follows them (status, wait, events, cancel)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import redis

from broker_config.celery import RUN_FORK_TASK
from broker_config.redis_client import redis_client as connect_redis
from broker_config.settings import DEFAULT_TENANT, Settings
from workers.base.keys import SESSION_RE, Keys, session_named, session_scope
from workers.base.limits import MAX_INBOX_MESSAGES, MAX_MESSAGE_BYTES, shown, text_problem
from workers.errors import (
    BudgetExhausted,
    ForkNotEnded,
    ForkNotFound,
    ForkNotPaused,
    ForkParked,
    ForkTimeout,
    InvalidAgentParams,
    InvalidApproval,
    InvalidBudget,
    MessageRefused,
)
from workers.history.params import AgentParams, ApprovalPolicy, SeedMode, validate_agent_params
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot
from workers.records.fork import BootstrapRecord, ForkResult, ForkState, Status
from workers.records.parked import ResumeWait
from workers.store.forks import Decider, ForkStore
from workers.store.replies import Decision, SendReply

# Reading a fork (`forkq status`, result, events) loads none of what launching, resuming or deciding needs: the
# subagent definitions and launch rules, the seed builder, the fenced lease scripts, job sending, the journal's
# fold. Each is imported where it is first used (tests/test_cold_start.py names them; bench/coldstart.py times it).
if TYPE_CHECKING:  # types only: the send-only app is built on the first launch (workers.broker.sender)
    from celery import Celery

    from workers.broker.envelope import JobEnvelopes
    from workers.records.events import StreamEvent  # and the event models load at the first event read
    from workers.records.seeds import SeedBuilder, SeedChunks
    from workers.store.blobs import BlobStore
    from workers.store.budget import BudgetStore, ForkBudget, SessionBudget
    from workers.store.lease import Leases
    from workers.store.sessions import SessionCancel
    from workers.store.workspaces import ForkChanges
    from workers.subagents.definitions import CatalogCache
    from workers.subagents.launch import LaunchOptions
    from workers.workspace.ref import WorkspaceRef


def _budget_session(session: object) -> str:
    """A session id a budget may be kept under, else InvalidBudget naming `session`."""
    if not isinstance(session, str) or not SESSION_RE.fullmatch(session):
        raise InvalidBudget(
            f"session {shown(session)} is not a valid parent session id: use the session's id, 1-200 characters "
            "without braces or whitespace",
            field="session",
        )
    return session


def parked_error(state: ForkState) -> ForkParked:
    """The `ForkParked` for a fork in a parked state: its status, pending calls and what to do."""
    fid = state.fork_id
    wait = state.waiting_for
    reason = wait.reason if isinstance(wait, ResumeWait) else None
    if state.status is Status.PAUSED and isinstance(wait, ResumeWait) and wait.detail:
        todo = f"{reason}: {wait.detail}"  # a budget pause: what raises it, or that nothing does
    elif state.status is Status.PAUSED:
        todo = f"{reason or 'paused'}; once that is fixed, `forkq resume {fid}` (ForkClient.resume)"
    else:
        calls = ", ".join(f"{c.call_id} ({c.name})" for c in state.pending_approval) or "none"
        todo = (
            f"it waits on calls a person must decide: {calls}; `forkq approve {fid} CALL_ID` or "
            f"`forkq deny {fid} CALL_ID` (ForkClient.approve / deny), then wait again"
        )
    return ForkParked(
        f"fork {fid} is {state.status.value}: {todo}",
        fork_id=fid,
        status=state.status.value,
        pending=[call.wire() for call in state.pending_approval],
        reason=reason,
        waiting_for=None if wait is None else wait.model_dump(mode="json"),
    )


def check_timeout(timeout: object) -> None:
    """A wait's timeout: None (no limit) or a finite number of seconds, 0 or more.

    Raises:
        ValueError: it is not (NaN, infinity, negative, not a number), naming what to pass instead.
    """
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 <= timeout < math.inf:
        raise ValueError(
            f"timeout must be a finite number of seconds, 0 or more, or None to wait without a limit; "
            f"got {shown(timeout)}"
        )


def new_fork_id() -> str:
    """A fresh fork id: `f-` and 24 random hex digits."""
    return f"f-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Sent:
    """What `send` did: `continued` (a succeeded fork queued again) or `queued` (in its inbox), and how many
    messages now wait in the inbox."""

    fork_id: str
    outcome: Literal[SendReply.QUEUED, SendReply.CONTINUED]
    waiting: int


NAME_ATTEMPTS = 5  # compare-and-set rounds when launches race for one teammate name
NAME_LAUNCH_GRACE_MS = 60_000  # a name claimed by a launch whose fork is not written yet stays taken this long
# a record this small rides in the first job even when its seed does not: the worker then folds its first
# checkpoint into the claim (one round trip less); a job grows by 4/3 of it (base64), at most 2.7 KB
RECORD_IN_JOB_MAX_BYTES: Final = 2048


def message_problem(text: object) -> str | None:
    """Why `text` cannot be a message, or None."""
    if not isinstance(text, str):
        return f"a message must be text, got {type(text).__name__}"
    if not text.strip():
        return "the message is empty; send the text the fork should read"
    problem = text_problem("the message", text)
    if problem is not None:
        return problem
    size = len(text.encode("utf-8"))
    if size > MAX_MESSAGE_BYTES:
        return f"the message is {size:,} bytes, more than {MAX_MESSAGE_BYTES:,}; shorten it or point to a file"
    return None


@dataclass(frozen=True)
class ForkHandle:
    """A launched fork: its id and record digest, with shortcuts to the client's calls on it.

    Like `ForkClient`'s, the calls that act on the fork (`cancel`, `resume`, `approve`, `deny`) return
    the fork's `Status` once they are done.
    """

    fork_id: str
    digest: str
    kind: str
    client: ForkClient

    def status(self) -> ForkState:
        """The fork's current state."""
        return self.client.status(self.fork_id)

    def result(self) -> ForkResult | None:
        """The final result, or None while the fork has not ended (`ForkClient.result`)."""
        return self.client.result(self.fork_id)

    def wait(self, timeout: float | None = None) -> ForkResult:
        """Block until the fork ends and return its result (ForkParked at once if it is parked)."""
        return self.client.wait(self.fork_id, timeout=timeout)

    def notification(self) -> str:
        """The `<task-notification>` for the parent's model once the fork has ended (`ForkClient.notification`)."""
        return self.client.notification(self.fork_id)

    def events(self, *, follow: bool = False) -> Iterator[StreamEvent]:
        """The fork's progress events."""
        return self.client.events(self.fork_id, follow=follow)

    def cancel(self) -> Status:
        """Cancel the fork; its status afterwards (`ForkClient.cancel`)."""
        return self.client.cancel(self.fork_id)

    def resume(self) -> Status:
        """Re-enqueue the paused fork; `Status.QUEUED` (`ForkClient.resume`: ForkNotPaused if it is not paused)."""
        return self.client.resume(self.fork_id)

    def approve(self, call_id: str) -> Status:
        """Approve a call the fork waits on; its status afterwards (`ForkClient.approve`)."""
        return self.client.approve(self.fork_id, call_id)

    def deny(self, call_id: str, reason: str | None = None) -> Status:
        """Deny a call the fork waits on; its status afterwards (`ForkClient.deny`)."""
        return self.client.deny(self.fork_id, call_id, reason)


class ForkClient:
    """Launch and follow forks. One per parent process; thread-safe."""

    def __init__(
        self, settings: Settings | None = None, *, redis_client: redis.Redis | None = None, app: Celery | None = None
    ) -> None:
        self.settings = settings or Settings()
        self.redis = redis_client or connect_redis(self.settings)
        self.store = ForkStore(self.redis, Keys(self.settings.namespace), ttl_s=self.settings.record_ttl_s)
        self._app = app
        self._own_app = app is None  # a send-only app this client builds, and closes
        self._job_envelopes: JobEnvelopes | Literal[False] | None = False  # False: not learned yet
        # the last snapshot's declarations: (snapshot, JSON, the JSON read back, to see an edited list)
        self._tools_json: tuple[ParentSnapshot, str, Any] | None = None

    @functools.cached_property
    def _catalog(self) -> CatalogCache:
        """The subagent definitions, read again when a definition file changes; built on the first launch."""
        from workers.subagents.definitions import CatalogCache  # noqa: PLC0415  (launches only)

        return CatalogCache(self.settings.agents_dir)

    @functools.cached_property
    def _seeds(self) -> SeedBuilder:
        """Sibling forks of one snapshot share their selection and chunks; built on the first launch."""
        from workers.records.seeds import SeedBuilder  # noqa: PLC0415  (launches only)

        return SeedBuilder()

    @functools.cached_property
    def _leases(self) -> Leases:
        """The fenced lease scripts: a fork queued again, and its journal; built on first use."""
        from workers.store.lease import Leases  # noqa: PLC0415  (not to read a fork's state)

        return Leases(
            self.redis,
            Keys(self.settings.namespace),
            ttl_ms=int(self.settings.lease_ttl_s * 1000),
            retention_s=self.settings.record_ttl_s,
        )

    @property
    def app(self) -> Celery:
        """The app jobs are sent through: the one given, else a send-only app built on first use (no Celery before)."""
        if self._app is None:
            from workers.broker.sender import sender_app  # noqa: PLC0415  (Celery and kombu: only once a job is sent)

            self._app = sender_app(self.settings)
        return self._app

    def close(self) -> None:
        """Release the Redis connections (and the broker's, of a send-only app the client built)."""
        self.redis.close()
        if self._own_app and self._app is not None:
            self._app.close()

    def __enter__(self) -> ForkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def launch(
        self,
        parent: ParentSnapshot | Mapping[str, Any],
        params: AgentParams | Mapping[str, Any],
        *,
        fork_id: str | None = None,
        approval_policy: ApprovalPolicy = "deny",
        output_schema: dict[str, Any] | None = None,
        max_wall_s: float | None = None,
        max_turns: int | None = None,
        max_tokens: int | None = None,
        seed_mode: SeedMode | str | None = None,
        persona: str | None = None,
        tool_filter: list[str] | tuple[str, ...] | None = None,
        max_depth: int | None = None,
        workspace: str | None = None,
        manifest: str | None = None,
        network: bool = True,
    ) -> ForkHandle:
        """Validate, build the seed, write the bootstrap record, then enqueue the fork.

        Nothing reaches Redis or the broker when the parameters, the options or the snapshot are invalid. Sibling
        launches from one `ParentSnapshot` share its history selection (`workers.records.seeds`); add messages to a
        snapshot's history list as you like, but never change a Content in place.

        Args:
            approval_policy: what a call that needs approval does: `deny` answers it with a denial
                the model reads; `park` parks the fork (`awaiting_approval`) until approve/deny.
            output_schema: a JSON schema the final answer must match (sent back to the model
                with the error a bounded number of times).
            max_wall_s, max_turns, max_tokens: limits below the workers' own; at max_tokens (input plus output
                tokens: docs/capacity.md) the fork pauses (`budget_reached`) before its next model call.
            seed_mode: a fork's seed: `fork_turns` (the default: `fork_turns` of the Agent call) or
                `completed_turns` (the parent's completed turns, in a fresh scope).
            persona: a system prompt replacing the child's (regular subagents, completed-turn forks).
            tool_filter: the tools the child keeps (regular subagents, completed-turn forks).
            max_depth: the deepest nesting below this launch, at most FORKQ_MAX_SUBAGENT_DEPTH.
            workspace, manifest, network: the fork's files (docs/workspaces.md): `snapshot` (FORKQ_WORKSPACE's
                default), its own copy of cwd (or of the uploaded `manifest`), `network=False` cutting its
                commands off; `shared`, its tools act on cwd in place.

        Raises:
            InvalidAgentParams: the Agent call's parameters break the contract, or the launch
                options are invalid or ask for what the provider lacks (`.field` names which).
            InvalidParentSnapshot: the parent snapshot is malformed.
            SessionCancelled: the snapshot's session was cancelled moments ago (`cancel_session`); nothing written.
            InvalidAgentDefinition: a file of FORKQ_AGENTS_DIR is malformed.
        """
        from workers.subagents.launch import LaunchOptions  # noqa: PLC0415  (launches only, as below)

        # an AgentParams passed the contract when it was built: it is not checked again
        agent = params if isinstance(params, AgentParams) else validate_agent_params(params)
        options = LaunchOptions(
            fork_id=fork_id, seed_mode=seed_mode, persona=persona, tool_filter=tool_filter, max_depth=max_depth,
            approval_policy=approval_policy, output_schema=output_schema, max_wall_s=max_wall_s, max_turns=max_turns,
            max_tokens=max_tokens, workspace=workspace, workspace_manifest=manifest, network=network,
        )  # fmt: skip
        snapshot = parent if isinstance(parent, ParentSnapshot) else parse_parent_snapshot(dict(parent))
        # one parsed here from a dict cannot be passed again: keep nothing of it
        return self.launch_checked(snapshot, agent, options, keep=snapshot is parent)

    def launch_checked(
        self,
        snapshot: ParentSnapshot,
        agent: AgentParams,
        options: LaunchOptions,
        *,
        keep: bool = True,
        read_files: bool = True,
        tenant: str | None = None,
    ) -> ForkHandle:
        """`launch` with its arguments already checked models (as the HTTP API's request holds them), for `tenant`
        (None: FORKQ_TENANT; the API passes its caller's).

        `keep=False` for a snapshot nobody passes again (one parsed from a request): its history selection
        and declarations are not kept for sibling launches. `read_files=False` (the HTTP API): a snapshot
        workspace comes only from an upload, never from this machine's disk at the path a request names.

        Raises:
            InvalidAgentParams: the options ask for what the provider or seed mode lacks, or break a nesting or
                name rule (`.field` names which).
            InvalidAgentDefinition: a file of FORKQ_AGENTS_DIR is malformed.
            SessionCancelled: the snapshot's session was cancelled moments ago; nothing was written.
        """
        from workers.broker.queue import send_call  # noqa: PLC0415  (launches only)
        from workers.subagents.launch import plan_launch  # noqa: PLC0415

        plan = plan_launch(
            agent,
            snapshot,
            options,
            tools_json=self._declarations_json(snapshot, keep=keep),
            catalog=self._catalog.get,
            depth_limit=self.settings.max_subagent_depth,
        )
        workspace = self._workspace(snapshot.cwd, options, read_files=read_files)
        fid = options.fork_id or new_fork_id()
        seed = self._seed(snapshot, agent, plan.seed_mode, keep=keep)
        record = plan.record(
            fid,
            snapshot,
            agent,
            seed_chunks=seed.digests,
            message_count=seed.count,
            task_prompt=seed.task_prompt,
            workspace=workspace,
            tenant=_stored_tenant(tenant or self.settings.tenant),
        )
        if agent.name:  # a teammate: its name is its own in the session (of its tenant) while it lives
            self._claim_name(record.parent_session, agent.name, fid)
        record_bytes, digest = record.encode()
        call = self._first_call(record, record_bytes, digest, seed.chunks)
        envelopes = self._envelopes()
        job = None if envelopes is None else envelopes.run_fork(RUN_FORK_TASK, *call)
        # with the broker on this Redis, the launch script queues the job itself: one round trip for the launch
        if not self.store.put_launch(record, record_bytes, digest, seed.chunks, job=job):
            send_call(self.app, self.settings.queue, call)
        return ForkHandle(fork_id=fid, digest=digest, kind=record.kind, client=self)

    def _seed(self, snapshot: ParentSnapshot, agent: AgentParams, seed_mode: SeedMode, *, keep: bool) -> SeedChunks:
        """The launch's seed: the parent's history selected for a fork; none for a regular subagent or teammate."""
        from workers.records.seeds import SeedChunks  # noqa: PLC0415  (launches only)

        if not agent.is_fork:
            return SeedChunks(chunks=[], digests=[], count=0, task_prompt=agent.prompt)
        return self._seeds.build(snapshot, directive=agent.prompt, turns=agent.turns, seed_mode=seed_mode, keep=keep)

    @functools.cached_property
    def blobs(self) -> BlobStore:
        """Workspace blobs and manifests (the default scope until tenants exist)."""
        from workers.store.blobs import BlobStore  # noqa: PLC0415  (workspaces only)

        return BlobStore(self.redis, Keys(self.settings.namespace), ttl_s=self.settings.record_ttl_s)

    def _workspace(self, cwd: str, options: LaunchOptions, *, read_files: bool) -> WorkspaceRef:
        """The launch's workspace, its snapshot stored (nothing else of the launch is written yet)."""
        from workers.store.workspaces import WorkspaceLaunch, launch_workspace  # noqa: PLC0415  (launches only)

        asked = WorkspaceLaunch(options.workspace, options.workspace_manifest, options.network, read_files)
        return launch_workspace(cwd, asked, settings=self.settings, blobs=self.blobs)

    def changes(self, fork_id: str) -> ForkChanges:
        """A snapshot fork's changes to the parent's files as of its last step: `.patch()`, `.stat()`, `.apply()`.

        Raises:
            ForkNotFound: the fork does not exist.
            WorkspaceError: the fork has no snapshot workspace.
        """
        from workers.store.workspaces import fork_changes  # noqa: PLC0415  (changes only)

        state = self.store.state(fork_id)
        return fork_changes(self.store, self.blobs, self.store.get_record(fork_id, state.digest or None))

    def apply(self, fork_id: str, target: str | os.PathLike[str] | None = None, *, check: bool = False) -> list[str]:
        """Apply a snapshot fork's changes to `target` (default: the parent's cwd), all or nothing; the paths.

        Raises:
            ApplyConflict: a file of the target differs from the one the fork started from; nothing was written.
        """
        from workers.store.workspaces import default_target  # noqa: PLC0415  (apply only)

        changes = self.changes(fork_id)
        folder = Path(target) if target is not None else default_target(changes)
        return changes.apply(folder, check=check)

    def agents(self) -> list[dict[str, Any]]:
        """The subagent definitions a launch can name: the built-ins and FORKQ_AGENTS_DIR's files, sorted.

        Raises:
            InvalidAgentDefinition: a file of FORKQ_AGENTS_DIR is malformed.
        """
        return self._catalog.get().listing()

    @staticmethod
    def providers() -> list[dict[str, Any]]:
        """The subagent providers (`spawn`, `fork`) with the capabilities each advertises."""
        from workers.subagents.capabilities import providers  # noqa: PLC0415  (launches only)

        return providers()

    def _first_call(
        self, record: BootstrapRecord, record_bytes: bytes, digest: str, chunks: list[bytes]
    ) -> tuple[str, list[Any], str]:
        """A launched fork's first job: a small seed rides inline, and a small record rides in every job.

        With its record in the job, the worker prepares the first model call before its claim, and the claim
        makes the checkpoint before that call too (one round trip less for every first run).
        """
        from workers.broker.queue import run_fork_call  # noqa: PLC0415  (launches only)

        inline: list[bytes] | None = [record.context_blob(), *chunks]
        indexed = record.seed_index_blob() is not None
        # a record that names its seed through an index chunk is read with its chunks from Redis
        if sum(map(len, inline or [])) > self.settings.inline_seed_max_bytes or indexed:
            inline = None
        # a large seed (named through an index) keeps its queued job as small as it can be: its forks wait in the
        # broker by the thousand, and the round trip saved is small beside reading such a seed
        carried = inline is not None or (not indexed and len(record_bytes) <= RECORD_IN_JOB_MAX_BYTES)
        return run_fork_call(
            record.fork_id,
            digest,
            attempt=1,
            seed_chunks=inline,
            record=record_bytes if carried else None,
            description=record.description,
            parent_session=record.parent_session,
        )

    def _envelopes(self) -> JobEnvelopes | None:
        """How this client's launch script queues jobs itself, or None where the broker is not this Redis.

        Learned once: the broker must be the store's own server (`FORKQ_BROKER_URL` unset, no Sentinel),
        reached by this client at the address the broker URL names.
        """
        if self._job_envelopes is False:
            from workers.broker.envelope import JobEnvelopes  # noqa: PLC0415  (kombu: only once a job is sent)

            same = self.settings.broker_url is None and not self.settings.broker_uses_sentinel
            self._job_envelopes = JobEnvelopes.for_app(self.app, self.settings.queue, self.redis) if same else None
        return self._job_envelopes

    def _declarations_json(self, snapshot: ParentSnapshot, *, keep: bool = True) -> str:
        """The snapshot's tool declarations as the record keeps them (key order kept); sibling launches
        from one snapshot object reuse the last one's while its declarations still equal what was encoded."""
        last = self._tools_json
        if last is not None and last[0] is snapshot and last[2] == snapshot.tools:
            return last[1]
        text = json.dumps(snapshot.tools, ensure_ascii=False, separators=(",", ":"))
        if keep:
            self._tools_json = (snapshot, text, json.loads(text))
        return text

    # ── following a fork ──────────────────────────────────────────────────────────────────────

    def status(self, fork_id: str) -> ForkState:
        """The fork's current state (ForkNotFound if there is none)."""
        return self.store.state(fork_id)

    def result(self, fork_id: str) -> ForkResult | None:
        """The final result, or None while the fork runs."""
        return self.store.result(fork_id)

    def wait(self, fork_id: str, *, timeout: float | None = None) -> ForkResult:
        """Block until the fork ends (following its event stream) and return its result.

        A parked fork (`awaiting_approval`, `paused`) ends only after a person acts, so waiting for
        it returns at once, raising `ForkParked` with its status and the calls it waits on: approve
        or deny them (or `resume` a paused fork), then wait again.

        Raises:
            ValueError: `timeout` is not None nor a finite number of seconds, 0 or more.
            ForkParked: the fork is awaiting approval or paused.
            ForkTimeout: the fork did not end within `timeout` seconds.
            ForkNotFound: the fork does not exist.
        """
        check_timeout(timeout)
        outcome = self.store.ended(fork_id, deadline=None if timeout is None else time.monotonic() + timeout)
        if isinstance(outcome, ForkResult):
            return outcome
        if outcome.status.parked:
            raise parked_error(outcome)
        hint = (
            "check that a worker consumes the queue (forkq check --worker / Flower)"
            if outcome.status is Status.QUEUED
            else f"`forkq events {fork_id} --follow` shows its progress"
        )
        raise ForkTimeout(
            f"fork {fork_id}: still {outcome.status.value} after {timeout} s; wait longer, or {hint}", fork_id=fork_id
        )

    def events(self, fork_id: str, *, follow: bool = False) -> Iterator[StreamEvent]:
        """The fork's events so far, or (`follow`) until its terminal event."""
        if follow:
            return self.store.follow(fork_id)
        return iter(self.store.events(fork_id))

    def cancel(self, fork_id: str) -> Status:
        """Cancel the fork; its status afterwards: `CANCELLED`, or the status it ended with before.

        Raises:
            ForkNotFound: the fork does not exist.
        """
        before = self.store.state(fork_id)
        status = self.store.cancel(fork_id)
        if status is Status.CANCELLED and before.status.parked:
            # a parked run has no worker to end its row in Flower (a running one ends it itself)
            from workers.broker.queue import send_ended_event  # noqa: PLC0415  (not to read a fork's state)

            send_ended_event(
                self.app, "task-cancelled", f"{fork_id}.{before.attempt}", sender="forkq-client", result="cancelled"
            )
        return status

    def cancel_session(self, session: str, *, tenant: str | None = None) -> SessionCancel:
        """Cancel every fork of parent session `session` (of `tenant`, None: FORKQ_TENANT) that has not ended, nested
        subagents included; what it did.

        Launches into the session are refused from the start of the cancel until FORKQ_SESSION_TOMBSTONE_S after
        it (`SessionCancelled`), so none launched while it runs escapes it; each cancelled fork keeps its usage.

        Raises:
            ValueError: `session` is not a parent session id (1-200 characters without braces or spaces).
        """
        from workers.broker.queue import send_ended_events  # noqa: PLC0415  (not to read a fork's state)
        from workers.store.sessions import cancel_session  # noqa: PLC0415

        scope = self._session(session, tenant)
        outcome, cancels = cancel_session(self.store, scope, tombstone_s=self.settings.session_tombstone_s)
        outcome = outcome.model_copy(update={"session": session})
        # a parked run has no worker to end its row in Flower (a running one ends it itself)
        parked = [f"{fid}.{c.attempt}" for fid, c in cancels.items() if c.newly and c.before and c.before.parked]
        if parked:
            send_ended_events(self.app, "task-cancelled", parked, sender="forkq-client", result="cancelled")
        return outcome

    def resume(self, fork_id: str) -> Status:
        """Re-enqueue a paused fork (after its missing tools were installed); its status afterwards, `QUEUED`.

        Raises:
            ForkNotPaused: the fork is not paused (`.status` is its status); nothing was changed.
            ForkNotFound: the fork does not exist.
        """
        session = self._budget_paused(fork_id)
        if not self.store.resume(fork_id):
            status = self.store.state(fork_id).status
            raise ForkNotPaused(
                f"fork {fork_id} is {status.value}, not paused: nothing to resume (only a paused fork is; "
                "`forkq status` shows what it waits on)",
                fork_id=fork_id,
                status=status.value,
            )
        self._enqueue_again(fork_id)
        if session is not None:
            self._budgets.resumed(session, fork_id)
        return Status.QUEUED

    def _budget_paused(self, fork_id: str) -> str | None:
        """The session of a fork paused at a token budget that is no longer used up (None: not a budget pause).

        Raises:
            BudgetExhausted: the budget that paused it is still used up (a resume would only pause it again).
        """
        from workers.records.budget import BudgetKind, budget_detail  # noqa: PLC0415  (budgets only)
        from workers.records.parked import PauseReason  # noqa: PLC0415

        state = self.store.state(fork_id)
        wait = state.waiting_for
        if state.status is not Status.PAUSED or not isinstance(wait, ResumeWait):
            return None
        if wait.reason != PauseReason.BUDGET_REACHED:
            return None
        budget = self.fork_budget(fork_id)
        kind = None
        if budget.max_tokens is not None and budget.used >= budget.max_tokens:
            kind, used, limit = BudgetKind.FORK, budget.used, budget.max_tokens
        elif budget.session.reached and budget.session.tokens is not None:
            kind, used, limit = BudgetKind.SESSION, budget.session.used, budget.session.tokens
        if kind is None:
            return budget.session.session
        detail = budget_detail(kind, fork_id=fork_id, session=budget.session.session, used=used, limit=limit)
        raise BudgetExhausted(f"fork {fork_id} stays paused: {detail}", fork_id=fork_id, budget=kind.value)

    # ── budgets ───────────────────────────────────────────────────────────────────────────────

    @functools.cached_property
    def _budgets(self) -> BudgetStore:
        """Session token budgets; built on first use."""
        from workers.store.budget import BudgetStore  # noqa: PLC0415  (budgets only)

        return BudgetStore(self.redis, Keys(self.settings.namespace), ttl_s=self.settings.record_ttl_s)

    def _session(self, session: str, tenant: str | None) -> str:
        """The scope of `tenant`'s (None: FORKQ_TENANT) parent session `session` (`workers.base.keys.session_scope`)."""
        return session_scope(session, tenant or self.settings.tenant) if SESSION_RE.fullmatch(session) else session

    def budget(self, session: str, *, tenant: str | None = None) -> SessionBudget:
        """A parent session's (of `tenant`, None: FORKQ_TENANT) token budget: its limit (None: none set), what its
        forks used, and what is left.

        Raises:
            InvalidBudget: the session id is not valid (`.field` is `session`).
        """
        read = self._budgets.read(self._session(_budget_session(session), tenant))
        return read.model_copy(update={"session": session})

    def set_budget(self, session: str, *, tokens: int, tenant: str | None = None) -> SessionBudget:
        """Set a parent session's token budget, shared by all its forks and their nested subagents; raised above
        what they used, every fork it paused is resumed (`resumed` names them).

        Raises:
            InvalidBudget: `tokens` is not a whole number from 0 to 10^15, or the session id is not valid.
        """
        from workers.base.limits import MAX_TOKENS  # noqa: PLC0415

        named = _budget_session(session)
        session = self._session(named, tenant)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS:
            raise InvalidBudget(
                f"tokens must be a whole number of tokens from 0 to {MAX_TOKENS:,} (input plus output, cached input "
                f"as the provider bills it); got {shown(tokens)}",
                field="tokens",
            )
        budget, paused = self._budgets.set(session, tokens)
        resumed = []
        for fork_id in paused:
            if self.store.resume(fork_id):  # one that was resumed by hand, or cancelled, is only taken out
                self._enqueue_again(fork_id)
                resumed.append(fork_id)
            self._budgets.resumed(session, fork_id)
        return budget.model_copy(update={"resumed": resumed, "session": named})

    def fork_budget(self, fork_id: str) -> ForkBudget:
        """A fork's budgets: its own max_tokens, the tokens its journal's responses cost, and its session's budget.

        Raises:
            ForkNotFound: the fork does not exist.
        """
        from workers.records.budget import cached_weight, journal_tokens  # noqa: PLC0415  (budgets only)
        from workers.store.budget import ForkBudget  # noqa: PLC0415

        state = self.store.state(fork_id)
        record = self.store.get_record(fork_id, state.digest or None)
        used = journal_tokens(self.store.journal(fork_id), cached_weight(self.settings, record.model))
        session = self._budgets.read(record.parent_session).model_copy(
            update={"session": session_named(record.parent_session)}
        )
        return ForkBudget.of(fork_id, record.options.max_tokens, used, session)

    def approve(self, fork_id: str, call_id: str, *, by: Decider | None = None) -> Status:
        """Approve a parked call; when no other call waits, the fork is enqueued to go on (on any worker).

        Returns the fork's status afterwards: `QUEUED` (no call waits: the fork goes on) or
        `AWAITING_APPROVAL` (other calls still wait for a decision).

        Raises:
            InvalidApproval: the fork is not awaiting approval, or has no such pending call.
        """
        return self._decide(fork_id, call_id, "approve", None, by)

    def deny(self, fork_id: str, call_id: str, reason: str | None = None, *, by: Decider | None = None) -> Status:
        """Deny a parked call: the model reads the denial (with `reason`) and goes on without it.

        Returns the fork's status afterwards, as `approve` does.

        Raises:
            InvalidApproval: as `approve`, or `reason` is not valid Unicode text.
        """
        return self._decide(fork_id, call_id, "deny", reason, by)

    def _decide(self, fork_id: str, call_id: str, decision: str, reason: str | None, by: Decider | None) -> Status:
        """Record the decision with who made it (`by`; None: `local`, of FORKQ_TENANT) in the fork's journal."""
        problem = None if reason is None else text_problem("the reason of a denial", reason)
        if problem is not None:  # the journal stores it as UTF-8
            raise InvalidApproval(problem, fork_id=fork_id)
        decider = by or Decider("local", self.settings.tenant)
        if self.store.decide(fork_id, call_id, decision, reason, by=decider) is Decision.RECORDED:
            return Status.AWAITING_APPROVAL
        self._enqueue_again(fork_id)
        return Status.QUEUED

    def _enqueue_again(self, fork_id: str) -> None:
        """Send the job of a fork put back in the queue state (resumed, decided), then confirm it enqueued."""
        from workers.broker.queue import enqueue_again  # noqa: PLC0415  (not to read a fork's state)

        state = self.store.state(fork_id)
        enqueue_again(  # confirmed: out of the running index, where a decided fork waits until now
            self.app,
            fork_id,
            state.digest,
            state.attempt + 1,
            queue=self.settings.queue,
            store=self.store,
            leases=self._leases,
        )

    # ── conversations ─────────────────────────────────────────────────────────────────────────

    def _claim_name(self, session: str, name: str, fork_id: str) -> None:
        """Make `name` the new teammate's in `session`, unless a live teammate holds it.

        Raises:
            InvalidAgentParams: a teammate of that name has not ended (`.field` is `name`); nothing is written.
        """
        for _ in range(NAME_ATTEMPTS):
            entry = self.store.teammate_entry(session, name)
            if entry is not None:
                holder, _, since = entry.partition(" ")
                try:
                    status = self.store.state(holder).status
                    live, shown = not status.terminal, status.value
                except ForkNotFound:  # being launched right now, or a launch that never completed long ago
                    live = time.time() * 1000 - int(since or 0) < NAME_LAUNCH_GRACE_MS
                    shown = "being launched"
                if live:
                    named = session_named(session)  # the id its tenant uses, not its scope
                    raise InvalidAgentParams(
                        f"teammate name {name!r} is taken in session {named} by fork {holder}, which is "
                        f"{shown}; choose another name, or message it (forkq send --session {named} --to {name})",
                        field="name",
                    )
            if self.store.claim_name(session, name, fork_id, expected=entry):
                return
        raise InvalidAgentParams(f"teammate name {name!r}: launches raced for it; try again", field="name")

    def list(self, session: str, *, limit: int = 1000, tenant: str | None = None) -> list[dict[str, Any]]:
        """The forks launched from parent session `session` (of `tenant`, None: FORKQ_TENANT) still in Redis, newest
        first: `fork_id`, `kind`, `name`, `description`, `status`, `created_ms`, `updated_ms`, `tenant`."""
        forks = self.store.session_forks(self._session(session, tenant), limit=limit)
        return [dataclasses.asdict(fork) for fork in forks]

    def send_to(self, session: str, name: str, text: str, *, tenant: str | None = None) -> Sent:
        """`send` to the teammate launched as `name` from parent session `session`.

        Raises:
            ForkNotFound: the session has no teammate of that name.
            MessageRefused: as `send`.
        """
        fork_id = self.store.teammate(self._session(session, tenant), name)
        if fork_id is None:
            raise ForkNotFound(
                f"session {session} has no teammate named {name!r}; `forkq list --session {session}` lists its forks",
                fork_id=None,
            )
        return self.send(fork_id, text)

    def send(self, fork_id: str, text: str) -> Sent:
        """Give a fork a message: a succeeded fork is continued (queued again: its next run answers the
        message from its whole conversation); a running, queued or parked one gets it in its inbox, delivered
        as a user message before its next model call (a parked one once it resumes).

        Raises:
            MessageRefused: the text is empty, not text or too long; the fork failed or was cancelled; or
                its inbox is full. Nothing was written.
            SessionCancelled: the fork had succeeded and its session was cancelled moments ago (`cancel_session`):
                it is not continued; nothing was written.
            ForkNotFound: there is no such fork.
        """
        problem = message_problem(text)
        if problem is not None:
            raise MessageRefused(f"fork {fork_id}: {problem}", fork_id=fork_id, field="message")
        word, waiting = self.store.send(fork_id, text, inbox_limit=MAX_INBOX_MESSAGES)
        if word is SendReply.MISSING:
            self.store.state(fork_id)  # raises ForkNotFound, with its message
        if word in (SendReply.FAILED, SendReply.CANCELLED):
            raise MessageRefused(
                f"fork {fork_id} {word}, so it takes no more messages (a message reaches a fork that runs, waits "
                "or succeeded); launch a new fork with what it should do",
                fork_id=fork_id,
                status=word.value,
            )
        if word is SendReply.FULL:
            raise MessageRefused(
                f"fork {fork_id}: its inbox already holds {waiting} messages, the most it keeps; send again once "
                "it has read them (at its next model call)",
                fork_id=fork_id,
                status=self.store.state(fork_id).status.value,
            )
        if word is SendReply.CONTINUED:
            self._enqueue_again(fork_id)
            return Sent(fork_id=fork_id, outcome=SendReply.CONTINUED, waiting=waiting)
        return Sent(fork_id=fork_id, outcome=SendReply.QUEUED, waiting=waiting)

    def notification(self, fork_id: str) -> str:
        """The `<task-notification>` the parent's model reads once the fork has ended.

        Raises:
            ForkNotEnded: the fork has no result yet (wait for it first).
            ForkNotFound: the fork does not exist.
        """
        result = self.store.result(fork_id)
        state = self.store.state(fork_id)
        if result is None:
            raise ForkNotEnded(
                f"fork {fork_id} is {state.status.value}: it has no result to notify yet; wait for it first",
                fork_id=fork_id,
            )
        from workers.records.notification import render_task_notification  # noqa: PLC0415  (ended forks only)

        return render_task_notification(
            result, description=state.description, changed_files=self.changed_files(fork_id)
        )

    def changed_files(self, fork_id: str) -> tuple[str, ...]:
        """The files a snapshot fork changed (empty for a shared one): what its notification lists."""
        record = self.store.get_record(fork_id, self.store.state(fork_id).digest or None)
        if record.workspace is None or not record.workspace.snapshot:
            return ()
        from workers.store.workspaces import fork_changes  # noqa: PLC0415  (snapshot forks only)

        return tuple(fork_changes(self.store, self.blobs, record).paths)

    def inspect(self, fork_id: str) -> dict[str, Any]:
        """The bootstrap record in wire form, with its seed resolved and verified."""
        from workers.records.conversation import Approval, exchanges, fold  # noqa: PLC0415  (inspect only)
        from workers.subagents.launch import launch_settings  # noqa: PLC0415

        state = self.store.state(fork_id)
        record, seed = self.store.read_inputs(fork_id, state.digest or None)
        journal = self.store.journal(fork_id)
        decided = [step._asdict() for step in fold(journal, fork_id=fork_id).steps if isinstance(step, Approval)]
        return {
            "fork_id": record.fork_id,
            "digest": state.digest,
            "kind": record.kind,
            "initial_messages": seed.to_wire()["initial_messages"],
            "task_prompt": record.task_prompt,
            "directive": record.directive,
            "system_instruction": record.system_instruction,
            "tools": record.tools,
            "model": record.model,
            "approval_mode": record.approval_mode,
            "cwd": record.cwd,
            "depth": record.depth,
            "fork_turns": record.fork_turns,
            "description": record.description,
            "parent_session": session_named(record.parent_session),
            "tenant": record.owner_tenant,
            **launch_settings(record),
            "workspace": None if record.workspace is None else record.workspace.model_dump(mode="json"),
            "exchanges": exchanges(record.directive, journal),
            "approvals": decided,  # each decision on a parked call, with who made it and when
            "budget": self.fork_budget(fork_id).model_dump(mode="json", exclude={"session": {"resumed"}}),
        }


def _stored_tenant(tenant: str) -> str | None:
    """A record's `tenant`: None for `default`, so its records keep the bytes they had before tenants."""
    return None if tenant == DEFAULT_TENANT else tenant

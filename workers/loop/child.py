"""The child agent loop: model call, tool calls, repeat until the model answers without calls.

The loop is driven by the fork's journal: every model response and every tool call (before it runs
and after) is appended through a fenced writer, so a revived run replays what was recorded and
re-calls nothing. Everything the loop touches is passed in, so it runs without a broker.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from workers.errors import WorkspaceTooLarge
from workers.history.messages import Content, Part
from workers.history.selection import ForkSeed
from workers.history.structured import check_answer, feedback_text
from workers.loop.guard import UNGUARDED, CallGuard
from workers.loop.policy import (
    Gate,
    denied_by_policy,
    denied_by_user,
    effective_mode,
    is_agent_call,
    needs_approval,
    undeclared_error,
)
from workers.loop.replay import replay
from workers.providers import ModelProvider, ModelRequest
from workers.records.conversation import Conversation, PendingCall, calls_of, visible_text
from workers.records.events import (
    Event,
    FeedbackData,
    FeedbackEvent,
    MessageData,
    MessageEvent,
    ModelCallData,
    ModelCallEvent,
    StepData,
    StepEvent,
    ToolData,
    ToolEvent,
)
from workers.records.fork import BootstrapRecord, ForkResult, Status, Usage
from workers.records.journal import EntryKind, JournalEntry, RequestDigests
from workers.records.notification import NO_OUTPUT
from workers.records.parked import ParkedCall
from workers.tools.registry import Tool, ToolContext, ToolRegistry, never_cancelled
from workers.workspace.manifest import Entry
from workers.workspace.ref import WorkspaceRef


class ForkIO(Protocol):
    """The loop's link to Redis: buffered progress events and fenced journal writes."""

    def emit(self, event: Event) -> None:
        """Queue a progress event (published with the next checkpoint or append)."""
        ...

    def checkpoint(self) -> None:
        """A step boundary: publish queued events; raise `Stopped` if the fork must stop here."""
        ...

    def append(self, entry: JournalEntry, *, boundary: bool = False) -> None:
        """Append a journal entry with the queued events (fenced: raises LeaseLost when refused).

        With `boundary`, the entry starts a side effect: raise `Stopped` first if the fork must stop.
        """
        ...

    def take_mail(self) -> list[str]:
        """The oldest messages `send` left in the fork's inbox, to deliver now (empty: none)."""
        ...

    def deliver(self, entries: list[JournalEntry]) -> None:
        """Journal the `message` entries of the texts `take_mail` returned, and take those from the inbox."""
        ...


class Workspace(Protocol):
    """A snapshot fork's files on this worker: built as of the journal, changed by its tools, journaled per call."""

    def open(self, changes: Mapping[str, Entry | None]) -> None:
        """Build the tree: the base snapshot with `changes` (the journal's, so far) on top."""
        ...

    def context(self, ctx: ToolContext) -> ToolContext:
        """`ctx` for a call acting in the workspace (its folder, its sandbox)."""
        ...

    def checkpoint(self) -> list[Any] | None:
        """The files the last tool call changed, their bytes stored: the entry's `changes` (None: none changed)."""
        ...

    def share(self) -> WorkspaceRef:
        """The workspace as it is now, stored: what a nested subagent of this fork starts from."""
        ...

    def merge(self, changes: Mapping[str, Entry | None]) -> None:
        """Write a nested subagent's changes into this tree (the next checkpoint journals them)."""
        ...


class StopReason(enum.StrEnum):
    """Why a loop stopped before its result (`workers.service.outcome.STOPPED` maps each to the run's outcome)."""

    CANCELLED = "cancelled"  # a person cancelled the fork
    SHUTDOWN = "shutdown"  # its worker shuts down: the fork is handed to another
    LEASE_LOST = "lease_lost"  # another worker runs the fork now
    AWAITING_APPROVAL = "awaiting_approval"  # it parked on calls a person decides (`Parked`)
    BUDGET_REACHED = "budget_reached"  # a token budget is used up (`workers.loop.budget.BudgetReached`): paused


STOP_REASONS: Final = tuple(StopReason)


class Stopped(Exception):
    """The loop stopped at a step boundary (cancel, shutdown, lost lease); `reason` says which."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason)
        self.reason = reason


class Parked(Stopped):
    """The fork waits for a person's decision on `calls` (launch policy `park`)."""

    def __init__(self, calls: list[ParkedCall]) -> None:
        super().__init__(StopReason.AWAITING_APPROVAL)
        self.calls = calls


class Spawner(Protocol):
    """Launches a nested regular subagent for an Agent call and waits for its result."""

    def spawn(
        self,
        record: BootstrapRecord,
        args: Mapping[str, Any],
        child_id: str,
        *,
        cancelled: Callable[[], bool],
        deadline: float,
        workspace: Workspace | None = None,
    ) -> dict[str, Any]:
        """`{"output": ...}` or `{"error": ...}` by `deadline` (monotonic); raises `Stopped` when the
        caller must stop meanwhile (shutdown, lost lease). A nested subagent works in the caller's `workspace`:
        it starts from the caller's files as they are, and what it changed is merged back when it ends."""
        ...


INTERRUPTED_ERROR: Final = (
    "This tool call was interrupted: the worker running it stopped before it finished. It may or may not "
    "have taken effect; check the current state before you repeat it."
)
NO_SPAWNER: Final = "Error: this worker cannot launch sub-agents. Complete this task directly with your own tools."


@dataclass
class ChildLoop:
    """One fork's agent loop over its seed and journal."""

    record: BootstrapRecord
    seed: ForkSeed
    provider: ModelProvider
    tools: ToolRegistry
    io: ForkIO
    entries: list[JournalEntry] = field(default_factory=list)
    max_turns: int = 200
    max_wall_s: float = 3600.0
    running_s: float = 0.0  # time since the fork's first start, before this run
    max_depth: int = 3
    schema_retries: int = 2
    spawner: Spawner | None = None
    cancelled: Callable[[], bool] = never_cancelled  # a tool polls it (cancel, lost lease) while it runs
    digests: RequestDigests = field(default_factory=RequestDigests)  # a worker passes its own, shared by its forks
    tool_declarations: list[dict[str, Any]] | None = None  # `record.tools` parsed (a worker shares it)
    primed: PrimedCall | None = None  # the first call's digest, computed for the claim from this record
    workspace: Workspace | None = None  # a snapshot fork's files (None: its tools act on `record.cwd` in place)
    guard: CallGuard = UNGUARDED  # budgets and admission before each model call (`workers.loop.guard`)
    declarations: list[dict[str, Any]] = field(init=False)  # parsed once, sent with every request
    gate: Gate = field(init=False)

    def __post_init__(self) -> None:
        record = self.record
        self.declarations = record.tools if self.tool_declarations is None else self.tool_declarations
        self._by_name = {str(d.get("name")): d for d in self.declarations}
        options = record.options
        # fork_tools (a fork_turns fork) or the launch's tool_filter (declarations already narrowed to it)
        allowlist = options.fork_tools if options.fork_tools is not None else options.tool_filter
        self.gate = Gate(
            kind=record.kind,
            teammate=record.name is not None,
            depth=record.depth,
            max_depth=min(self.max_depth, options.max_depth or self.max_depth),  # a launch lowers it, never raises
            mode=effective_mode(record.approval_mode),
            policy=options.approval_policy or "deny",
            allowlist=None if allowlist is None else tuple(allowlist),
        )
        self.max_turns = min(self.max_turns, options.max_turns or self.max_turns)
        self.max_wall_s = min(self.max_wall_s, float(options.max_wall_s or self.max_wall_s))
        self.schema: dict[str, Any] | None = options.output_schema

    def run(self) -> ForkResult:
        """Run to the final answer or the turn limit.

        Raises:
            Stopped: at a boundary, when the fork must stop (cancel, shutdown, lost lease).
            LeaseLost: a fenced journal write was refused.
        """
        started = self._began = time.monotonic()
        self._deadline = started + self.max_wall_s - self.running_s
        state = self._state = replay(self.seed, self.entries, fork_id=self.record.fork_id)
        if self.workspace is not None:  # the files as of the last journaled step, on whichever worker this is
            self.workspace.open(state.changes)
        while True:
            if state.final is not None:
                output, error = self._final(state)
                if error is None and output is not None and self._deliver(state):
                    continue  # a message arrived: the next exchange starts from this answer
                if output is not None or error is not None:
                    status = Status.SUCCEEDED if error is None else Status.FAILED
                    return self._result(state, started, status, output, error)
                continue
            if time.monotonic() >= self._deadline:
                error = f"wall_clock: stopped after {self.max_wall_s:g} s (the fork's wall-clock limit)"
                return self._result(state, started, Status.FAILED, None, error)
            if state.pending:
                self._run_tools(state, self._deadline)
                continue
            if state.step - state.exchange_step >= self.max_turns:  # per exchange: a continuation starts afresh
                return self._result(
                    state, started, Status.FAILED, None, f"max_turns: stopped after {self.max_turns} model calls"
                )
            if state.step > 0:  # never before the first call: its request is the launch's own (primed)
                self._deliver(state)
            self._model_step(state)

    @property
    def state(self) -> Conversation | None:
        """Where the run stands (None before `run`): always the replay of the journal written so far."""
        return getattr(self, "_state", None)

    def usage(self) -> Usage:
        """What the fork consumed so far (for a run that failed with an exception)."""
        state = self.state
        if state is None:
            return Usage()
        return self._result(state, self._began, Status.FAILED, None, None).usage

    def _primed_digest(self, request: ModelRequest) -> str | None:
        """The primed call's digest if `request` is that call's (once: a later request is another's)."""
        primed, self.primed = self.primed, None
        if primed is not None and primed.matches(request.tools, request.step, request.messages):
            return primed.digest
        return None

    def _final(self, state: Conversation) -> tuple[str | None, str | None]:
        """(output, None) or (None, error) for the final answer; (None, None) after sending it back."""
        assert state.final is not None
        text = final_text(state.final)
        if text == NO_OUTPUT and state.finish_reason == "content_filter":
            return None, "content_filter: the provider blocked the model's answer (finish reason content_filter)"
        if self.schema is None:
            return text, None
        value, problem = check_answer(text, self.schema)
        if problem is None:
            return value, None
        if state.feedbacks >= self.schema_retries:
            tries = state.feedbacks + 1
            return None, f"output_schema: the final answer did not match the schema after {tries} tries: {problem}"
        content = Content(role="user", parts=[Part(text=feedback_text(problem))])
        self._write(state, step=state.step, kind=EntryKind.FEEDBACK, content=content)
        self.io.emit(FeedbackEvent(data=FeedbackData(step=state.step, error=problem[:500])))
        return None, None

    def _deliver(self, state: Conversation) -> bool:
        """Deliver the messages waiting in the inbox as user messages, between steps; True if there were any."""
        texts = self.io.take_mail()
        if not texts:
            return False
        entries = [
            JournalEntry(
                seq=state.next_seq + i,
                step=state.step,
                kind=EntryKind.MESSAGE,
                content=Content(role="user", parts=[Part(text=text)]),
            )
            for i, text in enumerate(texts)
        ]
        self.io.emit(MessageEvent(data=MessageData(step=state.step, count=len(entries))))
        self.io.deliver(entries)
        for entry in entries:
            state.apply(entry)
        return True

    def _write(self, state: Conversation, *, boundary: bool = False, **fields: Any) -> None:
        """Journal the next entry, then apply that same entry: the live state is what a replay rebuilds."""
        entry = JournalEntry(seq=state.next_seq, **fields)
        self.io.append(entry, boundary=boundary)
        state.apply(entry)

    def _model_step(self, state: Conversation) -> None:
        request = self._request(state.step, state.messages)
        digest = self._primed_digest(request) or self.digests.digest(request)  # what the model sees (no directive)
        self.io.emit(model_call_event(state.step, digest))
        self.io.checkpoint()
        # time spent waiting for admission is not the fork's work: it moves the wall-clock deadline on
        self._deadline += self.guard.enter(request)
        try:
            response = self.provider.generate(request)
        except BaseException:
            self.guard.leave(request, None)
            raise
        self.guard.leave(request, response.usage)
        content = response.content
        calls = calls_of(content)
        answered = StepData(
            step=state.step + 1,
            tool_calls=[c.name for _, c in calls],
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            cached_input_tokens=response.usage.cached_input_tokens,
        )
        self.io.emit(StepEvent(data=answered))
        self._write(
            state,
            step=state.step,
            kind=EntryKind.MODEL,
            content=content,
            request_digest=digest,
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            cached_input_tokens=response.usage.cached_input_tokens
            or None,  # absent when none: entries keep their bytes
            invalid_calls=response.invalid_calls or None,
            finish_reason=None if response.finish_reason in ("stop", "tool_calls") else response.finish_reason,
        )

    def _run_tools(self, state: Conversation, deadline: float) -> None:
        step = state.step - 1
        for pending in list(state.pending):
            if time.monotonic() >= deadline:
                return  # run() ends the fork at its wall-clock limit
            call = pending.call
            outcome = self._outcome(state, step, pending)
            # the files the call changed go with its result, fenced like it: a revival rebuilds them from the journal
            changes, outcome = self._checkpoint(outcome)
            self.io.emit(ToolEvent(data=ToolData(step=step + 1, tool=call.name, ok="error" not in outcome)))
            self._write(
                state,
                step=step,
                kind=EntryKind.TOOL_RESULT,
                call_index=pending.index,
                call_id=call.id,
                name=call.name,
                response=outcome,
                changes=changes,
            )  # applying the step's last result adds the answers to the messages

    def _checkpoint(self, outcome: dict[str, Any]) -> tuple[list[Any] | None, dict[str, Any]]:
        """The files the call changed (None: none, or a shared fork), and the call's outcome: an error instead when
        the call grew the workspace past its bounds (its changes are then kept out of the journal, until a later
        call brings the tree back under the bounds)."""
        if self.workspace is None:
            return None, outcome
        try:
            return self.workspace.checkpoint(), outcome
        except WorkspaceTooLarge as exc:
            return None, {
                "error": f"{exc}. Remove or shrink files so the workspace fits; until then this call's file "
                "changes are not recorded (a restarted run would not have them)"
            }

    def _outcome(self, state: Conversation, step: int, pending: PendingCall) -> dict[str, Any]:
        """Pass the call through the gate (nesting, declarations, allowlist, approval), then run it."""
        call = pending.call
        name = call.name or ""
        if pending.invalid is not None:  # garbled by the provider: the model reads why, nothing runs
            return {"error": pending.invalid}
        agent = is_agent_call(name, self._by_name)
        problem = self.gate.nesting_error(call.args or {}) if agent else None
        if problem is None and name not in self._by_name:
            # the fork runs only what its parent gave it, whatever else this worker could execute
            problem = undeclared_error(name, list(self._by_name))
        if agent:
            return {"error": problem} if problem else self._spawn(state, step, pending)
        problem = problem or self.gate.allowlist_error(name)
        tool = self.tools.get(name)
        if problem is None and tool is not None:
            refusal = self._approval(state, step, pending, tool)
            if refusal is not None:
                return refusal
            if pending.started and not tool.idempotent:
                return {"error": INTERRUPTED_ERROR}
            self._started(state, step, pending)
        if problem is not None:
            return {"error": problem}
        # a tool this worker lacks gets the registry's error naming it; nothing was started
        return self.tools.run(call, self._context(step, pending))

    def _approval(self, state: Conversation, step: int, pending: PendingCall, tool: Tool) -> dict[str, Any] | None:
        """None when the call may run; a denial otherwise. Raises `Parked` to wait for a person."""
        if not needs_approval(tool, self.gate.mode):
            return None
        decision = state.decisions.get(pending.index)
        if decision is None and self.gate.policy == "deny":
            return {"error": denied_by_policy(tool.name, self.record.approval_mode)}
        if decision is None:
            raise Parked(self._awaiting(state, step))
        if decision.decision == "deny":
            return {"error": denied_by_user(tool.name, decision.reason)}
        return None

    def _started(self, state: Conversation, step: int, pending: PendingCall) -> None:
        call = pending.call
        self._write(
            state,
            boundary=True,
            step=step,
            kind=EntryKind.TOOL_STARTED,
            call_index=pending.index,
            call_id=call.id,
            name=call.name,
        )

    def _context(self, step: int, pending: PendingCall) -> ToolContext:
        ctx = ToolContext(
            fork_id=self.record.fork_id,
            cwd=Path(self.record.cwd),
            call_id=pending.call.id,
            idempotency_key=f"{self.record.fork_id}:{step}:{pending.call.id or pending.index}",
            cancelled=self.cancelled,
            deadline=self._deadline,  # a tool call never outlasts the fork's wall-clock limit
        )
        return ctx if self.workspace is None else self.workspace.context(ctx)

    def _spawn(self, state: Conversation, step: int, pending: PendingCall) -> dict[str, Any]:
        """Launch (or, after a revival, rejoin) the nested subagent; its id is fixed by this call's position."""
        if self.spawner is None:
            return {"error": NO_SPAWNER}
        self._started(state, step, pending)
        child_id = f"{self.record.fork_id}.{step}.{pending.index}"
        return self.spawner.spawn(
            self.record,
            pending.call.args or {},
            child_id,
            cancelled=self.cancelled,
            deadline=self._deadline,
            workspace=self.workspace,
        )

    def _awaiting(self, state: Conversation, step: int) -> list[ParkedCall]:
        """The calls of this step that wait for a person: approval needed, undecided, past the other gates."""
        calls = []
        for pending in state.pending:
            call = pending.call
            tool = self.tools.get(call.name)
            if (
                pending.invalid is None
                and tool is not None
                and tool.name in self._by_name
                and not is_agent_call(call.name, self._by_name)
                and self.gate.allowlist_error(tool.name) is None
                and needs_approval(tool, self.gate.mode)
                and pending.index not in state.decisions
            ):
                calls.append(
                    ParkedCall(
                        call_id=approval_id(step, pending),
                        index=pending.index,
                        step=step,
                        name=tool.name,
                        args=dict(call.args or {}),
                    )
                )
        return calls

    def _request(self, step: int, messages: list[Content]) -> ModelRequest:
        return model_request(self.record, self.declarations, step, messages)

    def _result(
        self, state: Conversation, started: float, status: Status, output: str | None, error: str | None
    ) -> ForkResult:
        duration_ms = int((time.monotonic() - started + self.running_s) * 1000)  # since the exchange's first start
        usage = state.usage.model_copy(update={"duration_ms": duration_ms})
        run_usage = None
        if state.exchange_step > 0:  # a continuation: the usage above is the whole conversation's
            run_usage = state.exchange.usage.model_copy(update={"duration_ms": duration_ms})
        return ForkResult(
            fork_id=self.record.fork_id, status=status, output=output, usage=usage, error=error, run_usage=run_usage
        )


def model_request(
    record: BootstrapRecord, declarations: list[dict[str, Any]], step: int, messages: list[Content]
) -> ModelRequest:
    """The model request of step `step` over `messages`.

    Built without validation (every field comes from a validated record or is a Content), so the
    request holds `declarations` itself: `RequestDigests` encodes it once per loop, not per step.
    """
    return ModelRequest.model_construct(
        fork_id=record.fork_id,
        step=step,
        model=record.model,
        system_instruction=record.system_instruction,
        tools=declarations,
        messages=list(messages),
        generation=record.generation,
        directive=record.directive,
        output_schema=record.options.output_schema,
        cache_key=record.parent_session,  # sibling forks (and nested subagents) of one parent share the cache
    )


def model_call_event(step: int, digest: str) -> ModelCallEvent:
    """The `model_call` event published before model call `step` (0-based) is made."""
    return ModelCallEvent(data=ModelCallData(step=step + 1, request_digest=digest))


@dataclass(frozen=True, slots=True)
class PrimedCall:
    """A model call whose request digest is known before the loop builds the request: the first call of a
    first run, which the claim announced (`first_model_call`). Its digest stands for a request of the same
    record, declarations, step and messages; `ChildLoop` checks the last three and uses it once."""

    step: int
    declarations: list[dict[str, Any]]
    messages: list[Content]
    digest: str

    def event(self) -> ModelCallEvent:
        """The `model_call` event of this call."""
        return model_call_event(self.step, self.digest)

    def matches(self, declarations: list[dict[str, Any]], step: int, messages: list[Content]) -> bool:
        """Whether a request of these declarations, step and messages (and the record this call was made
        for) is this call's. List equality compares each element by identity first, so this is cheap
        when the messages are the ones this call was made from, and exact when they are not."""
        return step == self.step and declarations == self.declarations and messages == self.messages


def first_model_call(
    record: BootstrapRecord, seed: ForkSeed, digests: RequestDigests, declarations: list[dict[str, Any]]
) -> PrimedCall:
    """The first model call of a fork, which a run over an empty journal (or one holding only the tool
    surface) makes before anything else: the request `ChildLoop` builds (`declarations` being `record.tools`)."""
    state = replay(seed, [])
    messages = list(state.messages)
    digest = digests.digest(model_request(record, declarations, state.step, messages))
    return PrimedCall(state.step, declarations, messages, digest)


def approval_id(step: int, pending: PendingCall) -> str:
    """The id a person uses to approve or deny a call: the model's call id, else `<step>.<index>`."""
    return pending.call.id or f"{step}.{pending.index}"


def final_text(content: Content) -> str:
    """The model-visible text of a final answer (thoughts excluded)."""
    text = visible_text(content)
    return text if text.strip() else NO_OUTPUT

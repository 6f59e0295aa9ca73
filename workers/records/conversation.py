"""A fork's conversation: the one fold of its journal (entries → state) that every reader of a journal uses.

`Conversation.apply` moves the state on by one journal entry, and it is the only code that gives an
entry its meaning. The live loop applies each entry it journals and a revived run folds the stored
journal over the seed (`workers.loop.replay`), so the two rebuild the same messages; every other reader
folds the entries alone (`fold`): the usage a cancel records (`journal_usage`), the exchanges
`forkq inspect` lists (`exchanges`), the steps of the transcript (`Conversation.steps`, mapped by
`workers.api.transcript`), and the runner's checks (`recorded_surface`, the fold's `surface` read without
folding the rest, and `is_final_answer`).
`apply` handles every `EntryKind` (mypy rejects a missing case, and a test applies every kind).

A fold is strict or lenient about a journal the loop could not have written (a model response while
calls wait for results, a call answered twice or never made, a message while calls wait):
- strict (the loop's replay) raises `RecordDecodeError`: replaying on would build a history no run had;
- lenient (the readers) never raises: the entry still counts (usage, steps, exchanges), only its effect
  on the messages is left out, so a damaged journal is shown, and a cancel of its fork still succeeds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, TypedDict, assert_never

from workers.errors import ForkqError, RecordDecodeError
from workers.history.messages import Content, FunctionCall, FunctionResponse, Part
from workers.records.fork import Usage
from workers.records.journal import EntryKind, JournalEntry
from workers.workspace.manifest import Changes, decode_changes

if TYPE_CHECKING:  # a type only: inspect and a cancel fold a journal without loading history selection
    from workers.history.selection import ForkSeed

MALFORMED_CALL: Final = "malformed_function_call"  # Gemini's finish reason for a call it could not emit


def malformed_call_message() -> Content:
    """What the model reads after a response the provider ended as a malformed function call."""
    return Content(
        role="user",
        parts=[
            Part(
                text="Your last function call was malformed and could not be parsed, so nothing was run. "
                "Call the tool again with valid arguments, or answer in text."
            )
        ],
    )


def calls_of(content: Content) -> list[tuple[int, FunctionCall]]:
    """The function calls of a model Content with their positions."""
    calls = (p.function_call for p in content.parts)
    return [(i, c) for i, c in enumerate(call for call in calls if call is not None)]


def visible_text(content: Content) -> str:
    """The text of a message a reader sees (thoughts left out)."""
    return "".join(p.text for p in content.parts if p.text is not None and not p.thought)


def response_part(call: FunctionCall, response: dict[str, Any]) -> Part:
    """The functionResponse part answering `call`."""
    return Part(function_response=FunctionResponse(id=call.id, name=call.name, response=response))


def is_final_answer(entry: JournalEntry) -> bool:
    """A model response without calls that ended normally (not malformed, cut or filtered): one that makes the
    fold's `final` its content and ends the run (the runner holds it back to write it with the result)."""
    return entry.kind is EntryKind.MODEL and entry.finish_reason is None and not calls_of(_content(entry, "model"))


@dataclass
class PendingCall:
    """A call of the last model Content that has no recorded result yet."""

    index: int
    call: FunctionCall
    started: bool  # a `tool_started` entry exists: the call may have taken effect
    invalid: str | None = None  # the provider returned this call unusable: answer with this error, run nothing


class Decision(NamedTuple):
    """A person's answer to a parked call."""

    decision: Literal["approve", "deny"]
    reason: str | None = None


# ── the steps a person reads ─────────────────────────────────────────────────────────────────
# (named tuples: immutable records, and cheap to define, which a launcher importing the client pays for)


class ModelTurn(NamedTuple):
    """A model response: its Content (text, thoughts, calls), tokens, and why it stopped when not normally."""

    seq: int
    step: int
    content: Content
    calls: list[tuple[int, FunctionCall]]
    input_tokens: int
    output_tokens: int
    finish_reason: str | None


class ToolResult(NamedTuple):
    """A tool call's result: `{"output": ...}` or `{"error": ...}`, and the workspace files it changed."""

    seq: int
    step: int
    call_id: str | None
    name: str | None
    response: dict[str, Any]
    changed: tuple[str, ...] = ()


class Approval(NamedTuple):
    """A person's decision on a parked call."""

    seq: int
    step: int
    call_id: str | None
    name: str | None
    decision: Literal["approve", "deny"] | None
    reason: str | None
    decided_by: str | None = None  # the audit: `token:<id>` or `local`, the tenant, and when (Unix ms)
    decided_tenant: str | None = None
    decided_ms: int | None = None


class Feedback(NamedTuple):
    """The user message that sent back a final answer failing the output schema."""

    seq: int
    step: int
    content: Content


class Delivered(NamedTuple):
    """A message `send` gave the fork, as the worker delivered it (a user Content)."""

    seq: int
    step: int
    content: Content


ReadStep = ModelTurn | ToolResult | Approval | Feedback | Delivered  # the entries a person reads, in journal order


@dataclass(slots=True)
class Tally:
    """Counts of model calls, tokens and tool uses (plain ints: the fold adds to them at every entry)."""

    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    tool_uses: int = 0

    @property
    def usage(self) -> Usage:
        """As the records' `Usage` (no duration: the journal has none)."""
        return Usage(
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            total_tokens=self.input_tokens + self.output_tokens,
            tool_uses=self.tool_uses,
            model_calls=self.model_calls,
            cached_input_tokens=self.cached_input_tokens,
        )


class ExchangeSummary(TypedDict):
    """An exchange as `forkq inspect` lists it: texts only."""

    message: str
    during: list[str]
    answer: str | None


@dataclass
class Exchange:
    """One exchange: the message that began it, the messages delivered while it ran, its answer and usage."""

    message: Content | None  # None: the launch's task (the first exchange)
    step: int  # the model call it began at
    during: list[Content] = field(default_factory=list)
    answer: Content | None = None  # its final answer; None while it has none (calls wait, or it was sent back)
    feedbacks: int = 0  # final answers sent back for failing the output schema
    tally: Tally = field(default_factory=Tally)  # of this exchange alone

    @property
    def usage(self) -> Usage:
        """This exchange's own usage."""
        return self.tally.usage

    def summary(self, directive: str) -> ExchangeSummary:
        """Its texts; `directive` stands for the launch's task."""
        return {
            "message": directive if self.message is None else visible_text(self.message),
            "during": [visible_text(m) for m in self.during],
            "answer": None if self.answer is None else visible_text(self.answer),
        }


@dataclass
class Conversation:
    """Where a fork stands after the journal entries applied so far (the state of the fold)."""

    # the seed's and the task prompt (a state `start`ed from a seed), then the journal's
    messages: list[Content] = field(default_factory=list)
    step: int = 0  # index of the next model call
    next_seq: int = 0
    calls: list[tuple[int, FunctionCall]] = field(default_factory=list)  # of the last model Content
    pending: list[PendingCall] = field(default_factory=list)  # its calls with no recorded result, in call order
    answers: dict[int, Part] = field(default_factory=dict)  # results recorded for the last model Content
    decisions: dict[int, Decision] = field(default_factory=dict)  # approvals for the last model Content's calls
    finish_reason: str = "stop"  # of the last model response (`stop` also for `tool_calls`)
    tally: Tally = field(default_factory=Tally)  # the whole conversation's
    surface: list[str] | None = None  # the tools the first worker could execute, once recorded
    # a snapshot fork's workspace: every file its tool calls changed since its base snapshot (path → entry, None:
    # removed), the latest change of a path winning; base manifest + these = the fork's tree as of its last step
    changes: Changes = field(default_factory=dict)
    exchanges: list[Exchange] = field(default_factory=lambda: [Exchange(message=None, step=0)])
    steps: list[ReadStep] = field(default_factory=list)
    fork_id: str | None = field(default=None, compare=False)  # names the fork in a damaged journal's error
    strict: bool = field(default=True, compare=False)  # raise on a journal the loop could not have written

    @classmethod
    def start(cls, seed: ForkSeed, *, fork_id: str | None = None) -> Conversation:
        """The state before any entry of a fork run from `seed`: the seed's messages and the task prompt (strict)."""
        messages = [*seed.initial_messages, Content(role="user", parts=[Part(text=seed.task_prompt)])]
        return cls(messages=messages, fork_id=fork_id)

    @property
    def usage(self) -> Usage:
        """The whole conversation's usage."""
        return self.tally.usage

    @property
    def exchange(self) -> Exchange:
        """The current (last) exchange."""
        return self.exchanges[-1]

    @property
    def final(self) -> Content | None:
        """The model answered without calls (and was not sent back): the current exchange's output."""
        return self.exchange.answer

    @property
    def exchange_step(self) -> int:
        """`step` when the current exchange began (the launch, or the message that continued the fork)."""
        return self.exchange.step

    @property
    def feedbacks(self) -> int:
        """Final answers of the current exchange sent back for failing the output schema."""
        return self.exchange.feedbacks

    def fold(self, entries: Iterable[JournalEntry]) -> Conversation:
        """Apply `entries` in order; returns this state."""
        for entry in entries:
            self.apply(entry)
        return self

    def apply(self, entry: JournalEntry) -> None:
        """Move on by one journal entry (the entry after the last one applied)."""
        self.next_seq = entry.seq + 1
        match entry.kind:
            case EntryKind.SURFACE:
                if self.surface is None:  # the first worker's surface: a revival checks its own against it
                    self.surface = surface_of(entry)
            case EntryKind.MODEL:
                self._model(entry)
            case EntryKind.TOOL_STARTED:
                self._tool_started(entry)
            case EntryKind.TOOL_RESULT:
                self._tool_result(entry)
            case EntryKind.APPROVAL:
                self._approval(entry)
            case EntryKind.FEEDBACK:
                self._feedback(entry)
            case EntryKind.MESSAGE:
                self._message(entry)
            case _:
                assert_never(entry.kind)

    def answer_content(self) -> Content:
        """The user Content answering the last model Content's calls, in call order."""
        return Content(role="user", parts=[self.answers[i] for i, _ in self.calls])

    def _damaged(self, entry: JournalEntry, problem: str) -> None:
        # a journal the loop could not have written: replaying on would build a history no run had
        if self.strict:
            raise RecordDecodeError(
                f"fork {self.fork_id or '?'}: journal entry {entry.seq} ({entry.kind}) {problem}; the journal is "
                "damaged: the fork cannot be revived from it (cancel it and launch it again)",
                fork_id=self.fork_id,
            )

    def _count(self, *, model: JournalEntry | None = None, tool_uses: int = 0) -> None:
        for tally in (self.tally, self.exchange.tally):
            tally.tool_uses += tool_uses
            if model is not None:
                tally.model_calls += 1
                tally.input_tokens += model.input_tokens
                tally.output_tokens += model.output_tokens
                tally.cached_input_tokens += model.cached_input_tokens or 0

    def _model(self, entry: JournalEntry) -> None:
        if self.pending:
            waiting = ", ".join(str(p.index) for p in self.pending)
            self._damaged(entry, f"is a model response while calls {waiting} of step {self.step - 1} have no result")
        if entry.content is None:
            self._damaged(entry, "has no content")
        content = _content(entry, "model")
        self._count(model=entry)
        self.messages.append(content)
        self.step = entry.step + 1
        self.calls = calls_of(content)
        invalid = entry.invalid_calls or {}
        self.pending = [PendingCall(i, c, started=False, invalid=invalid.get(c.id or "")) for i, c in self.calls]
        self.answers, self.decisions = {}, {}  # decisions are per step: an index means another call now
        self.exchange.answer = None if self.calls else content
        self.finish_reason = entry.finish_reason or "stop"
        if not self.calls and entry.finish_reason == MALFORMED_CALL:  # tell the model, do not end the fork
            self.messages.append(malformed_call_message())
            self.exchange.answer = None
        self.steps.append(
            ModelTurn(
                entry.seq,
                entry.step,
                content,
                self.calls,
                entry.input_tokens,
                entry.output_tokens,
                entry.finish_reason,
            )
        )

    def _tool_started(self, entry: JournalEntry) -> None:
        for pending in self.pending:
            if pending.index == entry.call_index:
                pending.started = True

    def _tool_result(self, entry: JournalEntry) -> None:
        self._count(tool_uses=1)  # every result is a tool use, as the cancel script counts them
        changed = self._workspace(entry)
        self.steps.append(ToolResult(entry.seq, entry.step, entry.call_id, entry.name, entry.response or {}, changed))
        if entry.call_index is None or entry.response is None:
            return
        call = dict(self.calls).get(entry.call_index)
        if call is None:
            self._damaged(entry, f"answers call {entry.call_index}, which step {self.step - 1} did not make")
            return
        if entry.call_index in self.answers:
            self._damaged(entry, f"answers call {entry.call_index} of step {self.step - 1} a second time")
            return
        self.answers[entry.call_index] = response_part(call, entry.response)
        remaining = [p for p in self.pending if p.index != entry.call_index]
        if len(remaining) < len(self.pending) and not remaining:  # the step's answers are complete: they join
            self.messages.append(self.answer_content())
        self.pending = remaining

    def _workspace(self, entry: JournalEntry) -> tuple[str, ...]:
        """Fold the files a call changed into `changes`; their paths."""
        if entry.changes is None:
            return ()
        try:
            changes = decode_changes(entry.changes)
        except ForkqError as exc:
            self._damaged(entry, f"records workspace changes that do not decode ({exc})")
            return ()
        self.changes.update(changes)
        return tuple(changes)

    def _approval(self, entry: JournalEntry) -> None:
        self.steps.append(
            Approval(
                entry.seq,
                entry.step,
                entry.call_id,
                entry.name,
                entry.decision,
                entry.reason,
                entry.decided_by,
                entry.decided_tenant,
                entry.decided_ms,
            )
        )
        # a decision belongs to the calls of the step it was made on
        if entry.call_index is not None and entry.decision is not None and entry.step == self.step - 1:
            self.decisions[entry.call_index] = Decision(entry.decision, entry.reason)

    def _feedback(self, entry: JournalEntry) -> None:
        self.steps.append(Feedback(entry.seq, entry.step, _content(entry, "user")))
        if entry.content is not None:
            self.messages.append(entry.content)
            self.exchange.answer = None
            self.exchange.feedbacks += 1

    def _message(self, entry: JournalEntry) -> None:
        if entry.content is None:
            return
        self.steps.append(Delivered(entry.seq, entry.step, entry.content))
        if self.pending:  # messages are delivered between steps, never while calls wait for results
            self._damaged(entry, f"is a message while calls of step {self.step - 1} have no result")
            return
        self.messages.append(entry.content)
        if self.final is not None:  # a message after the final answer starts the next exchange
            self.exchanges.append(Exchange(message=entry.content, step=self.step))
        else:
            self.exchange.during.append(entry.content)


def _content(entry: JournalEntry, role: Literal["user", "model"]) -> Content:
    """The entry's Content; an empty one of `role` when it has none (a damaged entry a lenient fold shows)."""
    return entry.content if entry.content is not None else Content(role=role)


def surface_of(entry: JournalEntry) -> list[str]:
    """The tools a `surface` entry records."""
    return list(entry.tools or [])


def recorded_surface(entries: Iterable[JournalEntry]) -> list[str] | None:
    """`fold(entries).surface` without folding the rest: the first `surface` entry's tools (None before one).

    A worker checks it at every claim, before its loop replays the journal; a surface entry is the journal's
    first, so this reads one entry where the fold would rebuild every message.
    """
    return next((surface_of(e) for e in entries if e.kind is EntryKind.SURFACE), None)


def fold(entries: Iterable[JournalEntry], *, fork_id: str | None = None) -> Conversation:
    """The conversation of journal entries alone (no seed), folded leniently: what every reader but the loop reads."""
    return Conversation(fork_id=fork_id, strict=False).fold(entries)


def journal_usage(journal: Sequence[bytes], fork_id: str) -> Usage:
    """Tokens and model calls (the model entries) and tool uses (the tool results) of stored journal entries.

    A damaged entry is skipped (one that does not decode), or counted without its effect on the messages
    (one out of order: the fold is lenient), never raised: this tallies what a cancelled fork used, and
    a cancel must not fail.
    """
    conversation = Conversation(fork_id=fork_id, strict=False)
    for raw in journal:
        try:
            entry = JournalEntry.decode(raw, fork_id=fork_id)
        except RecordDecodeError:
            continue
        conversation.apply(entry)
    return conversation.usage


def exchanges(directive: str, entries: Iterable[JournalEntry]) -> list[ExchangeSummary]:
    """A fork's conversation as `inspect` lists it: each exchange's message (`directive` first), the messages
    delivered while it ran (`during`), and its final answer (None while it has none)."""
    return [exchange.summary(directive) for exchange in fold(entries).exchanges]

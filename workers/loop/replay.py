"""A fork's loop state, and the one function that moves it on by a journal entry.

The live loop and a revived run share `LoopState.apply`: the live loop builds each entry, journals
it, then applies that same entry to its state; a revival folds `apply` over the stored journal
(`replay`). So the state after any live step is, by construction, the state a replay of its journal
rebuilds, and a revived fork's next model request is identical to the one the dead worker would
have made.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from workers.errors import RecordDecodeError
from workers.history.messages import Content, FunctionCall, FunctionResponse, Part
from workers.history.selection import ForkSeed
from workers.records.journal import JournalEntry

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


@dataclass
class PendingCall:
    """A call of the last model Content that has no recorded result yet."""

    index: int
    call: FunctionCall
    started: bool  # a `tool_started` entry exists: the call may have taken effect
    invalid: str | None = None  # the provider returned this call unusable: answer with this error, run nothing


@dataclass(frozen=True, slots=True)
class Decision:
    """A person's answer to a parked call."""

    decision: Literal["approve", "deny"]
    reason: str | None = None


def calls_of(content: Content) -> list[tuple[int, FunctionCall]]:
    """The function calls of a model Content with their positions."""
    calls = (p.function_call for p in content.parts)
    return [(i, c) for i, c in enumerate(call for call in calls if call is not None)]


def response_part(call: FunctionCall, response: dict[str, Any]) -> Part:
    """The functionResponse part answering `call`."""
    return Part(function_response=FunctionResponse(id=call.id, name=call.name, response=response))


@dataclass
class LoopState:
    """Where a fork stands after the journal entries applied so far: messages so far and what comes next."""

    messages: list[Content]
    step: int = 0  # index of the next model call
    next_seq: int = 0
    calls: list[tuple[int, FunctionCall]] = field(default_factory=list)  # of the last model Content
    pending: list[PendingCall] = field(default_factory=list)  # its calls with no recorded result, in call order
    answers: dict[int, Part] = field(default_factory=dict)  # results recorded for the last model Content
    final: Content | None = None  # the model answered without calls: the fork's output
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0  # the part of input_tokens the provider read from its prompt cache
    tool_uses: int = 0
    decisions: dict[int, Decision] = field(default_factory=dict)  # approvals for the last model Content's calls
    feedbacks: int = 0  # final answers sent back for failing the output schema
    exchange_step: int = 0  # `step` when the current exchange began (the launch, or the last message)
    exchange_input_tokens: int = 0  # tokens of the current exchange only
    exchange_output_tokens: int = 0
    exchange_cached_input_tokens: int = 0  # of the current exchange only, like the counters around it
    exchange_tool_uses: int = 0
    finish_reason: str = "stop"  # of the last model response (`stop` also for `tool_calls`)
    fork_id: str | None = field(default=None, compare=False)  # names the fork in a damaged journal's error

    @classmethod
    def start(cls, seed: ForkSeed, *, fork_id: str | None = None) -> LoopState:
        """The state before any entry: the seed's messages and the task prompt."""
        messages = [*seed.initial_messages, Content(role="user", parts=[Part(text=seed.task_prompt)])]
        return cls(messages=messages, fork_id=fork_id)

    def apply(self, entry: JournalEntry) -> None:
        """Move on by one journal entry (the entry after the last one applied)."""
        self.next_seq = entry.seq + 1
        match entry.kind:
            case "model":
                self._model(entry)
            case "tool_started":
                self._tool_started(entry)
            case "tool_result":
                self._tool_result(entry)
            case "approval":
                self._approval(entry)
            case "feedback":
                self._feedback(entry)
            case "message":
                self._message(entry)
            case "surface":
                pass  # which tools the first worker could execute: checked by the runner, not loop state

    def answer_content(self) -> Content:
        """The user Content answering the last model Content's calls, in call order."""
        return Content(role="user", parts=[self.answers[i] for i, _ in self.calls])

    def _damaged(self, entry: JournalEntry, problem: str) -> RecordDecodeError:
        # a journal the loop could not have written: replaying on would build a history no run had
        return RecordDecodeError(
            f"fork {self.fork_id or '?'}: journal entry {entry.seq} ({entry.kind}) {problem}; the journal is "
            "damaged: the fork cannot be revived from it (cancel it and launch it again)",
            fork_id=self.fork_id,
        )

    def _model(self, entry: JournalEntry) -> None:
        if self.pending:
            waiting = ", ".join(str(p.index) for p in self.pending)
            raise self._damaged(
                entry, f"is a model response while calls {waiting} of step {self.step - 1} have no result"
            )
        content = Content.model_validate(entry.content)
        self.messages.append(content)
        self.step = entry.step + 1
        self.input_tokens += entry.input_tokens
        self.output_tokens += entry.output_tokens
        self.exchange_input_tokens += entry.input_tokens
        self.exchange_output_tokens += entry.output_tokens
        self.cached_input_tokens += entry.cached_input_tokens or 0
        self.exchange_cached_input_tokens += entry.cached_input_tokens or 0
        self.calls = calls_of(content)
        invalid = entry.invalid_calls or {}
        self.pending = [PendingCall(i, c, started=False, invalid=invalid.get(c.id or "")) for i, c in self.calls]
        self.answers, self.decisions = {}, {}  # decisions are per step: an index means another call now
        self.final = None if self.calls else content
        self.finish_reason = entry.finish_reason or "stop"
        if not self.calls and entry.finish_reason == MALFORMED_CALL:  # tell the model, do not end the fork
            self.messages.append(malformed_call_message())
            self.final = None

    def _tool_started(self, entry: JournalEntry) -> None:
        for pending in self.pending:
            if pending.index == entry.call_index:
                pending.started = True

    def _tool_result(self, entry: JournalEntry) -> None:
        if entry.call_index is None or entry.response is None:
            return
        call = dict(self.calls).get(entry.call_index)
        if call is None:
            raise self._damaged(entry, f"answers call {entry.call_index}, which step {self.step - 1} did not make")
        if entry.call_index in self.answers:
            raise self._damaged(entry, f"answers call {entry.call_index} of step {self.step - 1} a second time")
        self.answers[entry.call_index] = response_part(call, entry.response)
        self.tool_uses += 1
        self.exchange_tool_uses += 1
        remaining = [p for p in self.pending if p.index != entry.call_index]
        if len(remaining) < len(self.pending) and not remaining:  # the step's answers are complete: they join
            self.messages.append(self.answer_content())
        self.pending = remaining

    def _approval(self, entry: JournalEntry) -> None:
        # a decision belongs to the calls of the step it was made on
        if entry.call_index is not None and entry.decision is not None and entry.step == self.step - 1:
            self.decisions[entry.call_index] = Decision(entry.decision, entry.reason)

    def _feedback(self, entry: JournalEntry) -> None:
        if entry.content is not None:
            self.messages.append(Content.model_validate(entry.content))
            self.final = None
            self.feedbacks += 1

    def _message(self, entry: JournalEntry) -> None:
        if entry.content is None:
            return
        if self.pending:  # messages are delivered between steps, never while calls wait for results
            raise self._damaged(entry, f"is a message while calls of step {self.step - 1} have no result")
        self.messages.append(Content.model_validate(entry.content))
        if self.final is not None:  # a message after the final answer starts the next exchange
            self.exchange_step = self.step
            self.exchange_input_tokens = self.exchange_output_tokens = self.exchange_tool_uses = 0
            self.exchange_cached_input_tokens = 0
            self.feedbacks = 0
        self.final = None


def replay(seed: ForkSeed, entries: Iterable[JournalEntry], *, fork_id: str | None = None) -> LoopState:
    """Rebuild a fork's state from its seed and its journal entries (in order).

    Raises:
        RecordDecodeError: the entries are not a journal the loop writes (a model response while calls
            wait for their results, a call answered twice or never made); `fork_id` names the fork.
    """
    state = LoopState.start(seed, fork_id=fork_id)
    for entry in entries:
        state.apply(entry)
    return state

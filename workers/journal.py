"""The step journal: a fork's own messages after its seed, and how a revived run replays them.

The first entry (`surface`) records which declared tools the first worker could execute; then one
entry per model response, and for each tool call one `tool_started` before it runs and one
`tool_result` after. Replaying the entries over the seed rebuilds the exact messages the original
run had, so a revived fork's next model request is identical to the one the dead worker made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict

from workers import codec
from workers.errors import RecordDecodeError
from workers.history import ForkSeed
from workers.messages import Content, FunctionCall, FunctionResponse, Part

INTERRUPTED_ERROR: Final = (
    "This tool call was interrupted: the worker running it stopped before it finished. It may or may not "
    "have taken effect; check the current state before you repeat it."
)


class JournalEntry(BaseModel):
    """One journal entry; `seq` is its position, checked on append so no entry is written twice."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = 1
    seq: int
    step: int
    kind: Literal["surface", "model", "tool_started", "tool_result"]
    content: dict[str, Any] | None = None  # model: the response Content (wire form)
    request_digest: str | None = None  # model: digest of the request that produced it
    invalid_calls: dict[str, str] | None = None  # model: call id → error, for calls the provider garbled
    input_tokens: int = 0
    output_tokens: int = 0
    call_index: int | None = None  # tools: position of the call in the step's model Content
    call_id: str | None = None
    name: str | None = None
    response: dict[str, Any] | None = None  # tool_result: {"output": ...} or {"error": ...}
    tools: list[str] | None = None  # surface: declared tools the first worker could execute

    def encode(self) -> bytes:
        """Canonical bytes."""
        return codec.encode(self.model_dump(exclude_none=True))

    @classmethod
    def decode(cls, data: bytes, *, fork_id: str) -> JournalEntry:
        """From stored bytes."""
        raw = codec.decode(data, what=f"fork {fork_id}: journal entry")
        try:
            return cls.model_validate(raw)
        except ValueError as exc:
            raise RecordDecodeError(f"fork {fork_id}: journal entry is malformed: {exc}", fork_id=fork_id) from exc


@dataclass
class PendingCall:
    """A call of the last model Content that has no recorded result yet."""

    index: int
    call: FunctionCall
    started: bool  # a `tool_started` entry exists: the call may have taken effect
    invalid: str | None = None  # the provider returned this call unusable: answer with this error, run nothing


@dataclass
class Replay:
    """Where a fork stands after its journal: messages so far and what comes next."""

    messages: list[Content]
    step: int = 0  # index of the next model call
    next_seq: int = 0
    pending: list[PendingCall] = field(default_factory=list)
    answers: dict[int, Part] = field(default_factory=dict)  # results recorded for the last model Content
    final: Content | None = None  # the model answered without calls: the fork's output
    input_tokens: int = 0
    output_tokens: int = 0
    tool_uses: int = 0

    def answer_content(self, calls: list[tuple[int, FunctionCall]]) -> Content:
        """The user Content answering the last model Content's calls, in call order."""
        return Content(role="user", parts=[self.answers[i] for i, _ in calls])


def calls_of(content: Content) -> list[tuple[int, FunctionCall]]:
    """The function calls of a model Content with their positions."""
    calls = (p.function_call for p in content.parts)
    return [(i, c) for i, c in enumerate(call for call in calls if call is not None)]


def response_part(call: FunctionCall, response: dict[str, Any]) -> Part:
    """The functionResponse part answering `call`."""
    return Part(function_response=FunctionResponse(id=call.id, name=call.name, response=response))


def replay(seed: ForkSeed, entries: list[JournalEntry]) -> Replay:
    """Rebuild a fork's state from its seed and its journal entries (in order)."""
    state = Replay(messages=[*seed.initial_messages, Content(role="user", parts=[Part(text=seed.task_prompt)])])
    calls: list[tuple[int, FunctionCall]] = []
    started: set[int] = set()
    invalid: dict[str, str] = {}
    for entry in entries:
        state.next_seq = entry.seq + 1
        if entry.kind == "model":
            if calls:  # the previous step's answers are complete: they join the messages
                state.messages.append(state.answer_content(calls))
            content = Content.model_validate(entry.content)
            state.messages.append(content)
            state.step = entry.step + 1
            state.input_tokens += entry.input_tokens
            state.output_tokens += entry.output_tokens
            calls, started, state.answers = calls_of(content), set(), {}
            invalid = entry.invalid_calls or {}
            state.final = None if calls else content
        elif entry.kind == "tool_started" and entry.call_index is not None:
            started.add(entry.call_index)
        elif entry.kind == "tool_result" and entry.call_index is not None and entry.response is not None:
            call = dict(calls)[entry.call_index]
            state.answers[entry.call_index] = response_part(call, entry.response)
            state.tool_uses += 1
    state.pending = [
        PendingCall(i, c, i in started, invalid.get(c.id or "")) for i, c in calls if i not in state.answers
    ]
    if calls and not state.pending:
        state.messages.append(state.answer_content(calls))
    return state


def request_digest(wire: dict[str, Any]) -> str:
    """Digest of a model request in wire form (compared across revivals)."""
    return codec.digest(codec.encode(wire))

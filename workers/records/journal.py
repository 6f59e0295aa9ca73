"""The step journal: a fork's own messages after its seed, and how a revived run replays them.

The first entry (`surface`) records which declared tools the first worker could execute; then one
entry per model response, and for each tool call one `tool_started` before it runs and one
`tool_result` after. A person's decision on a parked call is an `approval` entry (written by the
client while the fork is parked); a final answer that failed the output schema is followed by a
`feedback` entry, the user message that sent it back. Replaying the entries over the seed rebuilds
the exact messages the original run had, so a revived fork's next model request is identical to
the one the dead worker made.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel, ConfigDict
from pydantic_core import to_jsonable_python

from workers import codec
from workers.errors import RecordDecodeError
from workers.history.messages import Content, FunctionCall, FunctionResponse, Part
from workers.history.selection import ForkSeed
from workers.records.fork import Usage

if TYPE_CHECKING:  # a type only: the records a launcher reads load no provider code
    from workers.providers import ModelRequest

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
    kind: Literal["surface", "model", "tool_started", "tool_result", "approval", "feedback"]
    content: dict[str, Any] | None = None  # model: the response Content; feedback: the user Content (wire form)
    request_digest: str | None = None  # model: digest of the request that produced it
    invalid_calls: dict[str, str] | None = None  # model: call id → error, for calls the provider garbled
    finish_reason: str | None = None  # model: why it stopped, when not `stop`/`tool_calls`
    input_tokens: int = 0
    output_tokens: int = 0
    call_index: int | None = None  # tools: position of the call in the step's model Content
    call_id: str | None = None
    name: str | None = None
    response: dict[str, Any] | None = None  # tool_result: {"output": ...} or {"error": ...}
    tools: list[str] | None = None  # surface: declared tools the first worker could execute
    decision: Literal["approve", "deny"] | None = None  # approval: a person's answer for call `call_index`
    reason: str | None = None  # approval: why (optional, shown to the model on a denial)

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
    decisions: dict[int, Decision] = field(default_factory=dict)  # approvals for the last model Content's calls
    feedbacks: int = 0  # final answers sent back for failing the output schema
    finish_reason: str = "stop"  # of the last model response

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
            calls, started, state.answers, state.decisions = calls_of(content), set(), {}, {}
            invalid = entry.invalid_calls or {}
            state.final = None if calls else content
            state.finish_reason = entry.finish_reason or "stop"
            if not calls and entry.finish_reason == MALFORMED_CALL:
                state.messages.append(malformed_call_message())
                state.final = None
        elif entry.kind == "tool_started" and entry.call_index is not None:
            started.add(entry.call_index)
        elif entry.kind == "tool_result" and entry.call_index is not None and entry.response is not None:
            call = dict(calls)[entry.call_index]
            state.answers[entry.call_index] = response_part(call, entry.response)
            state.tool_uses += 1
        elif (
            entry.kind == "approval"
            and entry.call_index is not None
            and entry.decision is not None
            and entry.step == state.step - 1  # a decision belongs to the calls of the step it was made on
        ):
            state.decisions[entry.call_index] = Decision(entry.decision, entry.reason)
        elif entry.kind == "feedback" and entry.content is not None:
            state.messages.append(Content.model_validate(entry.content))
            state.final = None
            state.feedbacks += 1
    state.pending = [
        PendingCall(i, c, i in started, invalid.get(c.id or "")) for i, c in calls if i not in state.answers
    ]
    if calls and not state.pending:
        state.messages.append(state.answer_content(calls))
    return state


def request_digest(wire: dict[str, Any]) -> str:
    """Digest of a model request in wire form (compared across revivals)."""
    return codec.digest(codec.encode(wire))


STATIC_REQUEST_FIELDS: Final = ("tools", "system_instruction", "output_schema")  # the same objects at every step
STATIC_ENCODINGS_MAX: Final = 256


class RequestDigests:
    """`request_digest` of model requests, each message encoded once while it lives.

    The digest is that of `request.model_dump(mode="json", exclude={"directive"})`, built from the
    encoding of each message kept by identity (weakly: an entry goes with its Content), so a step
    encodes only its new messages, and forks sharing seed Contents (`workers.records.fork.ChunkCache`)
    share their encodings. Relies on what the chunk cache relies on: a Content is never changed in
    place. The tool declarations, system instruction and output schema, which a child loop passes to
    every request as the same objects, are encoded once per object too (kept, with a strong reference
    so that their id stays theirs, for the last `STATIC_ENCODINGS_MAX` objects); they are never
    changed in place either. Thread-safe without a lock: an entry is used only if its reference still
    points at the object asked for, so a race between threads costs at most a cache miss.
    """

    def __init__(self) -> None:
        self._encoded: dict[int, tuple[weakref.ref[Content], bytes]] = {}
        self._static: dict[int, tuple[object, bytes]] = {}

    def digest(self, request: ModelRequest) -> str:
        """The request's digest, equal to `request_digest(request.model_dump(mode="json", exclude={"directive"}))`."""
        fields = request.model_dump(mode="json", exclude={"directive", "messages", *STATIC_REQUEST_FIELDS})
        encoded = {name: self._static_encoding(getattr(request, name)) for name in STATIC_REQUEST_FIELDS}
        encoded["messages"] = codec.encode_array([self._encoding(m) for m in request.messages])
        return codec.digest(codec.encode_map(fields, encoded))

    def _static_encoding(self, value: object) -> bytes:
        key = id(value)
        entry = self._static.get(key)
        if entry is not None and entry[0] is value:
            return entry[1]
        data = codec.encode(to_jsonable_python(value, inf_nan_mode="null"))  # as model_dump(mode="json") does
        if len(self._static) >= STATIC_ENCODINGS_MAX:
            self._static.clear()  # a worker runs far fewer distinct loops at once; start over
        self._static[key] = (value, data)
        return data

    def _encoding(self, content: Content) -> bytes:
        key = id(content)
        entry = self._encoded.get(key)
        if entry is not None and entry[0]() is content:
            return entry[1]
        data = codec.encode(content.model_dump(mode="json"))
        self._encoded[key] = (weakref.ref(content, functools.partial(self._forget, key)), data)
        return data

    def _forget(self, key: int, _: object) -> None:
        entry = self._encoded.get(key)
        if entry is not None and entry[0]() is None:  # not an entry made since for a new object at this id
            self._encoded.pop(key, None)


def journal_usage(journal: Sequence[bytes], fork_id: str) -> Usage:
    """Tokens and model calls (the model entries) and tool uses (the tool results) of stored journal entries.

    A damaged entry is skipped, not raised: this tallies what a cancelled fork used, and a cancel must not fail.
    """
    usage = Usage()
    for raw in journal:
        try:
            entry = JournalEntry.decode(raw, fork_id=fork_id)
        except RecordDecodeError:
            continue
        if entry.kind == "model":
            usage.model_calls += 1
            usage.input_tokens += entry.input_tokens
            usage.output_tokens += entry.output_tokens
        elif entry.kind == "tool_result":
            usage.tool_uses += 1
    usage.total_tokens = usage.input_tokens + usage.output_tokens
    return usage

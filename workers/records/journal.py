"""The step journal: a fork's own messages after its seed, one entry at a time, and request digests.

The first entry (`surface`) records which declared tools the first worker could execute; then one
entry per model response, and for each tool call one `tool_started` before it runs and one
`tool_result` after. A person's decision on a parked call is an `approval` entry (written by the
client while the fork is parked); a final answer that failed the output schema is followed by a
`feedback` entry, the user message that sent it back. A message `send` gave the fork becomes a
`message` entry (a user Content) when the worker delivers it: before a model call, or instead of
ending the fork, whose next exchange then starts. `EntryKind` names the kinds; what a journal means
(its messages, usage, exchanges and the steps a person reads) is given by one fold of its entries,
`workers.records.conversation`: replaying the entries over the seed rebuilds the exact messages the
original run had, so a revived fork's next model request is identical to the one the dead worker made.
"""

from __future__ import annotations

import functools
import weakref
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel, ConfigDict
from pydantic_core import to_jsonable_python

from workers.base import codec
from workers.errors import RecordDecodeError
from workers.history.messages import Content

if TYPE_CHECKING:  # a type only: the records a launcher reads load no provider code
    from workers.providers import ModelRequest


class EntryKind(StrEnum):
    """What a journal entry records; stored as its value (the same words entries always had)."""

    SURFACE = "surface"  # the declared tools the first worker could execute
    MODEL = "model"  # a model response
    TOOL_STARTED = "tool_started"  # a call about to run (it may take effect)
    TOOL_RESULT = "tool_result"  # a call's result
    APPROVAL = "approval"  # a person's decision on a parked call
    FEEDBACK = "feedback"  # a final answer sent back for failing the output schema
    MESSAGE = "message"  # a message `send` gave the fork, delivered


class JournalEntry(BaseModel):
    """One journal entry; `seq` is its position, checked on append so no entry is written twice."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = 1
    seq: int
    step: int
    kind: EntryKind
    # model: the response Content; feedback, message: the user Content. Parsed when the entry is decoded (the one
    # place journal content is read), dumped in its wire form: the bytes are those of the wire dict it was before
    content: Content | None = None
    request_digest: str | None = None  # model: digest of the request that produced it
    invalid_calls: dict[str, str] | None = None  # model: call id → error, for calls the provider garbled
    finish_reason: str | None = None  # model: why it stopped, when not `stop`/`tool_calls`
    input_tokens: int = 0
    output_tokens: int = 0
    # model: the part of input_tokens read from the provider's prompt cache; None (left out) when none was reported,
    # so entries without it keep the bytes they always had
    cached_input_tokens: int | None = None
    call_index: int | None = None  # tools: position of the call in the step's model Content
    call_id: str | None = None
    name: str | None = None
    response: dict[str, Any] | None = None  # tool_result: {"output": ...} or {"error": ...}
    # tool_result of a snapshot fork: the workspace files the call changed, `[path, mode, size, digest]` or `[path]`
    # when removed (`workers.workspace.manifest.encode_changes`); left out when it changed none
    changes: list[Any] | None = None
    tools: list[str] | None = None  # surface: declared tools the first worker could execute
    decision: Literal["approve", "deny"] | None = None  # approval: a person's answer for call `call_index`
    reason: str | None = None  # approval: why (optional, shown to the model on a denial)
    # approval: who decided (`token:<id>` of an API token, `local` for ForkClient and the CLI), their tenant, and when
    # (Unix ms, the decider's clock); left out of entries written before the audit existed
    decided_by: str | None = None
    decided_tenant: str | None = None
    decided_ms: int | None = None

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


def request_digest(wire: dict[str, Any]) -> str:
    """Digest of a model request in wire form (compared across revivals)."""
    return codec.digest(codec.encode(wire))


STATIC_REQUEST_FIELDS: Final = ("tools", "system_instruction", "output_schema")  # the same objects at every step
STATIC_ENCODINGS_MAX: Final = 256


class RequestDigests:
    """`request_digest` of model requests, each message encoded once while it lives.

    The digest is that of `request.model_dump(mode="json", exclude={"directive"})` (a dump never holds the
    request's cache key, which routes it and is not what the model reads), built from the
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

"""The records a fork leaves in Redis: bootstrap record, state, result, and seed chunks."""

from __future__ import annotations

import enum
import json
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from broker_config.settings import DEFAULT_TENANT
from workers.base import codec
from workers.errors import RecordDecodeError, RecordIntegrityError
from workers.history.messages import Content, dump_contents, load_contents
from workers.history.params import ApprovalPolicy
from workers.history.selection import ForkSeed
from workers.history.snapshot import ApprovalMode
from workers.records.allocation import fills_its_class
from workers.records.parked import ParkedCall, WaitingFor, decode_parked, read_model_wait, read_wait
from workers.workspace.ref import WorkspaceRef

SCHEMA_VERSION: Final = 1
CHUNK_MAX_MESSAGES: Final = 64
CHUNK_MAX_BYTES: Final = 1 << 20
CHUNK_BOUNDARY_MODULUS: Final = 16  # content-defined boundaries: about one message in 16 ends a chunk
# a chunk of at least this many bytes also ends where it nearly fills its Redis allocation (`allocation`)
CHUNK_FIT_MIN_BYTES: Final = 16 << 10
CONTEXT_FIELDS: Final = ("system_instruction", "tools_json")  # stored once per parent, as a chunk
TAIL_MESSAGES: Final = 3  # the repaired end (redacted calls, placeholders + directive, ack) gets its own chunk
# a record naming more seed chunks names them through one seed index chunk, shared by the forks of one seed
# (62 digests took 2.1 KB of every fork's 2.6 KB record of a 5 MB parent); a few are cheaper named inline
SEED_INDEX_MIN_CHUNKS: Final = 9


class ChunkRefs(NamedTuple):
    """The chunks stored record bytes name: the context's, then the seed's, or the seed index's."""

    parent_session: str
    refs: list[bytes]  # [context, *seed chunks], or [context, seed index] when `indexed`
    indexed: bool


class Status(enum.StrEnum):
    """A fork's lifecycle status."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PAUSED = "paused"
    AWAITING_APPROVAL = "awaiting_approval"  # parked on calls a person must approve or deny; holds no worker

    @property
    def terminal(self) -> bool:
        """True once nothing more will happen to the fork."""
        return self in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    @property
    def parked(self) -> bool:
        """True while the fork waits for a person (approve or deny its calls, or resume it), holding no worker."""
        return self in (Status.PAUSED, Status.AWAITING_APPROVAL)


class ForkOptions(BaseModel):
    """The fork-only and launch options a bootstrap record keeps; a field left None is the default.

    Stored as a map of the options that are set, nothing else (a record launched without any holds `{}`),
    so records keep the bytes, and the digest, they had as a plain map. `max_wall_s` keeps the number the
    launch gave (an int stays an int in the canonical bytes).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    fork_tools: list[str] | None = None  # the execution allowlist (forks only); [] runs no tool
    approval_policy: ApprovalPolicy | None = None  # None: `deny`
    output_schema: dict[str, Any] | None = None  # the final answer's JSON schema, checked at launch
    max_wall_s: int | float | None = None  # the launch's own limits, below the worker's
    max_turns: int | None = None
    max_tokens: int | None = None  # billed tokens at most (`workers.loop.budget`); at it the fork pauses
    seed_mode: Literal["completed_turns"] | None = None  # None: the fork_turns fork
    agent: str | None = None  # the definition a regular subagent (or a completed-turn fork) was resolved from
    agent_source: str | None = None  # where that definition was read: "built-in" or its file's name
    persona: bool | None = None  # True: the launch's persona replaced the system prompt
    tool_filter: list[str] | None = None  # the launch's filter: declarations narrowed, and refused at execution
    max_depth: int | None = None  # the deepest nesting below this launch; inherited by nested subagents

    @model_serializer(mode="wrap")
    def _set_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # an unset option is absent from the stored map, never a null: the bytes of today's records stay
        dumped: dict[str, Any] = handler(self)
        return {name: value for name, value in dumped.items() if value is not None}


class BootstrapRecord(BaseModel):
    """Everything needed to start a fork again with identical inputs; immutable once written.

    The seed's messages, and the system instruction with the tool declarations (the context), are
    stored as content-addressed chunks (BLAKE2b-256 of each chunk's bytes) that the record names by
    digest: the record stays small and the forks of one parent share what they have in common.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    fork_id: str
    parent_session: str
    kind: Literal["fork", "spawn"]
    seed_chunks: list[bytes]
    message_count: int
    task_prompt: str
    directive: str
    description: str
    subagent_type: str | None = None
    name: str | None = None
    system_instruction: str | dict[str, Any] | None = None
    tools_json: str = "[]"  # declarations as the parent sent them, key order kept (prompt-cache parity)
    model: str | None = None
    generation: dict[str, Any] = Field(default_factory=dict)
    approval_mode: ApprovalMode = "default"
    cwd: str = "."
    depth: int = 0
    fork_turns: str | None = None
    options: ForkOptions = Field(default_factory=ForkOptions)
    # the fork's files; None in records stored before workspaces existed (they act on `cwd` in place: shared)
    workspace: WorkspaceRef | None = None
    # the tenant that launched it; None for `default` (and in records stored before tenants existed)
    tenant: str | None = None

    @property
    def owner_tenant(self) -> str:
        """The tenant the fork belongs to."""
        return self.tenant or DEFAULT_TENANT

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tool declarations, in the parent's key order."""
        tools: list[dict[str, Any]] = json.loads(self.tools_json)
        return tools

    def context_blob(self) -> bytes:
        """The system instruction and tool declarations as one chunk, shared by the forks of a parent."""
        return codec.encode({"system_instruction": self.system_instruction, "tools_json": self.tools_json})

    def seed_index_blob(self) -> bytes | None:
        """The seed index chunk (the seed chunks' digests, in order), or None when the record names them itself."""
        if len(self.seed_chunks) < SEED_INDEX_MIN_CHUNKS:
            return None
        return codec.encode(self.seed_chunks)

    def encode(self) -> tuple[bytes, str]:
        """Stored bytes and their digest: the record, with its context replaced by the context chunk's digest
        and a long list of seed chunk digests by the seed index chunk's."""
        absent = {name for name in ("workspace", "tenant") if getattr(self, name) is None}  # old records' bytes
        fields = self.model_dump(exclude=set(CONTEXT_FIELDS) | absent)
        fields["context_chunk"] = chunk_digest(self.context_blob())
        index = self.seed_index_blob()
        if index is not None:
            del fields["seed_chunks"]
            fields["seed_index"] = chunk_digest(index)
        return codec.encode_with_digest(fields)

    @staticmethod
    def chunk_refs(data: bytes, *, fork_id: str) -> ChunkRefs:
        """The chunks stored record bytes name: context, then the seed chunks or the seed index."""
        raw = codec.decode(data, what=f"fork {fork_id}: bootstrap record")
        ref = raw.get("context_chunk") if isinstance(raw, dict) else None
        if not isinstance(ref, bytes) or not isinstance(raw.get("parent_session"), str):
            raise RecordDecodeError(f"fork {fork_id}: bootstrap record has no chunk references", fork_id=fork_id)
        if isinstance(index := raw.get("seed_index"), bytes):
            return ChunkRefs(raw["parent_session"], [ref, index], indexed=True)
        if not isinstance(seeds := raw.get("seed_chunks"), list):
            raise RecordDecodeError(f"fork {fork_id}: bootstrap record has no chunk references", fork_id=fork_id)
        return ChunkRefs(raw["parent_session"], [ref, *(d for d in seeds if isinstance(d, bytes))], indexed=False)

    @classmethod
    def decode(
        cls,
        data: bytes,
        *,
        fork_id: str,
        context: bytes,
        expected_digest: str | None = None,
        cache: ChunkCache | HeldChunks | None = None,
        index: bytes = b"",
    ) -> BootstrapRecord:
        """Verify (when a digest is given) and decode stored bytes, with the context chunk they name
        (and the seed index chunk, when they name one).

        With `cache`, a context or index chunk decoded before under the digest the record names is used
        without its bytes (which may then be empty), and a newly verified one is kept.

        Raises:
            RecordIntegrityError: the bytes do not hash to `expected_digest`, or the context or index
                chunk does not match the digest the record names.
            RecordDecodeError: the bytes are not a bootstrap record.
        """
        actual = codec.digest(data)
        if expected_digest is not None and actual != expected_digest:
            raise RecordIntegrityError(
                f"fork {fork_id}: bootstrap digest {expected_digest[:12]}… does not match the stored record "
                f"{actual[:12]}…; the record was modified after launch",
                fork_id=fork_id,
            )
        raw = codec.decode(data, what=f"fork {fork_id}: bootstrap record")
        if not isinstance(raw, dict) or not isinstance(raw.get("context_chunk"), bytes):
            raise RecordDecodeError(
                f"fork {fork_id}: bytes are not a stored bootstrap record (no context chunk reference)",
                fork_id=fork_id,
            )
        ref = raw.pop("context_chunk")
        fields = cache.get(ref) if cache is not None else None
        if fields is None:
            if ref != chunk_digest(context):
                raise RecordIntegrityError(
                    f"fork {fork_id}: the context chunk (system instruction and tools) does not match the digest "
                    "the bootstrap record names; it is missing or was modified after launch",
                    fork_id=fork_id,
                )
            fields = codec.decode_verified(context, what=f"fork {fork_id}: context chunk")
            if cache is not None and isinstance(fields, dict):
                cache.put(ref, fields, len(context))
        if not isinstance(fields, dict):
            raise RecordDecodeError(f"fork {fork_id}: the context chunk is not a map", fork_id=fork_id)
        raw.update(fields)
        if "seed_index" in raw:
            raw["seed_chunks"] = _seed_index(fork_id, raw.pop("seed_index"), index, cache)
        try:
            return cls.model_validate(raw, strict=True)
        except ValueError as exc:
            raise RecordDecodeError(
                f"fork {fork_id}: bootstrap record does not have the expected fields: {exc}", fork_id=fork_id, cause=exc
            ) from exc


def _seed_index(fork_id: str, ref: Any, index: bytes, cache: ChunkCache | HeldChunks | None) -> list[bytes]:
    """The seed chunk digests a record names through its seed index chunk, verified against `ref`."""
    digests = cache.get(ref) if cache is not None and isinstance(ref, bytes) else None
    if digests is None:
        if not isinstance(ref, bytes) or ref != chunk_digest(index):
            raise RecordIntegrityError(
                f"fork {fork_id}: the seed index chunk does not match the digest the bootstrap record names; "
                "it is missing or was modified after launch",
                fork_id=fork_id,
            )
        digests = codec.decode_verified(index, what=f"fork {fork_id}: seed index chunk")
        if not isinstance(digests, list) or not all(isinstance(d, bytes) for d in digests):
            raise RecordDecodeError(f"fork {fork_id}: the seed index chunk is not a list of digests", fork_id=fork_id)
        if cache is not None:
            cache.put(ref, digests, len(index))
    return list(digests)


class Usage(BaseModel):
    """What a fork consumed; `cached_input_tokens`, part of `input_tokens`, came from the provider's prompt cache
    (0 where the provider reports none, and in results written before it was counted)."""

    model_config = ConfigDict(extra="forbid")

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    tool_uses: int = 0
    model_calls: int = 0
    duration_ms: int = 0
    cached_input_tokens: int = 0


class ForkResult(BaseModel):
    """What the parent receives when a fork ends: only its final output, with status and usage."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    fork_id: str
    status: Status
    output: str | None = None
    usage: Usage = Field(default_factory=Usage)  # the whole fork's, across its continuations
    error: str | None = None
    run_usage: Usage | None = None  # a continued fork's last exchange alone (None: the fork never was continued)

    def encode(self) -> bytes:
        """Canonical bytes (without `run_usage` when it is None: a result's bytes stay those of before it)."""
        return codec.encode(self.model_dump(mode="json", exclude={"run_usage"} if self.run_usage is None else None))

    @classmethod
    def decode(cls, data: bytes, *, fork_id: str) -> ForkResult:
        """Decode stored bytes."""
        return cls.model_validate(codec.decode(data, what=f"fork {fork_id}: result"))


class ForkState(BaseModel):
    """The fork's state hash, decoded."""

    fork_id: str
    status: Status
    kind: str = "fork"
    tenant: str = DEFAULT_TENANT  # who launched it: the API answers 404 to every other tenant
    description: str = ""
    digest: str = ""
    attempt: int = 0
    owner: str | None = None
    created_ms: int | None = None
    started_ms: int | None = None
    finished_ms: int | None = None
    error: str | None = None  # the last error (never why a parked fork waits: `waiting_for` says that)
    pending_approval: list[ParkedCall] = Field(default_factory=list)  # awaiting_approval: the parked calls
    # a parked fork's wait (a person's decision on calls, or a resume), or a running fork's wait for its model
    waiting_for: WaitingFor | None = None

    @classmethod
    def from_hash(cls, fork_id: str, fields: dict[str, str]) -> ForkState:
        """From HGETALL (decoded strings)."""

        def num(name: str) -> int | None:
            return int(fields[name]) if fields.get(name) else None

        status = Status(fields["status"])
        # the parked calls are kept in the hash after a cancel (for the record), but no call waits on a fork
        # that is not parked any more
        pending = decode_parked(
            (fields.get("pending") or "") if status is Status.AWAITING_APPROVAL else "", fork_id=fork_id
        )
        waiting_for, error = _waiting(status, pending, fields)
        return cls(
            fork_id=fork_id,
            status=status,
            kind=fields.get("kind", "fork"),
            tenant=fields.get("tenant") or DEFAULT_TENANT,
            description=fields.get("description", ""),
            digest=fields.get("digest", ""),
            attempt=num("attempt") or 0,
            owner=fields.get("owner") or None,
            created_ms=num("created_ms"),
            started_ms=num("started_ms"),
            finished_ms=num("finished_ms"),
            error=error,
            pending_approval=pending,
            waiting_for=waiting_for,
        )


def _waiting(status: Status, pending: list[ParkedCall], fields: dict[str, str]) -> tuple[WaitingFor | None, str | None]:
    """A state's wait (a running fork's admission wait, or a parked fork's `read_wait`) and its error."""
    if status is Status.RUNNING:
        return read_model_wait(fields), fields.get("error") or None
    if not status.parked:
        return None, fields.get("error") or None
    return read_wait(pending if status is Status.AWAITING_APPROVAL else None, fields)


# ── seed chunks ───────────────────────────────────────────────────────────────────────────────


def split_seed(messages: Sequence[Content]) -> list[bytes]:
    """`split_wire` of Contents."""
    return split_wire(dump_contents(messages))


def split_wire(messages: Sequence[dict[str, Any]]) -> list[bytes]:
    """Canonical chunk bytes of a seed's messages, with content-defined boundaries.

    A chunk ends after a message whose CRC-32 is 0 mod 16, at 64 messages or 1 MiB, and before the
    last three messages (the repaired end, which differs between sibling forks); so forks of one
    parent produce the same chunks for the messages they share, even at different window offsets
    (from the first such boundary on). A chunk of 16 KiB or more also ends before a message that would
    take its Redis allocation into the next size class while it fills its own but for 1/32 or less.
    """
    encoded = [codec.encode(m) for m in messages]
    tail_start = max(0, len(encoded) - TAIL_MESSAGES)
    return [*split_body(encoded[:tail_start]), *tail_chunk(encoded[tail_start:])]


def split_body(encoded: Sequence[bytes]) -> list[bytes]:
    """The chunks of the encoded messages before a seed's last three (`split_wire`'s content-defined part)."""
    chunks: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for item in encoded:
        if size >= CHUNK_FIT_MIN_BYTES and fills_its_class(len(current), size, len(item)):
            chunks.append(codec.encode_array(current))
            current, size = [], 0
        current.append(item)
        size += len(item)
        boundary = zlib.crc32(item) % CHUNK_BOUNDARY_MODULUS == 0
        if boundary or len(current) >= CHUNK_MAX_MESSAGES or size >= CHUNK_MAX_BYTES:
            chunks.append(codec.encode_array(current))
            current, size = [], 0
    if current:
        chunks.append(codec.encode_array(current))
    return chunks


def tail_chunk(encoded: Sequence[bytes]) -> list[bytes]:
    """The chunk of a seed's last three encoded messages (none for no messages)."""
    return [codec.encode_array(list(encoded))] if encoded else []


def chunk_digest(chunk: bytes) -> bytes:
    """The raw BLAKE2b-256 digest that names a chunk."""
    return bytes.fromhex(codec.digest(chunk))


def join_seed(
    record: BootstrapRecord, chunks: Sequence[bytes], cache: ChunkCache | HeldChunks | None = None
) -> ForkSeed:
    """The seed of `record` from its chunk bytes, each verified against the record.

    With `cache`, a chunk decoded before under the digest the record names is taken from it (its
    bytes in `chunks` may then be empty), and newly verified chunks are kept.

    Raises:
        RecordIntegrityError: a chunk is missing or does not match its digest.
        RecordDecodeError: a chunk's messages are not Contents.
    """
    if len(chunks) != len(record.seed_chunks):
        raise RecordIntegrityError(
            f"fork {record.fork_id}: got {len(chunks)} seed chunks, the bootstrap record lists "
            f"{len(record.seed_chunks)}; the seed cannot be rebuilt",
            fork_id=record.fork_id,
        )
    contents: list[Content] = []
    for i, (expected, chunk) in enumerate(zip(record.seed_chunks, chunks, strict=True)):
        cached = cache.get(expected) if cache is not None else None
        if cached is None:
            cached = _seed_chunk(record.fork_id, i, expected, chunk)
            if cache is not None:
                cache.put(expected, cached, len(chunk))
        contents.extend(cached)
    if len(contents) != record.message_count:
        raise RecordIntegrityError(
            f"fork {record.fork_id}: seed has {len(contents)} messages, the record says {record.message_count}",
            fork_id=record.fork_id,
        )
    return ForkSeed.model_construct(schema_version=1, initial_messages=contents, task_prompt=record.task_prompt)


def _seed_chunk(fork_id: str, index: int, expected: bytes, chunk: bytes) -> tuple[Content, ...]:
    """One seed chunk's Contents, its bytes verified against `expected` first."""
    if chunk_digest(chunk) != expected:
        raise RecordIntegrityError(
            f"fork {fork_id}: seed chunk {index} ({expected.hex()[:12]}…) does not match its digest; "
            "it was modified or truncated after launch",
            fork_id=fork_id,
        )
    messages = codec.decode_verified(chunk, what=f"fork {fork_id}: seed chunk {index}")
    try:
        if not isinstance(messages, list):
            raise ValueError(f"a seed chunk holds a list of Contents, not {type(messages).__name__}")
        return tuple(load_contents(messages))
    except ValueError as exc:
        raise RecordDecodeError(
            f"fork {fork_id}: seed messages are not Contents: {exc}", fork_id=fork_id, cause=exc
        ) from exc


class Declarations:
    """Parsed tool declarations by the record's `tools_json`, shared by the forks of one parent that a worker
    runs: each parent's declarations are parsed once, and a child loop's requests all carry the same list,
    whose encoding `journal.RequestDigests` then keeps. Nothing changes a declarations list in place.
    Thread-safe (a race costs at most a second parse)."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._parsed: dict[str, list[dict[str, Any]]] = {}

    def of(self, record: BootstrapRecord) -> list[dict[str, Any]]:
        """`record.tools`, parsed once per distinct `tools_json`."""
        found = self._parsed.get(record.tools_json)
        if found is None:
            found = record.tools
            if len(self._parsed) >= self.max_entries:
                self._parsed.clear()  # a worker runs forks of far fewer parents at once; start over
            self._parsed[record.tools_json] = found
        return found


class ChunkCache:
    """Decoded chunks by digest, shared by the forks one worker process runs: an LRU bounded by chunk bytes.

    A chunk is named by the BLAKE2b-256 of its bytes, so a value decoded from bytes that were verified
    against that digest stands for those bytes: a hit is a verified read that costs neither Redis
    nor decoding. Forks of one parent name the same chunks, so a worker decodes each once.
    Values are shared, never copied: seed chunks are tuples of Contents, which nothing mutates in
    place (history code copies with `model_copy`); context chunks are maps that readers copy from.
    Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._entries

    def get(self, digest: bytes) -> Any:
        """The decoded chunk, or None; a hit becomes the most recently used."""
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            self._entries.move_to_end(digest)
            return entry[0]

    def put(self, digest: bytes, value: Any, size: int) -> None:
        """Keep a chunk decoded from `size` verified bytes, evicting the least recently used beyond the bound."""
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._size -= old[1]
            self._entries[digest] = (value, size)
            self._size += size
            while self._size > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._size -= evicted

    def hold(self, refs: Sequence[bytes]) -> HeldChunks:
        """The values held for `refs` now, kept for one read however the cache evicts meanwhile."""
        return HeldChunks(self, {ref: value for ref in refs if (value := self.get(ref)) is not None})


class HeldChunks:
    """What a `ChunkCache` held for one fork's chunks at one moment; new values are written through."""

    def __init__(self, cache: ChunkCache, values: dict[bytes, Any]) -> None:
        self.cache = cache
        self.values = values

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.values

    def get(self, digest: bytes) -> Any:
        """The held value, or None."""
        return self.values.get(digest)

    def put(self, digest: bytes, value: Any, size: int) -> None:
        """Hold the value and keep it in the cache."""
        self.values[digest] = value
        self.cache.put(digest, value, size)

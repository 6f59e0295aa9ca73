"""Redis access for forks: launch writes, records, state, progress events, results and cancellation.

Claims, leases and every write made while a fork runs are in `workers/lease.py`.

Multi-key changes of one fork run as Lua scripts over keys that share the fork's hash tag, so
each is atomic; timestamps come from Redis `TIME`, never from worker clocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import redis

from workers.errors import ForkNotFound, RecordExistsError
from workers.history import ForkSeed
from workers.keys import Keys
from workers.records import BootstrapRecord, ForkResult, ForkState, Status, chunk_digest, join_seed

EVENTS_MAXLEN: Final = 10_000
WAIT_TIMEOUT_MS: Final = 1000
DEAD_LETTERS_MAX: Final = 1000

log = logging.getLogger("forkq.store")

_NOW = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

# KEYS: bootstrap, state, events. ARGV: record bytes, ttl_s, kind, description, digest, event data.
_LAUNCH = (
    _NOW
    + """
local existing = redis.call('GET', KEYS[1])
if existing and existing ~= ARGV[1] then return 'conflict' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'exists' end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[2], 'status', 'queued', 'kind', ARGV[3], 'description', ARGV[4], 'digest', ARGV[5],
           'attempt', 0, 'created_ms', now)
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'queued', 'data', ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[2])
return 'created'
""".replace("@MAXLEN@", str(EVENTS_MAXLEN))
)

# KEYS: state, events, result, bootstrap, journal. ARGV: result bytes, event data, ttl_s. Terminal forks stay.
_CANCEL = (
    _NOW
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status == 'succeeded' or status == 'failed' or status == 'cancelled' then return status end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_ms', now, 'error', 'cancelled by request')
redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data', ARGV[2])
for _, i in ipairs({1, 2, 4, 5}) do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
return 'cancelled'
""".replace("@MAXLEN@", str(EVENTS_MAXLEN))
)


# KEYS: state, events. A paused fork goes back to queued (the caller re-enqueues it).
_RESUME = """
if redis.call('HGET', KEYS[1], 'status') ~= 'paused' then return 'no' end
redis.call('HSET', KEYS[1], 'status', 'queued', 'error', '')
redis.call('XADD', KEYS[2], '*', 'type', 'resumed', 'data', '{}')
return 'queued'
"""


@dataclass(frozen=True, slots=True)
class ForkEvent:
    """One progress event of a fork; `id` is the stream id (Redis milliseconds-sequence)."""

    id: str
    type: str
    data: dict[str, Any]

    @property
    def at_ms(self) -> int:
        """When Redis recorded the event (Unix milliseconds)."""
        return int(self.id.split("-", 1)[0])

    @property
    def terminal(self) -> bool:
        """True for the event that ends a fork."""
        return self.type == "finished"


class ForkStore:
    """One fork store per process: a Redis client (with its connection pool) and the key schema."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._launch = client.register_script(_LAUNCH)
        self._cancel = client.register_script(_CANCEL)
        self._resume = client.register_script(_RESUME)
        self._replicas: int | None = None  # learned on the first launch

    # ── launch ────────────────────────────────────────────────────────────────────────────────

    def _queue_chunks(self, pipe: Any, parent_session: str, chunks: Sequence[bytes]) -> None:
        for chunk in chunks:
            key = self.keys.chunk(parent_session, chunk_digest(chunk).hex())
            pipe.set(key, chunk, nx=True, ex=self.ttl_s)
            pipe.expire(key, self.ttl_s)  # a chunk lives at least as long as the newest record naming it

    def put_launch(
        self, record: BootstrapRecord, record_bytes: bytes, digest_hex: str, seed_chunks: Sequence[bytes] = ()
    ) -> None:
        """Write the chunks (context and seed), then atomically the record (write-once), the queued
        state and the first event: one round trip.

        Raises:
            RecordExistsError: a different record already exists under this fork id.
        """
        fid = record.fork_id
        data = json.dumps({"kind": record.kind, "digest": digest_hex, "messages": record.message_count})
        pipe = self.client.pipeline(transaction=False)
        self._queue_chunks(pipe, record.parent_session, [record.context_blob(), *seed_chunks])
        self._launch(
            keys=[self.keys.bootstrap(fid), self.keys.state(fid), self.keys.events(fid)],
            args=[record_bytes, self.ttl_s, record.kind, record.description, digest_hex, data],
            client=pipe,
        )
        outcome = pipe.execute()[-1]
        if outcome == b"conflict":
            raise RecordExistsError(
                f"fork {fid}: a different bootstrap record already exists; fork ids must be unique per launch",
                fork_id=fid,
                key=self.keys.bootstrap(fid),
            )
        self._wait_for_replicas(fid)

    def _wait_for_replicas(self, fork_id: str) -> None:
        """With replicas, acknowledge a launch only once they have the record too (`WAIT`)."""
        if self._replicas is None:
            info = self.client.info("replication")
            self._replicas = int(info.get("connected_slaves", 0))
        if self._replicas:
            acked = int(self.client.wait(self._replicas, WAIT_TIMEOUT_MS))
            if acked < self._replicas:
                log.warning(
                    "fork %s: %d of %d replicas acknowledged the record within %d ms",
                    fork_id,
                    acked,
                    self._replicas,
                    WAIT_TIMEOUT_MS,
                )

    def dead_letter(self, task_id: str, reason: str) -> None:
        """Keep a rejected job's id and reason (last 1,000) for operators: `LRANGE forkq:dead 0 -1`."""
        entry = json.dumps({"task_id": task_id, "reason": reason[:2000]})
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(self.keys.dead_letters, entry)
        pipe.ltrim(self.keys.dead_letters, 0, DEAD_LETTERS_MAX - 1)
        pipe.execute()

    # ── worker side ───────────────────────────────────────────────────────────────────────────

    def _record_bytes(self, fork_id: str) -> bytes:
        data = cast(bytes | None, self.client.get(self.keys.bootstrap(fork_id)))
        if data is None:
            raise ForkNotFound(
                f"fork {fork_id}: no bootstrap record in Redis (never launched, or expired)", fork_id=fork_id
            )
        return data

    def _chunks(self, parent_session: str, digests: Sequence[bytes]) -> list[bytes]:
        """Chunks by digest in one MGET; a missing one comes back empty (and fails its digest check)."""
        fetched = self.client.mget([self.keys.chunk(parent_session, d.hex()) for d in digests]) if digests else []
        return [c if isinstance(c, bytes) else b"" for c in fetched]

    def get_record(self, fork_id: str, digest_hex: str | None) -> BootstrapRecord:
        """The bootstrap record with its context, verified against `digest_hex` when given.

        Raises:
            ForkNotFound: no record (never launched, or past retention).
            RecordIntegrityError: the stored bytes do not match the digest.
        """
        data = self._record_bytes(fork_id)
        session, refs = BootstrapRecord.chunk_refs(data, fork_id=fork_id)
        (context,) = self._chunks(session, refs[:1])
        return BootstrapRecord.decode(data, fork_id=fork_id, context=context, expected_digest=digest_hex)

    def read_inputs(self, fork_id: str, digest_hex: str | None) -> tuple[BootstrapRecord, ForkSeed]:
        """Record and seed of a fork, read from Redis and verified (two round trips)."""
        return self.load_inputs(fork_id, self._record_bytes(fork_id), digest_hex)

    def load_inputs(
        self, fork_id: str, data: bytes, digest_hex: str | None, inline: Sequence[bytes] | None = None
    ) -> tuple[BootstrapRecord, ForkSeed]:
        """Record and seed from stored record bytes, with the job's inline chunks (context first, then
        the seed's) or, without them, every chunk read from Redis in one round trip; all verified.
        """
        if not inline:
            session, refs = BootstrapRecord.chunk_refs(data, fork_id=fork_id)
            inline = self._chunks(session, refs)
        record = BootstrapRecord.decode(data, fork_id=fork_id, context=inline[0], expected_digest=digest_hex)
        return record, join_seed(record, inline[1:])

    def load_seed(self, record: BootstrapRecord, chunks: Sequence[bytes] | None = None) -> ForkSeed:
        """The record's seed, from given chunks or from Redis, every chunk verified."""
        if chunks is None:
            chunks = self._chunks(record.parent_session, record.seed_chunks)
        return join_seed(record, chunks)

    # ── parent side ───────────────────────────────────────────────────────────────────────────

    def state(self, fork_id: str) -> ForkState:
        """The fork's current state.

        Raises:
            ForkNotFound: the fork does not exist.
        """
        fields = cast(dict[bytes, bytes], self.client.hgetall(self.keys.state(fork_id)))
        if not fields:
            raise ForkNotFound(f"fork {fork_id}: not found (never launched, or past its retention)", fork_id=fork_id)
        return ForkState.from_hash(fork_id, {k.decode(): v.decode() for k, v in fields.items()})

    def result(self, fork_id: str) -> ForkResult | None:
        """The final result, or None while the fork has not ended."""
        data = cast(bytes | None, self.client.get(self.keys.result(fork_id)))
        return None if data is None else ForkResult.decode(data, fork_id=fork_id)

    def cancel(self, fork_id: str) -> Status:
        """Cancel a fork that has not ended; returns the status it has afterwards.

        Raises:
            ForkNotFound: the fork does not exist.
        """
        result = ForkResult(fork_id=fork_id, status=Status.CANCELLED, error="cancelled by request")
        outcome = self._cancel(
            keys=[
                self.keys.state(fork_id),
                self.keys.events(fork_id),
                self.keys.result(fork_id),
                self.keys.bootstrap(fork_id),
                self.keys.journal(fork_id),
            ],
            args=[result.encode(), json.dumps({"status": "cancelled", "error": "cancelled by request"}), self.ttl_s],
        )
        outcome = cast(bytes, outcome).decode()
        if outcome == "missing":
            raise ForkNotFound(f"fork {fork_id}: not found (never launched, or past its retention)", fork_id=fork_id)
        return Status(outcome)

    def resume(self, fork_id: str) -> bool:
        """Put a paused fork back in the queue state; True when it was paused."""
        return bool(self._resume(keys=[self.keys.state(fork_id), self.keys.events(fork_id)]) == b"queued")

    def events(
        self, fork_id: str, *, after: str = "0-0", block_ms: int | None = None, count: int = 1000
    ) -> list[ForkEvent]:
        """Events after stream id `after`; with `block_ms`, wait up to that long for new ones."""
        key = self.keys.events(fork_id)
        reply = cast(list[Any], self.client.xread({key: after}, count=count, block=block_ms))
        return [_event(eid, fields) for _, entries in reply or [] for eid, fields in entries]

    def follow(self, fork_id: str, *, after: str = "0-0", block_ms: int = 1000) -> Iterator[ForkEvent]:
        """Every event from `after` on, waiting for new ones, until the fork's terminal event."""
        while True:
            for event in self.events(fork_id, after=after, block_ms=block_ms):
                after = event.id
                yield event
                if event.terminal:
                    return


def _event(event_id: bytes, fields: dict[bytes, bytes]) -> ForkEvent:
    data = json.loads(fields.get(b"data", b"{}"))
    return ForkEvent(id=event_id.decode(), type=fields.get(b"type", b"").decode(), data=data)

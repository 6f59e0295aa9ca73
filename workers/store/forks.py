"""Redis access for forks: launch writes, records, state, progress events, results and cancellation.

Claims, leases and every write made while a fork runs are in `workers/store/lease.py`.

Multi-key changes of one fork run as Lua scripts over keys that share the fork's hash tag, so
each is atomic; timestamps come from Redis `TIME`, never from worker clocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import redis
from redis.commands.core import Script

from workers.base.keys import Keys
from workers.errors import ForkNotFound, InvalidApproval, RecordExistsError, RecordIntegrityError
from workers.history.selection import ForkSeed
from workers.records.conversation import journal_usage
from workers.records.fork import (
    BootstrapRecord,
    ChunkCache,
    ForkResult,
    ForkState,
    HeldChunks,
    Status,
    chunk_digest,
    join_seed,
)
from workers.records.journal import EntryKind, JournalEntry
from workers.store import dead_letters, reads
from workers.store.replies import Decision, Refused, SendReply, Written, fenced_reply, word_of
from workers.store.script_parts import NOW, lua_script

if TYPE_CHECKING:  # types only: the store keeps dead letters and queues jobs without loading kombu or Celery
    from workers.broker.connection import Rejected
    from workers.broker.envelope import QueuedJob

    # and reads no event models until it reads or writes an event: `forkq status` starts without them
    from workers.records.events import StreamEvent

WAIT_TIMEOUT_MS: Final = 1000
KNOWN_CHUNKS_MAX: Final = 4096  # chunk keys a client remembers writing, so that it does not send them again
DECISION_GRACE_MS: Final = 30_000  # a decided fork's job not confirmed enqueued by then is re-enqueued by a sweeper

log = logging.getLogger("forkq.store")

# KEYS: bootstrap, state, events, the parent session's forks, and with a job: the broker queue's list, then the chunk
# keys the caller did not send again. ARGV: record bytes, ttl_s, kind, description, digest, event data, fork id, and
# with a job: the queue item, the task-sent event's channel ('' for none) and message. Returns the outcome and
# whether the job was queued. The session index gets the fork with its record (the one key outside the fork's hash
# tag). The job goes onto the queue after the record (the order a worker needs), and only if every chunk it names
# is there: a chunk gone since the caller wrote it is written again first, and the job then sent by the caller.
# A new stream's first node is allocated at 4 KiB (Redis 7's XADD pre-allocates `stream-node-max-bytes`, at most
# 4096), most of a queued fork's memory: written anew by DUMP and RESTORE, the stream keeps only what its
# `queued` event needs (about 0.8 KB), and grows from there as the worker appends. Best effort: where a
# server renames or refuses DUMP or RESTORE (some managed services do), the stream stays as XADD made it.
_LAUNCH = lua_script(
    NOW,
    """
local function send(outcome)
  if ARGV[8] == nil or ARGV[8] == '' then return {outcome, 0} end
  for i = 6, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 0 then return {outcome, 0} end
  end
  redis.call('LPUSH', KEYS[5], ARGV[8])
  if ARGV[9] ~= '' then redis.call('PUBLISH', ARGV[9], ARGV[10]) end
  return {outcome, 1}
end
local existing = redis.call('GET', KEYS[1])
if existing and existing ~= ARGV[1] then return {CONFLICT, 0} end
if redis.call('EXISTS', KEYS[2]) == 1 then return send(EXISTS) end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[2], 'status', QUEUED, 'kind', ARGV[3], 'description', ARGV[4], 'digest', ARGV[5],
           'attempt', 0, 'created_ms', now)
redis.call('EXPIRE', KEYS[2], ARGV[2])
local fresh = redis.call('EXISTS', KEYS[3]) == 0
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'queued', 'data', ARGV[6])
local restored = false
if fresh then
  local dumped = redis.pcall('DUMP', KEYS[3])
  if type(dumped) == 'string' then
    local reply = redis.pcall('RESTORE', KEYS[3], tonumber(ARGV[2]) * 1000, dumped, 'REPLACE')
    restored = type(reply) == 'table' and reply.ok ~= nil
  end
end
if not restored then redis.call('EXPIRE', KEYS[3], ARGV[2]) end
redis.call('ZADD', KEYS[4], now, ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[2]) * 1000)
redis.call('EXPIRE', KEYS[4], ARGV[2])
return send(CREATED)
""",
)

# KEYS: chunks of one parent (one hash tag). ARGV: ttl_s, then each chunk's bytes, or '' for a chunk the client
# wrote before (not sent again). Returns the 1-based positions of the '' chunks that are gone.
_PUT_CHUNKS = lua_script(
    """
local gone = {}
for i, key in ipairs(KEYS) do
  if ARGV[i + 1] ~= '' then redis.call('SET', key, ARGV[i + 1], 'NX', 'EX', ARGV[1]) end
  -- a chunk lives at least as long as the newest record naming it
  if redis.call('EXPIRE', key, ARGV[1]) == 0 then table.insert(gone, i) end
end
return gone
"""
)

# KEYS: state, events, result, bootstrap, journal. ARGV: fork_id, ttl_s, n, and the usage of the first n journal
# entries (input tokens, output tokens, model calls, tool uses, cached input tokens). Terminal forks stay. The
# entries appended since the caller read those n are counted here (so the usage is exact however the fork raced
# the cancel), and the duration runs from the first start to now, or to when the fork parked. The result is
# msgpack (cmsgpack's, which ForkResult.decode reads); the finished event carries the same usage.
_CANCEL = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return MISSING end
if status == SUCCEEDED or status == FAILED or status == CANCELLED then return status end
local usage = {input_tokens = tonumber(ARGV[4]), output_tokens = tonumber(ARGV[5]), model_calls = tonumber(ARGV[6]),
               tool_uses = tonumber(ARGV[7]), cached_input_tokens = tonumber(ARGV[8]), duration_ms = 0}
for _, raw in ipairs(redis.call('LRANGE', KEYS[5], tonumber(ARGV[3]), -1)) do
  local ok, entry = pcall(cmsgpack.unpack, raw)
  if ok and type(entry) == 'table' and entry.kind == 'model' then
    usage.model_calls = usage.model_calls + 1
    usage.input_tokens = usage.input_tokens + (tonumber(entry.input_tokens) or 0)
    usage.output_tokens = usage.output_tokens + (tonumber(entry.output_tokens) or 0)
    usage.cached_input_tokens = usage.cached_input_tokens + (tonumber(entry.cached_input_tokens) or 0)
  elseif ok and type(entry) == 'table' and entry.kind == 'tool_result' then
    usage.tool_uses = usage.tool_uses + 1
  end
end
usage.total_tokens = usage.input_tokens + usage.output_tokens
local first = tonumber(redis.call('HGET', KEYS[1], 'first_started_ms') or '')
if first then
  local parked = tonumber(redis.call('HGET', KEYS[1], 'parked_ms') or '')
  usage.duration_ms = math.max(0, (parked or now) - first)
end
local err = 'cancelled by request'
redis.call('HSET', KEYS[1], 'status', CANCELLED, 'finished_ms', now, 'error', err)
local result = {schema_version = 1, fork_id = ARGV[1], status = CANCELLED, error = err, usage = usage}
redis.call('SET', KEYS[3], cmsgpack.pack(result), 'EX', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data',
           cjson.encode({status = CANCELLED, error = err, usage = usage}))
for _, i in ipairs({1, 2, 4, 5}) do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
return CANCELLED
""",
)


# Time spent parked (paused, awaiting approval) does not count against the wall-clock limit: the
# fork's first start moves forward by it when the fork is queued again, and it waits no more.
_UNPARK = """
local parked = tonumber(redis.call('HGET', KEYS[1], 'parked_ms') or '')
local first = tonumber(redis.call('HGET', KEYS[1], 'first_started_ms') or '')
if parked and first then redis.call('HSET', KEYS[1], 'first_started_ms', first + (now - parked)) end
redis.call('HDEL', KEYS[1], 'parked_ms', 'waiting')
"""

# KEYS: state, events. A paused fork goes back to queued (the caller re-enqueues it).
_RESUME = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= PAUSED then return status or MISSING end
"""
    + _UNPARK
    + """
redis.call('HSET', KEYS[1], 'status', QUEUED, 'error', '')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'resumed', 'data', '{}')
return RESUMED
""",
)


# KEYS: state, journal, events, running. ARGV: call id, approval entry bytes, its seq, event type, event
# data, grace_ms, fork_id. Records a person's decision on one parked call; the last one puts the fork
# back in the queue state (indexed, due after grace_ms, until its job is confirmed enqueued).
_DECIDE = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return MISSING end
if status ~= AWAITING_APPROVAL then return status end
local pending = cjson.decode(redis.call('HGET', KEYS[1], 'pending') or '[]')
local left, found = {}, false
for _, p in ipairs(pending) do
  if p.call_id == ARGV[1] then found = true else table.insert(left, p) end
end
if not found then return UNKNOWN_CALL end
if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[3]) then return SEQ end
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[4], 'data', ARGV[5])
if #left > 0 then
  redis.call('HSET', KEYS[1], 'pending', cjson.encode(left))
  return RECORDED
end
redis.call('HSET', KEYS[1], 'status', QUEUED, 'pending', '', 'error', '')
"""
    + _UNPARK
    + """
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[6]), ARGV[7])
return QUEUED
""",
)

DECIDE_ATTEMPTS: Final = 5
DECIDED: Final = frozenset(d.value for d in Decision)

# KEYS: the session's names hash. ARGV: name, the fork id it must map to now ('' = none), the new fork id,
# ttl_s. Compare-and-set: 1 when the name now maps to the new fork, 0 when another launch got there first.
_CLAIM_NAME = lua_script(
    """
if (redis.call('HGET', KEYS[1], ARGV[1]) or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
)

# KEYS: state, inbox, events, running, result. ARGV: message, inbox limit, ttl_s, fork_id, grace_ms. A message
# for the fork: refused (the status) when it has failed or was cancelled, `full` when its inbox is; otherwise
# queued in the inbox. A succeeded fork is continued: back to `queued` for its next exchange (its result gone
# until that ends, its wall clock and attempts counted afresh), indexed until its job is confirmed enqueued.
_SEND = lua_script(
    NOW,
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {MISSING, 0} end
if status == FAILED or status == CANCELLED then return {status, 0} end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[2]) then return {FULL, redis.call('LLEN', KEYS[2])} end
local waiting = redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[3])
if status ~= SUCCEEDED then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'message', 'data',
             cjson.encode({waiting = waiting, status = status}))
  return {QUEUED, waiting}
end
redis.call('HSET', KEYS[1], 'status', QUEUED, 'owner', '', 'error', '', 'attempt', 0)
redis.call('HDEL', KEYS[1], 'first_started_ms', 'finished_ms', 'parked_ms')
redis.call('DEL', KEYS[5])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'message', 'data',
           cjson.encode({waiting = waiting, status = status, continued = true}))
return {CONTINUED, waiting}
""",
)


class ForkStore:
    """One fork store per process: a Redis client (with its connection pool) and the key schema."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int, chunk_cache: ChunkCache | None = None) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.chunk_cache = chunk_cache  # workers: chunks decoded once per process (verified reads without Redis)
        self._launch = client.register_script(_LAUNCH)
        self._put_chunks = client.register_script(_PUT_CHUNKS)
        self._cancel = client.register_script(_CANCEL)
        self._resume = client.register_script(_RESUME)
        self._decide = client.register_script(_DECIDE)
        self._send = client.register_script(_SEND)
        self._claim_name = client.register_script(_CLAIM_NAME)
        self._replicas: int | None = None  # learned on the first launch
        self._known: OrderedDict[str, None] = OrderedDict()  # chunk keys this store wrote, most recent last
        self._known_lock = threading.Lock()

    # ── launch ────────────────────────────────────────────────────────────────────────────────

    def _known_chunk(self, key: str) -> bool:
        with self._known_lock:
            if key not in self._known:
                return False
            self._known.move_to_end(key)
            return True

    def _remember_chunks(self, keys: Sequence[str]) -> None:
        with self._known_lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > KNOWN_CHUNKS_MAX:
                self._known.popitem(last=False)

    def put_launch(
        self,
        record: BootstrapRecord,
        record_bytes: bytes,
        digest_hex: str,
        seed_chunks: Sequence[bytes] = (),
        *,
        job: QueuedJob | None = None,
    ) -> bool:
        """Write the chunks (context and seed), then atomically the record (write-once), the queued
        state and the first event, and `job` onto the broker's queue: one round trip (two when a chunk this
        store wrote before is gone). True if `job` was queued; without one, or when a chunk was gone, the
        caller sends the job.

        `job` goes to this store's Redis, so only a broker on the same server may pass one
        (`workers.broker.envelope`).

        A chunk this store wrote before is not sent again: its TTL is refreshed, and if it is gone
        (expired, deleted) it is written again, before the caller enqueues the job. `seed_chunks` are
        the chunks the record names (`record.seed_chunks` holds their digests, which name their keys).

        Raises:
            RecordExistsError: a different record already exists under this fork id.
            RecordIntegrityError: the number of seed chunks is not the number the record names.
        """
        from workers.records.events import QueuedData  # noqa: PLC0415 (see the TYPE_CHECKING imports)

        fid = record.fork_id
        session = record.parent_session
        data = QueuedData(kind=record.kind, digest=digest_hex, messages=record.message_count).to_json()
        chunks, chunk_keys = self._launch_chunks(record, seed_chunks)
        sent = [b"" if self._known_chunk(key) else chunk for key, chunk in zip(chunk_keys, chunks, strict=True)]
        keys = [self.keys.bootstrap(fid), self.keys.state(fid), self.keys.events(fid), self.keys.session_forks(session)]
        args: list[Any] = [record_bytes, self.ttl_s, record.kind, record.description, digest_hex, data, fid]
        if job is not None:
            keys += [job.queue_key, *(key for key, chunk in zip(chunk_keys, sent, strict=True) if not chunk)]
            args += [job.item, job.event_channel, job.event]
        gone, (outcome, queued) = self._scripts(
            (self._put_chunks, chunk_keys, [self.ttl_s, *sent]), (self._launch, keys, args)
        )
        if fenced_reply(outcome, script="launch", fork_id=fid) is Refused.CONFLICT:
            raise RecordExistsError(
                f"fork {fid}: a different bootstrap record already exists; fork ids must be unique per launch",
                fork_id=fid,
                key=self.keys.bootstrap(fid),
            )
        if gone:  # expired or deleted since this store wrote them: write them again before the job is enqueued
            again = [int(i) - 1 for i in gone]
            self._scripts((self._put_chunks, [chunk_keys[i] for i in again], [self.ttl_s, *(chunks[i] for i in again)]))
        self._remember_chunks(chunk_keys)
        self._wait_for_replicas(fid)
        return bool(queued)

    def _launch_chunks(self, record: BootstrapRecord, seed_chunks: Sequence[bytes]) -> tuple[list[bytes], list[str]]:
        """A launch's chunks (context, seed index, seed) and their keys.

        Raises:
            RecordIntegrityError: the number of seed chunks is not the number the record names.
        """
        fid = record.fork_id
        context = record.context_blob()
        index = record.seed_index_blob() if seed_chunks else None
        chunks = [context, *([index] if index is not None else []), *seed_chunks]
        if seed_chunks and len(seed_chunks) != len(record.seed_chunks):
            raise RecordIntegrityError(
                f"fork {fid}: {len(seed_chunks)} seed chunks given, the record names {len(record.seed_chunks)}; "
                "pass the chunks the record was built from, in its order",
                fork_id=fid,
            )
        # the record names its seed chunks by their digests (`ForkClient.launch` built both): no second hash
        digests = [chunk_digest(context), *([chunk_digest(index)] if index is not None else [])]
        digests += record.seed_chunks if seed_chunks else ()
        return chunks, [self.keys.chunk(record.parent_session, d.hex()) for d in digests]

    def _scripts(self, *calls: tuple[Script, list[str], list[Any]]) -> list[Any]:
        """Run scripts in one pipelined round trip (EVALSHA; loaded first only if Redis lacks one)."""
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            for script, keys, args in calls:  # EVALSHA itself: a Script object in a pipeline adds SCRIPT EXISTS
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            try:
                return pipe.execute()
            except redis.exceptions.NoScriptError:  # a restarted or flushed Redis
                if attempt == 2:
                    raise
                for script, _, _ in calls:
                    script.sha = self.client.script_load(script.script)
        raise AssertionError("unreachable")

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

    def dead_letter(self, task_id: str | None, reason: str, *, item: Rejected | None = None) -> None:
        """Keep a refused job's id and reason, or a refused queue item's (`workers.store.dead_letters`)."""
        dead_letters.dead_letter(self.client, self.keys, task_id, reason, item=item)

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
        """The bootstrap record with its context, verified against `digest_hex` when given (`reads.record`)."""
        return reads.run(self.client, reads.record(self.keys, fork_id, digest_hex))

    def read_inputs(self, fork_id: str, digest_hex: str | None) -> tuple[BootstrapRecord, ForkSeed]:
        """Record and seed of a fork, read from Redis and verified (two round trips)."""
        return self.load_inputs(fork_id, self._record_bytes(fork_id), digest_hex)

    def load_inputs(
        self, fork_id: str, data: bytes, digest_hex: str | None, inline: Sequence[bytes] | None = None
    ) -> tuple[BootstrapRecord, ForkSeed]:
        """Record and seed from stored record bytes, with the job's inline chunks (context first, then
        the seed's) or, without them, the chunks read from Redis in one round trip; all verified.
        Chunks the store's chunk cache holds are neither read nor decoded again.
        """
        if inline:
            record = BootstrapRecord.decode(
                data, fork_id=fork_id, context=inline[0], expected_digest=digest_hex, cache=self.chunk_cache
            )
            return record, join_seed(record, inline[1:], self.chunk_cache)
        named = BootstrapRecord.chunk_refs(data, fork_id=fork_id)
        chunks, cache = self._uncached_chunks(named.parent_session, named.refs)
        index = chunks[1] if named.indexed else b""
        record = BootstrapRecord.decode(
            data, fork_id=fork_id, context=chunks[0], index=index, expected_digest=digest_hex, cache=cache
        )
        if named.indexed:  # the seed chunks are known now: a second read, of those the cache lacks
            chunks, cache = self._uncached_chunks(named.parent_session, [b"", *record.seed_chunks])
        return record, join_seed(record, chunks[1:], cache)

    def _uncached_chunks(self, parent_session: str, refs: Sequence[bytes]) -> tuple[list[bytes], HeldChunks | None]:
        """The chunks named by `refs` from Redis in one MGET, except those the chunk cache holds (left empty,
        and held for this read), and what it holds. An empty ref stands for a chunk not wanted."""
        held = self.chunk_cache.hold(refs) if self.chunk_cache is not None else None
        missing = [i for i, ref in enumerate(refs) if ref and (held is None or ref not in held)]
        chunks = [b""] * len(refs)
        for i, chunk in zip(missing, self._chunks(parent_session, [refs[i] for i in missing]), strict=True):
            chunks[i] = chunk
        return chunks, held

    def load_seed(self, record: BootstrapRecord, chunks: Sequence[bytes] | None = None) -> ForkSeed:
        """The record's seed, from given chunks or from Redis, every chunk verified."""
        if chunks is None:
            chunks = self._chunks(record.parent_session, record.seed_chunks)
        return join_seed(record, chunks)

    # ── parent side ───────────────────────────────────────────────────────────────────────────

    def state(self, fork_id: str) -> ForkState:
        """The fork's current state (ForkNotFound if there is none)."""
        return reads.run(self.client, reads.state(self.keys, fork_id))

    def result(self, fork_id: str) -> ForkResult | None:
        """The final result, or None while the fork has not ended."""
        return reads.run(self.client, reads.result(self.keys, fork_id))

    def ended(self, fork_id: str, *, deadline: float | None) -> ForkResult | ForkState:
        """The result once the fork has ended, waiting until `deadline`; else its state (`reads.ended`)."""
        return reads.run(self.client, reads.ended(self.keys, fork_id, deadline=deadline))

    def session_forks(self, parent_session: str, *, limit: int) -> list[reads.SessionFork]:
        """The newest `limit` forks launched from a parent session that are still in Redis, newest first."""
        return reads.run(self.client, reads.session_forks(self.keys, parent_session, limit=limit))

    def cancel(self, fork_id: str) -> Status:
        """Cancel a fork that has not ended; returns the status it has afterwards.

        The cancelled result keeps what the fork used: tokens, model calls and tool uses from its
        journal, and its time since the first start (time parked not counted). The journal is read
        and tallied here; the script adds what was appended since, so it holds the scripting work.

        Raises:
            ForkNotFound: the fork does not exist.
        """
        return self._cancel_tallied(fork_id, cast(list[bytes], self.client.lrange(self.keys.journal(fork_id), 0, -1)))

    def _cancel_tallied(self, fork_id: str, journal: list[bytes]) -> Status:
        """Cancel with the usage of `journal`, the entries read so far; the script tallies the ones after them."""
        usage, k = journal_usage(journal, fork_id), self.keys
        counted = [len(journal), usage.input_tokens, usage.output_tokens, usage.model_calls, usage.tool_uses]
        counted.append(usage.cached_input_tokens)  # ARGV[8], after the counts the script always took
        keys = [k.state(fork_id), k.events(fork_id), k.result(fork_id), k.bootstrap(fork_id), k.journal(fork_id)]
        reply = self._cancel(keys=keys, args=[fork_id, self.ttl_s, *counted])
        if reply == Refused.MISSING.value.encode():
            raise reads.not_found(fork_id)
        return word_of(Status, reply, script="cancel", fork_id=fork_id)

    def resume(self, fork_id: str) -> bool:
        """Put a paused fork back in the queue state; True when it was paused."""
        reply = self._resume(keys=[self.keys.state(fork_id), self.keys.events(fork_id)])
        return fenced_reply(reply, script="resume", fork_id=fork_id) is Written.RESUMED

    def decide(self, fork_id: str, call_id: str, decision: str, reason: str | None = None) -> Decision:
        """Record a person's `approve`/`deny` of a parked call; `queued` when it was the last one undecided.

        Otherwise `recorded` (other calls still wait). Raises ForkNotFound; InvalidApproval when
        the fork is not awaiting approval or has no such pending call.
        """
        from workers.records.events import DecisionData, decision_event  # noqa: PLC0415 (see TYPE_CHECKING)

        verdict: Literal["approve", "deny"] = "approve" if decision == "approve" else "deny"
        for _ in range(DECIDE_ATTEMPTS):  # the journal length can only change under us if a decision races
            state = self.state(fork_id)
            call = next((p for p in state.pending_approval if p.call_id == call_id), None)
            if state.status is not Status.AWAITING_APPROVAL or call is None:
                raise InvalidApproval(_approval_refusal(state, call_id), fork_id=fork_id)
            seq = self.client.llen(self.keys.journal(fork_id))
            entry = JournalEntry(
                seq=seq,
                step=call.step,
                kind=EntryKind.APPROVAL,
                call_index=call.index,
                call_id=call_id,
                name=call.name,
                decision=verdict,
                reason=reason or None,
            )
            event = decision_event(verdict, DecisionData(call_id=call_id, name=call.name, reason=reason))
            outcome = self._decide(
                keys=[
                    self.keys.state(fork_id),
                    self.keys.journal(fork_id),
                    self.keys.events(fork_id),
                    self.keys.running,
                ],
                args=[call_id, entry.encode(), seq, *event.encoded(), DECISION_GRACE_MS, fork_id],
            )
            word = cast(bytes, outcome).decode()
            if word != Refused.SEQ:
                if word in DECIDED:
                    return Decision(word)
                raise InvalidApproval(_approval_refusal(self.state(fork_id), call_id), fork_id=fork_id)
        raise InvalidApproval(f"fork {fork_id}: decisions raced {DECIDE_ATTEMPTS} times; try again", fork_id=fork_id)

    def teammate(self, parent_session: str, name: str) -> str | None:
        """The fork id of the last teammate launched as `name` from the session, or None."""
        entry = self.teammate_entry(parent_session, name)
        return None if entry is None else entry.split(" ", 1)[0]

    def teammate_entry(self, parent_session: str, name: str) -> str | None:
        """The names hash's entry for `name`: `<fork id> <launch ms>`, or None."""
        found = self.client.hget(self.keys.session_names(parent_session), name)
        return None if found is None else cast(bytes, found).decode()

    def claim_name(self, parent_session: str, name: str, fork_id: str, *, expected: str | None) -> bool:
        """Map `name` to `fork_id` (with the time, for a launch that never completed) if the entry is still
        `expected` (None: no entry)."""
        keys = [self.keys.session_names(parent_session)]
        entry = f"{fork_id} {int(time.time() * 1000)}"
        return bool(self._claim_name(keys=keys, args=[name, expected or "", entry, self.ttl_s]))

    def send(self, fork_id: str, text: str, *, inbox_limit: int) -> tuple[SendReply, int]:
        """Give the fork a message: (`queued` in its inbox or `continued`, messages waiting); the reply is otherwise
        why not: `missing`, `failed`, `cancelled`, `full`. A `continued` fork's job is the caller's to send."""
        keys = [
            self.keys.state(fork_id),
            self.keys.inbox(fork_id),
            self.keys.events(fork_id),
            self.keys.running,
            self.keys.result(fork_id),
        ]
        args: list[Any] = [text.encode("utf-8"), inbox_limit, self.ttl_s, fork_id, DECISION_GRACE_MS]
        word, waiting = cast(list[Any], self._send(keys=keys, args=args))
        return word_of(SendReply, word, script="send", fork_id=fork_id), int(waiting)

    def events(
        self, fork_id: str, *, after: str = "0-0", block_ms: int | None = None, count: int = 1000
    ) -> list[StreamEvent]:
        """Events after stream id `after`; with `block_ms`, wait up to that long for new ones."""
        entries = reads.run(self.client, reads.events(self.keys, fork_id, after=after, block_ms=block_ms, count=count))
        return [decode_event(*entry) for entry in entries]

    def latest_events(self, fork_id: str, *, count: int) -> list[StreamEvent]:
        """The fork's newest `count` events, newest first."""
        entries = reads.run(self.client, reads.latest_events(self.keys, fork_id, count=count))
        return [decode_event(*entry) for entry in entries]

    def follow(self, fork_id: str, *, after: str = "0-0", block_ms: int = 1000) -> Iterator[StreamEvent]:
        """Every event from `after` on, waiting for new ones, until the fork's terminal event."""
        while True:
            for event in self.events(fork_id, after=after, block_ms=block_ms):
                after = event.id
                yield event
                if event.terminal:
                    return


def _approval_refusal(state: ForkState, call_id: str) -> str:
    if state.status is not Status.AWAITING_APPROVAL:
        return f"fork {state.fork_id} is {state.status.value}, not awaiting approval: there is no call to decide"
    waiting = ", ".join(f"{p.call_id} ({p.name})" for p in state.pending_approval) or "none"
    return f"fork {state.fork_id}: no pending call {call_id!r}; calls awaiting approval: {waiting}"


def decode_event(event_id: bytes, fields: dict[bytes, bytes]) -> StreamEvent:
    """The event of one XREAD/XRANGE entry (`workers.records.events.decode_event`, loaded at the first read)."""
    from workers.records import events  # noqa: PLC0415 (see the TYPE_CHECKING imports)

    return events.decode_event(event_id, fields)

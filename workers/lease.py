"""A fork's execution rights: the lease, the fencing epoch, and every write made under them.

Claiming a fork sets its lease (`SET NX PX` owner token) and increments its epoch. Every journal
append, release and result write runs as a Lua script that first checks the epoch, the lease
owner and the status, so a stale worker (paused, partitioned, revived behind) fails closed. Lease
deadlines are Redis time (`PEXPIRE`, `TIME`), never worker clocks. One heartbeat thread per process
renews the leases of all its running forks in one pipelined round trip.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import redis

from workers.errors import LeaseLost
from workers.journal import JournalEntry
from workers.keys import Keys
from workers.records import ForkResult, Status

log = logging.getLogger("forkq.lease")

MAXLEN: Final = "10000"
_NOW = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

# KEYS[1] state, KEYS[2] lease: the guard every fenced write starts with. ARGV[1] epoch, ARGV[2] owner.
_FENCE = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 'stale' end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 'lost' end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return status or 'missing' end
"""

# KEYS: state, lease, events, running, bootstrap, journal. ARGV: owner, ttl_ms, fork_id, job digest ('' = any),
# surface entry ('' = none), model_call event data, the job's record bytes. One round trip: refuse a job
# whose digest is not the launch digest, claim, and hand back the bootstrap record and the journal the run
# starts from. On a first claim with an empty journal, a worker that built the first request from the job's
# record (which hashes to the job digest, checked here, and equals the stored record) also records its tool
# surface and publishes the first `model_call`: the checkpoint before the first model call, in the same
# round trip (`primed`; the record is then not sent back).
_CLAIM = (
    _NOW
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing'} end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], 'digest') ~= ARGV[4] then return {'forged'} end
if status ~= 'queued' then return {status} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'leased'} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[1], 'started_ms', now)
redis.call('HSETNX', KEYS[1], 'first_started_ms', now)
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[2]), ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'started', 'data',
           cjson.encode({owner = ARGV[1], attempt = attempt, epoch = epoch}))
local record = redis.call('GET', KEYS[5]) or ''
local primed = 0
if ARGV[5] and ARGV[5] ~= '' and attempt == 1 and ARGV[7] == record and redis.call('LLEN', KEYS[6]) == 0 then
  redis.call('RPUSH', KEYS[6], ARGV[5])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'model_call', 'data', ARGV[6])
  primed, record = 1, ''
end
return {'claimed', attempt, epoch, record, redis.call('LRANGE', KEYS[6], 0, -1),
        redis.call('HGET', KEYS[1], 'first_started_ms'), now, primed}
"""
)

# KEYS: state, lease, journal, events. ARGV: epoch, owner, seq, n entries, entries…, then event (type, data)
# pairs. Entries are appended only at the expected position; the events go with them.
_APPEND = (
    _FENCE
    + """
if redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[3]) then return 'seq' end
local n = tonumber(ARGV[4])
for i = 5, 4 + n do redis.call('RPUSH', KEYS[3], ARGV[i]) end
for i = 5 + n, #ARGV, 2 do
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[i], 'data', ARGV[i + 1])
end
return 'ok'
"""
)

# KEYS: state, events. ARGV: event (type, data) pairs. Publishes progress and returns the status.
_EMIT = """
for i = 1, #ARGV, 2 do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[i], 'data', ARGV[i + 1])
end
return redis.call('HGET', KEYS[1], 'status') or 'missing'
"""

# KEYS: state, lease, events, running, result, journal, bootstrap. ARGV: epoch, owner, status,
# result bytes, error, event data, ttl_s, fork_id, seq, n entries, entries…, then event (type, data)
# pairs. The last journal entries and events go with the result (at the expected position only).
_FINISH = (
    _NOW
    + _FENCE
    + """
local n = tonumber(ARGV[10])
if n > 0 and redis.call('LLEN', KEYS[6]) ~= tonumber(ARGV[9]) then return 'seq' end
for i = 11, 10 + n do redis.call('RPUSH', KEYS[6], ARGV[i]) end
for i = 11 + n, #ARGV, 2 do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[i], 'data', ARGV[i + 1])
end
redis.call('SET', KEYS[5], ARGV[4], 'EX', ARGV[7])
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finished_ms', now, 'error', ARGV[5])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[8])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data', ARGV[6])
for _, i in ipairs({1, 3, 6, 7}) do redis.call('EXPIRE', KEYS[i], ARGV[7]) end
return 'finished'
"""
)

# KEYS: state, lease, events, running. ARGV: epoch, owner, fork_id, reason, grace_ms. Back to queued.
_RELEASE = (
    _NOW
    + _FENCE
    + """
redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '')
redis.call('DEL', KEYS[2])
-- stays indexed, due after ARGV[5] ms, until its job is confirmed enqueued (`enqueued`): a failed
-- publish is then re-enqueued by a sweeper
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'released', 'data',
           cjson.encode({reason = ARGV[4]}))
return 'released'
"""
)

# KEYS: state, lease, events, running. ARGV: epoch, owner, fork_id, reason, status (paused or
# awaiting_approval), pending calls (JSON), event data. Parked, holding no worker and out of the
# running index (never revived), until an operator resumes it or a person decides its calls.
_PAUSE = (
    _NOW
    + _FENCE
    + """
redis.call('HSET', KEYS[1], 'status', ARGV[5], 'owner', '', 'error', ARGV[4], 'pending', ARGV[6], 'parked_ms', now)
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', ARGV[5], 'data', ARGV[7])
return 'released'
"""
)

# KEYS: lease, running, state. ARGV: owner, ttl_ms, fork_id. A fork that stopped running (cancelled)
# is not renewed: its worker learns at the next beat and stops its tool (cooperative cancellation).
_RENEW = (
    _NOW
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[3], 'status') ~= 'running' then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
"""
)

# KEYS: state, lease, events, running, result. ARGV: fork_id, max_attempts, failed result bytes, ttl_s,
# grace_ms. A revived fork stays in the running index, `grace_ms` ahead, until its job is enqueued
# (`_ENQUEUED`): if the sweeper dies or the broker is down in between, a later sweep enqueues it.
_REVIVE = (
    _NOW
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'queued' then
  -- revived earlier: enqueue again only if its job was never confirmed and its grace has passed
  local due = redis.call('ZSCORE', KEYS[4], ARGV[1])
  if not due or tonumber(due) > now then return 'queued' end
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[1])
  return 'requeue'
end
if status ~= 'running' then redis.call('ZREM', KEYS[4], ARGV[1]); return status or 'missing' end
local left = redis.call('PTTL', KEYS[2])
if left > 0 then redis.call('ZADD', KEYS[4], now + left, ARGV[1]); return 'alive' end
local lost = redis.call('HINCRBY', KEYS[1], 'lost', 1)
if lost >= tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[4], ARGV[1])
  local reason = 'worker_lost: the worker running this fork was lost ' .. lost .. ' times; attempts exhausted'
  redis.call('HSET', KEYS[1], 'status', 'failed', 'finished_ms', now, 'error', reason, 'owner', '')
  redis.call('SET', KEYS[5], ARGV[3], 'EX', ARGV[4])
  for _, i in ipairs({1, 3}) do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data',
             cjson.encode({status = 'failed', error = reason}))
  return 'failed'
end
redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '')
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[1])
local attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'revived', 'data',
           cjson.encode({attempt = attempt, lost = lost}))
return 'revive'
"""
)

# KEYS: state, running. ARGV: fork_id. The revived fork's job is in the broker: drop it from the index.
_ENQUEUED = """
if redis.call('HGET', KEYS[1], 'status') == 'queued' then redis.call('ZREM', KEYS[2], ARGV[1]) end
return 1
"""


@dataclass(frozen=True, slots=True)
class Claim:
    """The right to run a fork: the owner token and the epoch it was granted under."""

    fork_id: str
    owner: str
    epoch: int
    attempt: int
    record: bytes = field(default=b"", repr=False, compare=False)  # bootstrap bytes read by the claim
    journal: tuple[bytes, ...] = field(default=(), repr=False, compare=False)  # journal entries at claim time
    running_ms: int = 0  # Redis time since the fork's first claim (its wall-clock limit counts from there)
    primed: bool = False  # the claim wrote the surface entry and published the first `model_call` (`first`)


class Leases:
    """Claims, fenced writes and revival checks over one Redis client."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_ms: int, retention_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_ms = ttl_ms
        self.retention_s = retention_s
        self._claim = client.register_script(_CLAIM.replace("@MAXLEN@", MAXLEN))
        self._append = client.register_script(_APPEND.replace("@MAXLEN@", MAXLEN))
        self._emit = client.register_script(_EMIT.replace("@MAXLEN@", MAXLEN))
        self._finish = client.register_script(_FINISH.replace("@MAXLEN@", MAXLEN))
        self._release = client.register_script(_RELEASE.replace("@MAXLEN@", MAXLEN))
        self._pause = client.register_script(_PAUSE.replace("@MAXLEN@", MAXLEN))
        self._renew = client.register_script(_RENEW)
        self._enqueued = client.register_script(_ENQUEUED)
        self._revive = client.register_script(_REVIVE.replace("@MAXLEN@", MAXLEN))

    def claim(
        self,
        fork_id: str,
        owner: str,
        digest: str | None = None,
        *,
        first: tuple[bytes, JournalEntry, dict[str, Any]] | None = None,
    ) -> Claim | str:
        """Take a queued fork: a `Claim` (with the record and journal), or why not.

        The reason is the fork's status, `leased`, `missing`, or `forged` when `digest` is given
        and is not the fork's launch digest (the fork is then left untouched). With `first` (the
        record bytes, the surface entry and the first `model_call` event's data, built from that record,
        which hashes to `digest`)
        and `digest` given, a first claim of a fork with an empty journal also appends the entry and
        publishes the `model_call` event (`Claim.primed`), if the stored record is `first`'s record bytes.
        """
        record, entry, event = b"", b"", ""
        if first is not None and digest:
            record, entry, event = first[0], first[1].encode(), json.dumps(first[2])
        k = self.keys
        reply = cast(
            list[Any],
            self._claim(
                keys=[
                    k.state(fork_id),
                    k.lease(fork_id),
                    k.events(fork_id),
                    k.running,
                    k.bootstrap(fork_id),
                    k.journal(fork_id),
                ],
                args=[owner, self.ttl_ms, fork_id, digest or "", entry, event, record],
            ),
        )
        if reply[0] != b"claimed":
            return cast(bytes, reply[0]).decode()
        _, attempt, epoch, stored, journal, first_ms, now_ms, primed = reply
        return Claim(
            fork_id=fork_id,
            owner=owner,
            epoch=int(epoch),
            attempt=int(attempt),
            record=record if primed else stored,
            journal=tuple(journal),
            running_ms=int(now_ms) - int(first_ms),
            primed=bool(primed),
        )

    def _fenced(self, claim: Claim, outcome: Any, what: str) -> None:
        text = cast(bytes, outcome).decode()
        if text not in ("ok", "finished", "released"):
            raise LeaseLost(
                f"fork {claim.fork_id}: {what} refused ({text}); this worker (epoch {claim.epoch}) no longer "
                "runs the fork",
                fork_id=claim.fork_id,
                refusal=text,
            )

    def append(self, claim: Claim, *entries: JournalEntry, events: Sequence[tuple[str, dict[str, Any]]] = ()) -> None:
        """Append journal entries (and publish events) under the claim, in one round trip.

        Raises:
            LeaseLost: the claim is stale, the lease lost, or the fork no longer running.
        """
        k = self.keys
        fid = claim.fork_id
        args: list[Any] = [claim.epoch, claim.owner, entries[0].seq if entries else 0, len(entries)]
        args += [e.encode() for e in entries]
        args += [item for kind, data in events for item in (kind, json.dumps(data))]
        outcome = self._append(keys=[k.state(fid), k.lease(fid), k.journal(fid), k.events(fid)], args=args)
        what = ", ".join(f"{e.seq} ({e.kind})" for e in entries) or "events"
        self._fenced(claim, outcome, f"journal entries {what}")

    def emit(self, fork_id: str, events: Sequence[tuple[str, dict[str, Any]]]) -> str:
        """Publish events and read the fork's status, in one round trip."""
        args = [item for kind, data in events for item in (kind, json.dumps(data))]
        status = self._emit(keys=[self.keys.state(fork_id), self.keys.events(fork_id)], args=args)
        return cast(bytes, status).decode()

    def journal(self, fork_id: str) -> list[JournalEntry]:
        """Every journal entry of the fork, in order."""
        raw = cast(list[bytes], self.client.lrange(self.keys.journal(fork_id), 0, -1))
        return [JournalEntry.decode(item, fork_id=fork_id) for item in raw]

    def finish(
        self,
        claim: Claim,
        result: ForkResult,
        *entries: JournalEntry,
        events: Sequence[tuple[str, dict[str, Any]]] = (),
    ) -> None:
        """Write the final result and end the lease (LeaseLost when refused), appending the last
        journal entries and publishing the last events in the same round trip."""
        k = self.keys
        fid = claim.fork_id
        data = json.dumps({"status": result.status.value, "error": result.error, "usage": result.usage.model_dump()})
        outcome = self._finish(
            keys=[
                k.state(fid),
                k.lease(fid),
                k.events(fid),
                k.running,
                k.result(fid),
                k.journal(fid),
                k.bootstrap(fid),
            ],
            args=[
                claim.epoch,
                claim.owner,
                result.status.value,
                result.encode(),
                result.error or "",
                data,
                self.retention_s,
                fid,
                entries[0].seq if entries else 0,
                len(entries),
                *(e.encode() for e in entries),
                *(item for kind, data in events for item in (kind, json.dumps(data))),
            ],
        )
        self._fenced(claim, outcome, "result")

    def release(self, claim: Claim, reason: str, *, grace_ms: int = 30_000) -> None:
        """Give the fork back (queued, lease deleted) so another worker resumes it at once.

        The caller enqueues it and then calls `enqueued`; until then it stays in the running index,
        so a sweeper re-enqueues it after `grace_ms` if that publish never happened.
        """
        k = self.keys
        fid = claim.fork_id
        outcome = self._release(
            keys=[k.state(fid), k.lease(fid), k.events(fid), k.running],
            args=[claim.epoch, claim.owner, fid, reason, grace_ms],
        )
        self._fenced(claim, outcome, "release")

    def pause(self, claim: Claim, reason: str) -> None:
        """Park the fork (`paused`, lease deleted) with a reason, until an operator resumes it."""
        k = self.keys
        fid = claim.fork_id
        outcome = self._pause(
            keys=[k.state(fid), k.lease(fid), k.events(fid), k.running],
            args=[claim.epoch, claim.owner, fid, reason, "paused", "", json.dumps({"reason": reason})],
        )
        self._fenced(claim, outcome, "pause")

    def park(self, claim: Claim, pending: list[dict[str, Any]]) -> None:
        """Park the fork as `awaiting_approval` on `pending` calls: no lease, no worker, not revived."""
        k = self.keys
        fid = claim.fork_id
        names = ", ".join(f"{p['name']} ({p['call_id']})" for p in pending)
        reason = f"awaiting approval of {names}: forkq approve {fid} CALL_ID, or forkq deny {fid} CALL_ID"
        calls = json.dumps(pending, ensure_ascii=False, separators=(",", ":"))
        event = json.dumps({"reason": reason, "calls": pending}, ensure_ascii=False, separators=(",", ":"))
        outcome = self._pause(
            keys=[k.state(fid), k.lease(fid), k.events(fid), k.running],
            args=[claim.epoch, claim.owner, fid, reason, "awaiting_approval", calls, event],
        )
        self._fenced(claim, outcome, "park")

    def renew(self, claims: list[Claim]) -> list[bool]:
        """Renew many leases in one round trip; False where the lease is no longer ours."""
        if not claims:
            return []
        pipe = self.client.pipeline(transaction=False)
        for claim in claims:
            self._renew(
                keys=[self.keys.lease(claim.fork_id), self.keys.running, self.keys.state(claim.fork_id)],
                args=[claim.owner, self.ttl_ms, claim.fork_id],
                client=pipe,
            )
        return [bool(v) for v in pipe.execute()]

    def expired(self, limit: int = 1000) -> list[str]:
        """Fork ids whose lease deadline (Redis time) has passed, oldest first."""
        seconds, micros = self.client.time()
        now_ms = seconds * 1000 + micros // 1000
        ids = cast(list[bytes], self.client.zrangebyscore(self.keys.running, "-inf", now_ms, start=0, num=limit))
        return [i.decode() for i in ids]

    def revive(self, fork_id: str, *, max_attempts: int, grace_ms: int = 30_000) -> str:
        """Sweeper's check of one fork.

        `revive` (now queued: enqueue it), `requeue` (revived earlier, its job may be missing:
        enqueue it), `failed` (worker lost `max_attempts` times), `alive`, or the fork's status.
        """
        k = self.keys
        failed = ForkResult(
            fork_id=fork_id,
            status=Status.FAILED,
            error="worker_lost: the worker running this fork was lost too many times; attempts exhausted",
        )
        outcome = self._revive(
            keys=[k.state(fork_id), k.lease(fork_id), k.events(fork_id), k.running, k.result(fork_id)],
            args=[fork_id, max_attempts, failed.encode(), self.retention_s, grace_ms],
        )
        return cast(bytes, outcome).decode()

    def enqueued(self, fork_id: str) -> None:
        """The revived fork's job is in the broker: it leaves the running index."""
        self._enqueued(keys=[self.keys.state(fork_id), self.keys.running], args=[fork_id])


@dataclass
class LeaseKeeper:
    """One heartbeat thread per worker process, renewing all its forks' leases each `interval_s`."""

    leases: Leases
    interval_s: float
    _held: dict[str, tuple[Claim, threading.Event]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def hold(self, claim: Claim) -> threading.Event:
        """Keep `claim`'s lease alive; the returned event is set if the lease is lost."""
        lost = threading.Event()
        with self._lock:
            self._held[claim.fork_id] = (claim, lost)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="forkq-heartbeat", daemon=True)
                self._thread.start()
        return lost

    def drop(self, claim: Claim) -> None:
        """Stop renewing `claim`'s lease."""
        with self._lock:
            held = self._held.get(claim.fork_id)
            if held is not None and held[0] == claim:
                del self._held[claim.fork_id]

    def stop(self) -> None:
        """End the heartbeat thread."""
        self._stop.set()

    def beat(self) -> None:
        """One renewal round trip for every held lease."""
        with self._lock:
            held = list(self._held.values())
        try:
            renewed = self.leases.renew([claim for claim, _ in held])
        except redis.RedisError as exc:  # retried next beat; the lease TTL covers a few misses
            log.warning("lease heartbeat failed: %s", exc)
            return
        for (claim, lost), ok in zip(held, renewed, strict=True):
            with self._lock:
                still_held = self._held.get(claim.fork_id, (None,))[0] == claim
            if not ok and still_held:  # a fork that just finished dropped its lease: not a loss
                log.warning("fork %s: lease lost or fork no longer running (epoch %d)", claim.fork_id, claim.epoch)
                lost.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

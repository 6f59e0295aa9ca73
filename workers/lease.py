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

# KEYS: state, lease, events, running. ARGV: owner, ttl_ms, fork_id.
_CLAIM = (
    _NOW
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing', 0, 0} end
if status ~= 'queued' then return {status, 0, 0} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'leased', 0, 0} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[1], 'started_ms', now)
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[2]), ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'started', 'data',
           cjson.encode({owner = ARGV[1], attempt = attempt, epoch = epoch}))
return {'claimed', attempt, epoch}
"""
)

# KEYS: state, lease, journal. ARGV: epoch, owner, seq, entry bytes.
_APPEND = (
    _FENCE
    + """
if redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[3]) then return 'seq' end
redis.call('RPUSH', KEYS[3], ARGV[4])
return 'ok'
"""
)

# KEYS: state, lease, events, running, result, journal, bootstrap. ARGV: epoch, owner, status,
# result bytes, error, event data, ttl_s, fork_id.
_FINISH = (
    _NOW
    + _FENCE
    + """
redis.call('SET', KEYS[5], ARGV[4], 'EX', ARGV[7])
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finished_ms', now, 'error', ARGV[5])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[8])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data', ARGV[6])
for _, i in ipairs({1, 3, 6, 7}) do redis.call('EXPIRE', KEYS[i], ARGV[7]) end
return 'finished'
"""
)

# KEYS: state, lease, events, running. ARGV: epoch, owner, fork_id, reason. Back to queued, at once.
_RELEASE = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '')
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'released', 'data',
           cjson.encode({reason = ARGV[4]}))
return 'released'
"""
)

# KEYS: state, lease, events, running. ARGV: epoch, owner, fork_id, reason. Parked until resumed.
_PAUSE = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'status', 'paused', 'owner', '', 'error', ARGV[4])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'paused', 'data', cjson.encode({reason = ARGV[4]}))
return 'released'
"""
)

# KEYS: lease, running. ARGV: owner, ttl_ms, fork_id.
_RENEW = (
    _NOW
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
"""
)

# KEYS: state, lease, events, running, result. ARGV: fork_id, max_attempts, failed result bytes.
_REVIVE = (
    _NOW
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then redis.call('ZREM', KEYS[4], ARGV[1]); return status or 'missing' end
local left = redis.call('PTTL', KEYS[2])
if left > 0 then redis.call('ZADD', KEYS[4], now + left, ARGV[1]); return 'alive' end
redis.call('ZREM', KEYS[4], ARGV[1])
local attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
if attempt >= tonumber(ARGV[2]) then
  local reason = 'worker_lost: the worker running this fork died ' .. attempt .. ' times; attempts exhausted'
  redis.call('HSET', KEYS[1], 'status', 'failed', 'finished_ms', now, 'error', reason, 'owner', '')
  redis.call('SET', KEYS[5], ARGV[3], 'KEEPTTL')
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'finished', 'data',
             cjson.encode({status = 'failed', error = reason}))
  return 'failed'
end
redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '')
redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'revived', 'data', cjson.encode({attempt = attempt}))
return 'revive'
"""
)


@dataclass(frozen=True, slots=True)
class Claim:
    """The right to run a fork: the owner token and the epoch it was granted under."""

    fork_id: str
    owner: str
    epoch: int
    attempt: int


class Leases:
    """Claims, fenced writes and revival checks over one Redis client."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_ms: int, retention_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_ms = ttl_ms
        self.retention_s = retention_s
        self._claim = client.register_script(_CLAIM.replace("@MAXLEN@", MAXLEN))
        self._append = client.register_script(_APPEND)
        self._finish = client.register_script(_FINISH.replace("@MAXLEN@", MAXLEN))
        self._release = client.register_script(_RELEASE.replace("@MAXLEN@", MAXLEN))
        self._pause = client.register_script(_PAUSE.replace("@MAXLEN@", MAXLEN))
        self._renew = client.register_script(_RENEW)
        self._revive = client.register_script(_REVIVE.replace("@MAXLEN@", MAXLEN))

    def claim(self, fork_id: str, owner: str) -> Claim | str:
        """Take a queued fork: a `Claim`, or the reason it was not taken (its status, or `leased`)."""
        k = self.keys
        outcome, attempt, epoch = cast(
            list[Any],
            self._claim(
                keys=[k.state(fork_id), k.lease(fork_id), k.events(fork_id), k.running],
                args=[owner, self.ttl_ms, fork_id],
            ),
        )
        if outcome != b"claimed":
            return cast(bytes, outcome).decode()
        return Claim(fork_id=fork_id, owner=owner, epoch=int(epoch), attempt=int(attempt))

    def _fenced(self, claim: Claim, outcome: Any, what: str) -> None:
        text = cast(bytes, outcome).decode()
        if text not in ("ok", "finished", "released"):
            raise LeaseLost(
                f"fork {claim.fork_id}: {what} refused ({text}); this worker (epoch {claim.epoch}) no longer "
                "runs the fork",
                fork_id=claim.fork_id,
            )

    def append(self, claim: Claim, entry: JournalEntry) -> None:
        """Append a journal entry under the claim (LeaseLost when refused)."""
        k = self.keys
        fid = claim.fork_id
        outcome = self._append(
            keys=[k.state(fid), k.lease(fid), k.journal(fid)],
            args=[claim.epoch, claim.owner, entry.seq, entry.encode()],
        )
        self._fenced(claim, outcome, f"journal entry {entry.seq} ({entry.kind})")

    def journal(self, fork_id: str) -> list[JournalEntry]:
        """Every journal entry of the fork, in order."""
        raw = cast(list[bytes], self.client.lrange(self.keys.journal(fork_id), 0, -1))
        return [JournalEntry.decode(item, fork_id=fork_id) for item in raw]

    def finish(self, claim: Claim, result: ForkResult) -> None:
        """Write the final result and end the lease (LeaseLost when refused)."""
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
            ],
        )
        self._fenced(claim, outcome, "result")

    def release(self, claim: Claim, reason: str) -> None:
        """Give the fork back (queued, lease deleted) so another worker resumes it at once."""
        k = self.keys
        fid = claim.fork_id
        outcome = self._release(
            keys=[k.state(fid), k.lease(fid), k.events(fid), k.running], args=[claim.epoch, claim.owner, fid, reason]
        )
        self._fenced(claim, outcome, "release")

    def pause(self, claim: Claim, reason: str) -> None:
        """Park the fork (`paused`, lease deleted) with a reason, until an operator resumes it."""
        k = self.keys
        fid = claim.fork_id
        outcome = self._pause(
            keys=[k.state(fid), k.lease(fid), k.events(fid), k.running], args=[claim.epoch, claim.owner, fid, reason]
        )
        self._fenced(claim, outcome, "pause")

    def renew(self, claims: list[Claim]) -> list[bool]:
        """Renew many leases in one round trip; False where the lease is no longer ours."""
        if not claims:
            return []
        pipe = self.client.pipeline(transaction=False)
        for claim in claims:
            self._renew(
                keys=[self.keys.lease(claim.fork_id), self.keys.running],
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

    def revive(self, fork_id: str, *, max_attempts: int) -> str:
        """Sweeper's check of one fork: `revive` (now queued), `failed`, `alive`, or its status."""
        k = self.keys
        failed = ForkResult(
            fork_id=fork_id,
            status=Status.FAILED,
            error="worker_lost: the worker running this fork died; attempts exhausted",
        )
        outcome = self._revive(
            keys=[k.state(fork_id), k.lease(fork_id), k.events(fork_id), k.running, k.result(fork_id)],
            args=[fork_id, max_attempts, failed.encode()],
        )
        return cast(bytes, outcome).decode()


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
            if not ok:
                log.warning("fork %s: lease lost (epoch %d)", claim.fork_id, claim.epoch)
                lost.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

"""A fork's execution rights: the lease, the fencing epoch, and every write made under them.

Claiming a fork sets its lease (`SET NX PX` owner token) and increments its epoch. Every journal
append, checkpoint, release and result write runs as a Lua script (`workers.store.lease_scripts`) that
first checks the epoch, the lease owner and the status, so a stale worker (paused, partitioned,
revived behind) fails closed. Lease deadlines are Redis time (`PEXPIRE`, `TIME`), never worker
clocks (a worker's own clock only bounds how long it retries). One heartbeat thread per process
renews the leases of all its running forks in one pipelined round trip.

A Redis outage shorter than the lease costs a run nothing: a write that cannot reach Redis is
retried (jittered, capped backoff) until Redis answers or the sweeper may have revived the fork,
which this worker knows on its own monotonic clock: the lease TTL after the last reply that set
or renewed it, plus the sweeper's grace (`LeaseClock`). Only then does the run stop as having
lost its lease. A lease that lapsed during the outage is taken back by its run's next renewal or
write, unless the fork was revived meanwhile; the sweeper leaves a lapsed lease alone for a grace
(`revival_grace_s`: a heartbeat interval and the heartbeat's longest retry delay) so that the
worker, renewing as soon as Redis answers, gets there first. A claim is retried for as long as
Redis does not answer: until it ran, nothing else would run the fork. A retried write whose first
attempt ran (only its reply was lost) is recognised by its script and not written again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import redis

from workers.base.keys import Keys
from workers.errors import LeaseLost
from workers.records.fork import ForkResult, Status
from workers.records.journal import JournalEntry
from workers.records.parked import ParkedCall, encode_parked
from workers.store import lease_scripts as lua
from workers.store import reads
from workers.store.claims import FirstWrite, Refusal
from workers.store.pipelined import Rider, ScriptCall, run_scripts
from workers.store.presence import owns
from workers.store.replies import FencedReply, RevivalReply, Written, fenced_reply, revival_reply

if TYPE_CHECKING:  # the event models load at the first write, not with the client (`forkq status` starts without)
    from workers.records.events import Event

log = logging.getLogger("forkq.lease")

T = TypeVar("T")

# errors after which Redis may answer again (restart, failover, dropped connection, AOF loading):
# retried; any other error (a script error, OOM, a wrong type) is a bug or a full Redis, not a blip
TRANSIENT: Final = (redis.ConnectionError, redis.TimeoutError)
RETRY_BASE_S: Final = 0.05  # first retry delay; doubles per failure, jittered
RETRY_CAP_S: Final = 1.0  # longest delay: a restarted Redis is noticed within about a second
# past the computed end of a lease, for the rate difference of this worker's clock and Redis's
LAPSE_MARGIN_S: Final = 1.0
# beyond a heartbeat interval and RETRY_CAP_S, in the sweeper's grace: the renewal's own round trip
GRACE_MARGIN_S: Final = 0.5
# leases one renewal script call renews: Redis runs a call of this many in about a millisecond
RENEW_BATCH: Final = 500


def _event_fields(events: Sequence[Event]) -> list[str]:
    """The events as a script's (type, data) argument pairs."""
    return [field for event in events for field in event.encoded()]


def _answer(riders: Sequence[Rider], replies: Sequence[Any]) -> None:
    """Hand each rider its reply; one whose handler fails is logged, and the others are still answered."""
    for rider, reply in zip(riders, replies, strict=True):
        try:
            rider.answer(reply)
        except Exception:
            log.exception("a script riding on a fork's write: its reply could not be handled")


def _hand_back(riders: Sequence[Rider], exc: Exception) -> None:
    """Tell each rider it was not sent (or may not have been)."""
    for rider in riders:
        try:
            rider.failed(exc)
        except Exception:
            log.exception("a script riding on a fork's write: its fallback failed")


def revival_grace_s(heartbeat_s: float) -> float:
    """How long past its end the sweeper leaves a lapsed lease to its worker before reviving the fork.

    A lease renewed at most `heartbeat_s` before a Redis outage lapses at most that long before the end
    of an outage shorter than the TTL, and the heartbeat retries within `RETRY_CAP_S` of Redis answering:
    the worker takes its lease back before the grace ends, so the outage costs no attempt.
    """
    return heartbeat_s + RETRY_CAP_S + GRACE_MARGIN_S


def backoff_s(failures: int) -> float:
    """The delay before the retry that follows `failures` consecutive failures: jittered, capped."""
    ceiling = min(RETRY_CAP_S, RETRY_BASE_S * 2 ** min(failures - 1, 30))
    return random.uniform(ceiling / 2, ceiling)


@dataclass
class LeaseClock:
    """The latest moment, on this worker's monotonic clock, at which a claim's lease can still exist."""

    ttl_s: float
    until: float = float("-inf")
    grace_s: float = 0.0  # the sweeper's grace after a lease's end (`revival_grace_s`)

    def renewed(self, answered: float) -> None:
        """Redis set or renewed the lease before `answered` (when its reply arrived): it lives at most a TTL more."""
        self.until = max(self.until, answered + self.ttl_s)

    def deadline(self) -> float:
        """When the lease has certainly lapsed and its grace passed, so the fork may have been revived:
        retrying a write past it is pointless (before it, a write takes a lapsed lease back)."""
        return self.until + self.grace_s + LAPSE_MARGIN_S


def forever() -> float:
    """A `ride_out` deadline that never comes: retry until Redis answers."""
    return float("inf")


def ride_out(
    call: Callable[[], T],
    *,
    until: Callable[[], float],
    what: str,
    fork_id: str,
    transient: tuple[type[Exception], ...] = TRANSIENT,
) -> T:
    """`call()`, retried through Redis connection errors and timeouts (`transient`) until the monotonic time `until()`.

    Raises:
        LeaseLost: (refusal `unreachable`) Redis did not answer before `until()`.
    """
    failures, started = 0, time.monotonic()
    while True:
        try:
            result = call()
        except transient as exc:
            failures += 1
            left = until() - time.monotonic()
            if left <= 0:
                raise LeaseLost(
                    f"fork {fork_id}: {what} failed: Redis did not answer for {time.monotonic() - started:.1f} s "
                    f"({exc}), until this worker's lease had lapsed and the sweeper's grace passed; the sweeper "
                    "revives the fork once Redis answers (check it with `forkq check`)",
                    fork_id=fork_id,
                    refusal="unreachable",
                ) from exc
            if failures == 1:
                bound = "until it answers" if left == float("inf") else f"for up to {left:.1f} s"
                log.warning("fork %s: %s: Redis unreachable (%s); retrying %s", fork_id, what, exc, bound)
            time.sleep(min(backoff_s(failures), left))
            continue
        if failures:
            log.warning(
                "fork %s: %s: done after %.1f s and %d retries (Redis answered again)",
                fork_id,
                what,
                time.monotonic() - started,
                failures,
            )
        return result


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
    mail: int = 0  # messages waiting in the fork's inbox when it was claimed
    # when the lease has certainly lapsed (the claim's reply, then each renewal, moves it on)
    clock: LeaseClock = field(default_factory=lambda: LeaseClock(0.0), repr=False, compare=False)


class Leases:
    """Claims, fenced writes and revival checks over one Redis client."""

    def __init__(
        self, client: redis.Redis, keys: Keys, *, ttl_ms: int, retention_s: int, lapse_grace_ms: int = 0
    ) -> None:
        self.client = client
        self.keys = keys
        self.ttl_ms = ttl_ms
        self.retention_s = retention_s
        # the sweeper's grace for a lapsed lease (`revival_grace_s`): a run retries its writes through it
        self.lapse_grace_ms = lapse_grace_ms
        self._claim = client.register_script(lua.CLAIM)
        self._append = client.register_script(lua.APPEND)
        self._deliver = client.register_script(lua.DELIVER)
        self._emit = client.register_script(lua.EMIT)
        self._finish = client.register_script(lua.FINISH)
        self._release = client.register_script(lua.RELEASE)
        self._pause = client.register_script(lua.PAUSE)
        self._renew = client.register_script(lua.RENEW)
        self._enqueued = client.register_script(lua.ENQUEUED)
        self._revive = client.register_script(lua.REVIVE)
        self._sweep_clock = client.register_script(lua.SWEEP_CLOCK)

    def claim(
        self,
        fork_id: str,
        owner: str,
        digest: str | None = None,
        *,
        first: FirstWrite | None = None,
    ) -> Claim | Refusal:
        """Take a queued fork: a `Claim` (with the record and journal), or a `Refusal` saying why not.

        The refusal names the fork's status when it is not queued, else `leased`, `missing`, or `forged`
        when `digest` is given and is not the fork's launch digest (the fork is then left untouched). With
        `first` (the record bytes, the surface entry and the first `model_call` event's data, built from
        that record, which hashes to `digest`)
        and `digest` given, a first claim of a fork with an empty journal also appends the entry and
        publishes the `model_call` event (`Claim.primed`), if the stored record is `first`'s record bytes.

        Redis errors are retried until Redis answers, however long that takes: a claim that never ran
        leaves the fork queued with this delivery its only job, and one that ran is indexed (the sweeper
        revives it if this worker dies meanwhile). A claim whose first attempt ran (the lease holds
        `owner`, or lapsed since and the state still names it) is handed back as it was granted.
        """
        record, entry, event = b"", b"", ""
        if first is not None and digest:
            record, entry, event = first.record, first.surface.encode(), first.model_call.data.to_json()
        k = self.keys
        keys = [
            k.state(fork_id),
            k.lease(fork_id),
            k.events(fork_id),
            k.running,
            k.bootstrap(fork_id),
            k.journal(fork_id),
            k.inbox(fork_id),
        ]
        args: list[Any] = [owner, self.ttl_ms, fork_id, digest or "", entry, event, record]
        reply = cast(
            list[Any], ride_out(lambda: self._claim(keys=keys, args=args), until=forever, what="claim", fork_id=fork_id)
        )
        if reply[0] != Written.CLAIMED.value.encode():
            return Refusal.from_reply(cast(bytes, reply[0]).decode(), fork_id=fork_id)
        clock = LeaseClock(self.ttl_ms / 1000, grace_s=self.lapse_grace_ms / 1000)
        clock.renewed(time.monotonic())
        _, attempt, epoch, stored, journal, first_ms, now_ms, primed, mail = reply
        return Claim(
            fork_id=fork_id,
            owner=owner,
            epoch=int(epoch),
            attempt=int(attempt),
            record=record if primed else stored,
            journal=tuple(journal),
            running_ms=int(now_ms) - int(first_ms),
            primed=bool(primed),
            mail=int(mail),
            clock=clock,
        )

    def _write(
        self, claim: Claim, what: str, script: Any, keys: list[str], args: list[Any], *, riders: Sequence[Rider] = ()
    ) -> FencedReply:
        """Run a fenced script under `claim`, riding out a Redis outage until the fork may have been revived.

        `riders` go in the same round trip, each handed its reply (or, when the write never reached Redis, the
        error) before this returns or raises: a refused write does not keep them from running.
        """
        if not riders:
            outcome = ride_out(
                lambda: script(keys=keys, args=args), until=claim.clock.deadline, what=what, fork_id=claim.fork_id
            )
            return fenced_reply(outcome, script=what, fork_id=claim.fork_id)
        calls = [ScriptCall(script, keys, args), *(rider.call for rider in riders)]
        try:
            outcome, *replies = ride_out(
                lambda: run_scripts(self.client, calls, raise_on_error=False),
                until=claim.clock.deadline,
                what=what,
                fork_id=claim.fork_id,
            )
        except BaseException as exc:  # not sent, or not known to be: each rider falls back (a release to its process)
            fault = exc if isinstance(exc, Exception) else RuntimeError(f"{what} interrupted ({type(exc).__name__})")
            _hand_back(riders, fault)
            raise
        _answer(riders, replies)
        if isinstance(outcome, Exception):
            raise outcome
        return fenced_reply(outcome, script=what, fork_id=claim.fork_id)

    def send_riders(self, claim: Claim, riders: Sequence[Rider]) -> None:
        """Send riders that no write of the fork took along (its run ended first), in one round trip of their own;
        one that does not get through is handed its error."""
        if not riders:
            return
        send = lambda: run_scripts(self.client, [rider.call for rider in riders], raise_on_error=False)  # noqa: E731
        try:  # through a Redis outage as the run's writes are, until the fork may have been revived
            what = "its last charge and release"
            replies = ride_out(send, until=claim.clock.deadline, what=what, fork_id=claim.fork_id)
        except (LeaseLost, redis.RedisError) as exc:
            _hand_back(riders, exc)
            return
        _answer(riders, replies)

    def _fenced(self, claim: Claim, reply: FencedReply, what: str) -> Written:
        """The write's `Written` word; LeaseLost when it was refused (`refusal`: the word, a status or a `Refused`)."""
        if not isinstance(reply, Written):
            raise LeaseLost(
                f"fork {claim.fork_id}: {what} refused ({reply.value}); this worker (epoch {claim.epoch}) no longer "
                "runs the fork",
                fork_id=claim.fork_id,
                refusal=reply.value,
            )
        return reply

    def append(
        self, claim: Claim, *entries: JournalEntry, events: Sequence[Event] = (), riders: Sequence[Rider] = ()
    ) -> bool:
        """Append journal entries (and publish events) under the claim, in one round trip with `riders`; True when
        messages wait in the fork's inbox (`deliver` moves them into the journal).

        Raises:
            LeaseLost: the claim is stale, the lease lost, or the fork no longer running.
        """
        k = self.keys
        fid = claim.fork_id
        args: list[Any] = [claim.epoch, claim.owner, self.ttl_ms, entries[0].seq if entries else 0, len(entries)]
        args += [e.encode() for e in entries]
        args += _event_fields(events)
        what = "journal entries " + (", ".join(f"{e.seq} ({e.kind})" for e in entries) or "events")
        keys = [k.state(fid), k.lease(fid), k.journal(fid), k.events(fid), k.inbox(fid)]
        written = self._write(claim, what, self._append, keys, args, riders=riders)
        return self._fenced(claim, written, what) is Written.MAIL

    def inbox(self, fork_id: str, limit: int) -> list[bytes]:
        """The oldest `limit` messages waiting in the fork's inbox (a read: `deliver` moves them)."""
        return cast(list[bytes], self.client.lrange(self.keys.inbox(fork_id), 0, limit - 1))

    def deliver(
        self,
        claim: Claim,
        entries: Sequence[JournalEntry],
        items: Sequence[bytes],
        events: Sequence[Event] = (),
        riders: Sequence[Rider] = (),
    ) -> bool:
        """Append `entries` (any held entry, then one `message` entry per item) and take `items` (the inbox's
        oldest) from the inbox, at once and once; True while more messages wait.

        Raises:
            LeaseLost: the claim is stale, the lease lost, the fork no longer running, or the inbox no longer
                starts with `items` (`refusal` is `inbox`).
        """
        k = self.keys
        fid = claim.fork_id
        args: list[Any] = [claim.epoch, claim.owner, self.ttl_ms, entries[0].seq, len(entries), len(items)]
        args += [e.encode() for e in entries] + list(items)
        args += _event_fields(events)
        keys = [k.state(fid), k.lease(fid), k.journal(fid), k.events(fid), k.inbox(fid)]
        what = f"{len(entries)} message(s)"
        written = self._write(claim, what, self._deliver, keys, args, riders=riders)
        return self._fenced(claim, written, what) is Written.MAIL

    def emit(self, claim: Claim, events: Sequence[Event], riders: Sequence[Rider] = ()) -> FencedReply:
        """Publish events under the claim and read the fork's status, in one round trip (with `riders`).

        `running` when the events were published; otherwise none was, and the reply is the fork's
        status when it no longer runs (`cancelled`, ...), else `stale` or `lost`.
        """
        k = self.keys
        fid = claim.fork_id
        mark = uuid.uuid4().hex  # lets a retry whose first attempt ran see that it did
        args = [claim.epoch, claim.owner, mark, self.ttl_ms]
        args += _event_fields(events)
        keys = [k.state(fid), k.lease(fid), k.events(fid)]
        return self._write(claim, "checkpoint", self._emit, keys, args, riders=riders)

    def journal(self, fork_id: str) -> list[JournalEntry]:
        """Every journal entry of the fork, in order."""
        return reads.run(self.client, reads.journal(self.keys, fork_id))

    def finish(
        self,
        claim: Claim,
        result: ForkResult,
        *entries: JournalEntry,
        events: Sequence[Event] = (),
        riders: Sequence[Rider] = (),
    ) -> Written:
        """Write the final result and end the lease (LeaseLost when refused), appending the last
        journal entries and publishing the last events in the same round trip.

        `finished`; or `continued` when a fork that would succeed has messages waiting in its inbox: then no
        result is written and the fork is queued again (released: the caller enqueues it, then `enqueued`).
        """
        k = self.keys
        fid = claim.fork_id
        from workers.records.events import FinishedData  # noqa: PLC0415 (loaded at the first write: see forks.py)

        data = FinishedData(status=result.status, error=result.error, usage=result.usage).to_json()
        keys = [k.state(fid), k.lease(fid), k.events(fid), k.running, k.result(fid), k.journal(fid), k.bootstrap(fid)]
        keys.append(k.inbox(fid))
        args = [
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
            *_event_fields(events),
        ]
        return self._fenced(claim, self._write(claim, "result", self._finish, keys, args, riders=riders), "result")

    def release(self, claim: Claim, reason: str, *, grace_ms: int = 30_000) -> None:
        """Give the fork back (queued, lease deleted) so another worker resumes it at once.

        The caller enqueues it and then calls `enqueued`; until then it stays in the running index,
        so a sweeper re-enqueues it after `grace_ms` if that publish never happened.
        """
        k = self.keys
        fid = claim.fork_id
        keys = [k.state(fid), k.lease(fid), k.events(fid), k.running]
        outcome = self._write(claim, "release", self._release, keys, [claim.epoch, claim.owner, fid, reason, grace_ms])
        self._fenced(claim, outcome, "release")

    def pause(self, claim: Claim, reason: str, *, detail: str = "", budget_session: str | None = None) -> None:
        """Park the fork (`paused`, lease deleted) with a reason, until an operator resumes it.

        `detail` is the human account of a pause whose reason is a word (`budget_reached`); with
        `budget_session`, the fork joins that session's budget-paused forks (a raise of the budget resumes them).
        """
        from workers.records.events import ReasonData  # noqa: PLC0415 (loaded at the first write: see forks.py)

        k = self.keys
        fid = claim.fork_id
        keys = [k.state(fid), k.lease(fid), k.events(fid), k.running]
        if budget_session is not None:
            keys.append(k.session_budget_paused(budget_session))
        text = f"{reason}: {detail}" if detail else reason
        # the status is also the type of the event the script writes (`PausedEvent`), with this data
        args = [claim.epoch, claim.owner, fid, reason, Status.PAUSED.value, "", ReasonData(reason=text).to_json()]
        args.append(detail)
        self._fenced(claim, self._write(claim, "pause", self._pause, keys, args), "pause")

    def park(self, claim: Claim, pending: Sequence[ParkedCall]) -> None:
        """Park the fork as `awaiting_approval` on `pending` calls: no lease, no worker, not revived."""
        from workers.records.events import AwaitingApprovalData  # noqa: PLC0415 (loaded at the first write)

        k = self.keys
        fid = claim.fork_id
        names = ", ".join(f"{p.name} ({p.call_id})" for p in pending)
        reason = f"awaiting approval of {names}: forkq approve {fid} CALL_ID, or forkq deny {fid} CALL_ID"
        event = AwaitingApprovalData(reason=reason, calls=list(pending)).to_json()  # `AwaitingApprovalEvent`'s data
        calls = encode_parked(pending)
        keys = [k.state(fid), k.lease(fid), k.events(fid), k.running]
        # the state's wait is the calls (`pending`): no reason text, and no CLI command, in the state
        args = [claim.epoch, claim.owner, fid, "", Status.AWAITING_APPROVAL.value, calls, event]
        self._fenced(claim, self._write(claim, "park", self._pause, keys, args), "park")

    def renew(self, claims: list[Claim]) -> list[int]:
        """Renew many leases in one round trip: 1 renewed, 2 lapsed and taken back (the fork was never
        revived), 0 where the lease is no longer ours."""
        if not claims:
            return []
        pipe = self.client.pipeline(transaction=False)
        for start in range(0, len(claims), RENEW_BATCH):
            keys: list[str] = [self.keys.running]
            args: list[Any] = [self.ttl_ms]
            for claim in claims[start : start + RENEW_BATCH]:
                keys += [self.keys.lease(claim.fork_id), self.keys.state(claim.fork_id)]
                args += [claim.owner, claim.fork_id, claim.epoch]
            self._renew(keys=keys, args=args, client=pipe)
        return [int(v) for batch in pipe.execute() for v in batch]

    def expired(self, limit: int = 1000) -> list[str]:
        """Fork ids whose lease deadline (Redis time) has passed, oldest first."""
        seconds, micros = self.client.time()
        now_ms = seconds * 1000 + micros // 1000
        ids = cast(list[bytes], self.client.zrangebyscore(self.keys.running, "-inf", now_ms, start=0, num=limit))
        return [i.decode() for i in ids]

    def revive(
        self,
        fork_id: str,
        *,
        max_attempts: int,
        grace_ms: int = 30_000,
        lapse_grace_ms: int = 0,
        dead_owner: str = "",
    ) -> RevivalReply:
        """Sweeper's check of one fork.

        `revive` (now queued: enqueue it), `requeue` (revived earlier, its job may be missing:
        enqueue it), `failed` (worker lost `max_attempts` times), `alive`, `grace` (the lease lapsed
        less than `lapse_grace_ms` ago: left to its worker to take back), or the fork's status.
        With `dead_owner` (the owner token of a worker whose connection is gone), a lease that owner
        still holds counts as expired.
        """
        k = self.keys
        reason = lua.worker_lost_error(max_attempts)
        failed = ForkResult(fork_id=fork_id, status=Status.FAILED, error=reason)
        outcome = self._revive(
            keys=[k.state(fork_id), k.lease(fork_id), k.events(fork_id), k.running, k.result(fork_id)],
            args=[
                fork_id,
                max_attempts,
                failed.encode(),
                self.retention_s,
                grace_ms,
                lapse_grace_ms,
                reason,
                dead_owner,
            ],
        )
        return revival_reply(outcome, fork_id=fork_id)

    def owned_by(self, presence: str) -> list[tuple[str, str]]:
        """(fork id, owner token) of every running fork whose owner names the presence token `presence`.

        Two round trips over the running index: only called for a worker found dead, which is rare.
        """
        ids = [i.decode() for i in cast(list[bytes], self.client.zrange(self.keys.running, 0, -1))]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for fork_id in ids:
            pipe.hget(self.keys.state(fork_id), "owner")
        owners = [(o or b"").decode() for o in cast(list[bytes | None], pipe.execute())]
        return [(fid, owner) for fid, owner in zip(ids, owners, strict=True) if owns(presence, owner)]

    def in_outage_grace(self, *, gap_ms: int) -> bool:
        """Record a sweeper pass; True while lapsed leases are left to their workers (`lapse_grace_ms`).

        The grace starts when no sweeper pass reached Redis for more than `gap_ms`: Redis was down
        (restart, failover, a stopped process), so leases may have lapsed with their workers alive and
        cut off; they take them back at their first renewal. Sweeping all along, a lapsed lease means
        a dead or silent worker, and its fork is revived at once.
        """
        if self.lapse_grace_ms <= 0:
            return False
        day_ms = 24 * 3600 * 1000
        return bool(self._sweep_clock(keys=[self.keys.sweep], args=[gap_ms, self.lapse_grace_ms, day_ms]))

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
    _failing_since: float | None = None  # when renewals started failing (monotonic), while they do

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

    def beat(self) -> bool:
        """One renewal round trip for every held lease; False when Redis did not answer."""
        with self._lock:
            held = list(self._held.values())
        try:
            renewed = self.leases.renew([claim for claim, _ in held])
        except redis.RedisError as exc:  # retried soon; the lease TTL covers the outage
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                log.warning("lease heartbeat failed: %s; retrying until Redis answers", exc)
            return False
        answered = time.monotonic()
        if self._failing_since is not None:
            log.warning("lease heartbeat: Redis answered again after %.1f s", answered - self._failing_since)
            self._failing_since = None
        for (claim, lost), ok in zip(held, renewed, strict=True):
            if ok:
                claim.clock.renewed(answered)
                if ok == 2:
                    log.warning("fork %s: its lease lapsed while Redis was unreachable; taken back", claim.fork_id)
                continue
            with self._lock:
                still_held = self._held.get(claim.fork_id, (None,))[0] == claim
            if still_held:  # a fork that just finished dropped its lease: not a loss
                log.warning("fork %s: lease lost or fork no longer running (epoch %d)", claim.fork_id, claim.epoch)
                lost.set()
        return True

    def _run(self) -> None:
        failures = 0
        # after a failed beat, the next comes within about a second: renewed as soon as Redis is back
        while not self._stop.wait(min(self.interval_s, backoff_s(failures)) if failures else self.interval_s):
            failures = 0 if self.beat() else failures + 1

"""The sweeper: finds forks whose worker is gone or whose lease expired, and revives them (or fails them
after max attempts).

A worker process that dies closes its Redis connections at once: the sweeper looks at the workers'
connections every `presence_s` (`workers.store.presence`) and revives a dead worker's forks within
about a second, without waiting for their leases, and frees the model admission slots it held
(`workers.store.admission`; a silent worker's slots expire with its leases). A worker that is alive but silent keeps its
connection; its forks are revived when their leases expire, as below.

Any number of sweepers may run: the revive transition is one Lua script per fork, so each expired
lease is revived once. A fork whose worker merely stalls for less than its lease is never touched,
and after a Redis outage a lease that lapsed is left to its worker for a grace (`Leases.lapse_grace_ms`,
a heartbeat interval and a second and a half by default: `workers.store.lease.revival_grace_s`), so that a
worker cut off by an outage shorter than the lease takes its lease back before anyone revives the fork.
The grace applies only after an outage (no sweeper pass reached Redis for `outage_gap_s`); while the
sweepers reach Redis all along, a lapsed lease means a dead or silent worker and is revived at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis

from workers.records.fork import Status
from workers.service.metrics import Metrics
from workers.store.forks import ForkStore
from workers.store.lease import Leases
from workers.store.lease_scripts import worker_lost_error
from workers.store.presence import PresenceWatch, refused
from workers.store.replies import Revival, RevivalReply

log = logging.getLogger("forkq.sweeper")

# fork id, digest, attempt: sends the job, then confirms it enqueued (`workers.broker.queue.enqueue_again`)
Enqueue = Callable[[str, str, int], None]


def outage_gap_s(interval_s: float) -> float:
    """How long no sweeper pass may reach Redis before the sweepers treat it as an outage: two passes
    missed and a second. Shorter than a lease TTL less a heartbeat (10 s by default), the shortest outage
    that can lapse a renewed lease."""
    return 2 * interval_s + 1.0


@dataclass
class Sweeper:
    """One sweeper: `sweep_once` for a pass, `run` until stopped."""

    leases: Leases
    store: ForkStore
    enqueue: Enqueue
    max_attempts: int
    interval_s: float
    metrics: Metrics | None = None  # counts revivals (`forkq_revivals_total`)
    failed: Callable[[str, int], None] | None = None  # a fork failed worker_lost: (fork id, its last attempt)
    presence: PresenceWatch | None = None  # the workers' connections (`sweep_dead`); None: leases only
    presence_s: float = 0.0  # how often `run` looks at them
    # frees a dead worker process's model admission holds (`AdmissionStore.release_owner`): as fast as its forks
    release_holds: Callable[[str], int] | None = None

    def sweep_once(self) -> Counter[str]:
        """One pass over expired leases; counts outcomes (`revive`, `requeue`, `failed`, `alive`, ...).

        Raises:
            the broker's error when an enqueue fails (the fork stays in the index for a later pass).
        """
        outcomes: Counter[str] = Counter()
        outage = self.leases.in_outage_grace(gap_ms=int(outage_gap_s(self.interval_s) * 1000))
        lapse_grace_ms = self.leases.lapse_grace_ms if outage else 0
        grace_ms = self._requeue_grace_ms()
        for fork_id in self.leases.expired():
            outcome = self.leases.revive(
                fork_id, max_attempts=self.max_attempts, grace_ms=grace_ms, lapse_grace_ms=lapse_grace_ms
            )
            self._settle(fork_id, outcome, outcomes, "lease expired")
        return outcomes

    def sweep_dead(self) -> Counter[str]:
        """One look at the workers' connections: revives the forks of every worker whose connection is gone.

        Raises:
            Redis's error (every observation is then forgotten), or the broker's when an enqueue fails.
        """
        outcomes: Counter[str] = Counter()
        if self.presence is None:
            return outcomes
        try:
            dead = self.presence.dead()
        except redis.ResponseError as exc:
            if not refused(exc):
                raise
            log.error(
                "looks at the workers' connections are off: Redis refused %s; a dead worker's forks wait for their "
                "leases to expire. Allow CLIENT LIST for forkq's Redis user (ACL +client|list), or set "
                "FORKQ_PRESENCE_CHECK_S=0 to silence this",
                exc,
            )
            self.presence = None
            return outcomes
        grace_ms = self._requeue_grace_ms()
        for token, cid in dead:
            forks = self.leases.owned_by(token)
            log.warning("worker %s: its Redis connection is gone; reviving its %d forks", token, len(forks))
            for fork_id, owner in forks:
                outcome = self.leases.revive(
                    fork_id, max_attempts=self.max_attempts, grace_ms=grace_ms, dead_owner=owner
                )
                self._settle(fork_id, outcome, outcomes, "worker connection gone")
            if self.release_holds is not None:
                freed = self.release_holds(token)
                if freed:
                    log.warning("worker %s: freed its %d model admission slots", token, freed)
            self.presence.forget(token, cid)
        return outcomes

    def _requeue_grace_ms(self) -> int:
        # another sweeper re-enqueues a revived fork only if this one failed to within the grace
        return int(max(1.0, 5 * self.interval_s) * 1000)

    def _settle(self, fork_id: str, outcome: RevivalReply, outcomes: Counter[str], why: str) -> None:
        """Count a revive check's outcome, and enqueue or report what it revived or failed."""
        outcomes[outcome.value] += 1
        if self.metrics is not None:
            self.metrics.swept(outcome.value)
        if outcome in (Revival.REVIVE, Revival.REQUEUE):
            state = self.store.state(fork_id)
            self.enqueue(fork_id, state.digest, state.attempt + 1)  # sends the job, then confirms it
            log.info("fork %s: %s, %s (attempt %d)", fork_id, why, outcome, state.attempt + 1)
        elif outcome is Status.FAILED:
            log.warning("fork %s: failed: %s", fork_id, worker_lost_error(self.max_attempts))
            if self.failed is not None:  # its last run's row gets a final state (Flower): no run follows
                self.failed(fork_id, self.store.state(fork_id).attempt)

    def run(self, stop: threading.Event, on_pass: Callable[[Counter[str]], None] | None = None) -> None:
        """Look at the workers' connections every `presence_s` and sweep expired leases every `interval_s`, until
        `stop` is set (each pass's outcomes to `on_pass`); Redis or broker errors are logged and retried.

        The two are tried apart: a look that fails (whatever the cause) never keeps expired leases from
        being swept.
        """
        tick = min(self.interval_s, self.presence_s) if self.presence is not None and self.presence_s > 0 else None
        next_sweep, failing = 0.0, False
        while not stop.is_set():
            outcomes: Counter[str] = Counter()
            errors = self._try(self.sweep_dead, outcomes)
            swept = time.monotonic() >= next_sweep
            if swept:
                next_sweep = time.monotonic() + self.interval_s
                lease_errors = self._try(self.sweep_once, outcomes)
                if lease_errors:
                    next_sweep = 0.0  # retried at the next tick
                errors += lease_errors
            if on_pass is not None and ((swept and not errors) or outcomes):
                on_pass(outcomes)
            if errors:
                # once per outage at warning level: the looks at the workers' connections retry 10 times a second
                log.log(logging.INFO if failing else logging.WARNING, "sweep failed, retrying: %s", errors[0])
            elif failing:
                log.warning("sweeping again: Redis and the broker answer")
            failing = bool(errors)
            stop.wait(tick if tick is not None else self.interval_s)

    @staticmethod
    def _try(part: Callable[[], Counter[str]], outcomes: Counter[str]) -> list[Exception]:
        try:
            outcomes += part()
        except Exception as exc:  # Redis or broker down: the next pass retries, the sweeper lives on
            return [exc]
        return []

"""The sweeper: finds forks whose lease expired and revives them (or fails them after max attempts).

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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from workers.service.metrics import Metrics
from workers.store.forks import ForkStore
from workers.store.lease import Leases
from workers.store.lease_scripts import worker_lost_error

log = logging.getLogger("forkq.sweeper")

# fork id, digest, attempt: sends the job, then confirms it enqueued (`workers.store.queue.enqueue_again`)
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

    def sweep_once(self) -> Counter[str]:
        """One pass over expired leases; counts outcomes (`revive`, `requeue`, `failed`, `alive`, ...).

        Raises:
            the broker's error when an enqueue fails (the fork stays in the index for a later pass).
        """
        outcomes: Counter[str] = Counter()
        # another sweeper re-enqueues a revived fork only if this one failed to within the grace
        grace_ms = int(max(1.0, 5 * self.interval_s) * 1000)
        outage = self.leases.in_outage_grace(gap_ms=int(outage_gap_s(self.interval_s) * 1000))
        lapse_grace_ms = self.leases.lapse_grace_ms if outage else 0
        for fork_id in self.leases.expired():
            outcome = self.leases.revive(
                fork_id, max_attempts=self.max_attempts, grace_ms=grace_ms, lapse_grace_ms=lapse_grace_ms
            )
            outcomes[outcome] += 1
            if self.metrics is not None:
                self.metrics.swept(outcome)
            if outcome in ("revive", "requeue"):
                state = self.store.state(fork_id)
                self.enqueue(fork_id, state.digest, state.attempt + 1)  # sends the job, then confirms it
                log.info("fork %s: lease expired, %s (attempt %d)", fork_id, outcome, state.attempt + 1)
            elif outcome == "failed":
                log.warning("fork %s: failed: %s", fork_id, worker_lost_error(self.max_attempts))
                if self.failed is not None:  # its last run's row gets a final state (Flower): no run follows
                    self.failed(fork_id, self.store.state(fork_id).attempt)
        return outcomes

    def run(self, stop: threading.Event, on_pass: Callable[[Counter[str]], None] | None = None) -> None:
        """Sweep every `interval_s` until `stop` is set (each pass's outcomes to `on_pass`); Redis or broker
        errors are logged and retried."""
        while not stop.is_set():
            try:
                outcomes = self.sweep_once()
                if on_pass is not None:
                    on_pass(outcomes)
            except Exception as exc:  # Redis or broker down: the next pass retries, the sweeper lives on
                log.warning("sweep failed, retrying in %.1f s: %s", self.interval_s, exc)
            stop.wait(self.interval_s)

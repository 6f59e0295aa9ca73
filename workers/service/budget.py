"""The worker's budget guard: a fork stops before a model call once its `max_tokens` or its session's budget is
used up, and is parked `paused` (reason `budget_reached`), its journal and workspace kept.

Before each model call the guard compares the fork's used tokens (its journal's fold, then each response's usage
as it comes: `workers.records.budget`) with the launch's `max_tokens`, and reads its session's budget. After each
response it charges the session, once per fork and step (`workers.store.budget`). Forks that run at once may each
make one call past a session's limit: the check comes before a call, the charge after it.

In a worker neither costs a round trip of its own: the read rides on the checkpoint just before the call, the
charge on the journal append just after it (`workers.store.pipelined`). Only the first call of a first run, whose
checkpoint the claim made, reads the budget on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker_config.settings import Settings
from workers.loop.budget import BudgetReached
from workers.providers import ModelRequest, TokenUsage
from workers.records.budget import BudgetKind, cached_weight, journal_tokens, usage_tokens
from workers.records.fork import BootstrapRecord
from workers.records.journal import JournalEntry
from workers.records.parked import PauseReason
from workers.store.budget import BudgetStore, SessionBudget, budget_of
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases, forever, ride_out
from workers.store.pipelined import Rider, Rides

log = logging.getLogger("forkq.worker")


@dataclass
class BudgetGuard:
    """A fork's `CallGuard` for its token budgets: its own `max_tokens`, and its session's."""

    store: BudgetStore
    fork_id: str
    session: str
    max_tokens: int | None
    weight: float  # of a cached input token of the fork's model
    used: int  # the fork's tokens so far: its journal's, then each response's as it comes
    # the claim's `LeaseClock.deadline`: a read or charge rides out a Redis outage until then, as the run's writes do
    until: Callable[[], float] = forever
    rides: Rides | None = None  # the fork's writes, which take the read and the charge along (None: own round trips)
    fresh: SessionBudget | None = None  # the session's budget as the checkpoint before this call read it

    def __post_init__(self) -> None:
        if self.rides is not None:
            self.rides.ahead(self._read_ahead)

    def _read_ahead(self) -> Rider:
        def settle(reply: Any) -> None:
            self.fresh = budget_of(self.session, reply)

        return Rider(self.store.read_call(self.session), settle, failed=lambda exc: None)  # `enter` reads again

    def enter(self, request: ModelRequest) -> float:
        """Stop the fork (`BudgetReached`) when a budget is used up; never waits."""
        if self.max_tokens is not None and self.used >= self.max_tokens:
            raise self._reached(BudgetKind.FORK, self.used, self.max_tokens)
        budget, self.fresh = self.fresh, None
        if budget is None:
            read = lambda: self.store.read(self.session)  # noqa: E731
            budget = ride_out(read, until=self.until, what="reading its budget", fork_id=self.fork_id)
        if budget.tokens is not None and budget.reached:
            raise self._reached(BudgetKind.SESSION, budget.used, budget.tokens)
        return 0.0

    def leave(self, request: ModelRequest, usage: TokenUsage | None) -> None:
        """Count the response's tokens, and charge them to the session once (by fork and step)."""
        if usage is None:
            return
        tokens = usage_tokens(usage, self.weight)
        self.used += tokens
        charge = lambda: self.store.charge(self.session, self.fork_id, request.step, tokens)  # noqa: E731
        if self.rides is None:
            ride_out(charge, until=self.until, what="charging its budget", fork_id=self.fork_id)  # once per step
            return

        def failed(exc: Exception) -> None:
            step, session = request.step, self.session
            log.warning("fork %s: step %d not charged to session %s (%s)", self.fork_id, step, session, exc)

        call = self.store.charge_call(self.session, self.fork_id, request.step, tokens)
        self.rides.ride(Rider(call, failed=failed))

    def _reached(self, kind: BudgetKind, used: int, limit: int) -> BudgetReached:
        return BudgetReached(kind, fork_id=self.fork_id, session=self.session, used=used, limit=limit)


def budget_guard(
    settings: Settings,
    budgets: BudgetStore,
    record: BootstrapRecord,
    entries: list[JournalEntry],
    until: Callable[[], float] = forever,
    *,
    rides: Rides | None = None,
) -> BudgetGuard:
    """The budget guard of a run of `record` whose journal holds `entries`, riding out Redis until `until()`, its
    reads and charges riding on the run's writes (`rides`)."""
    weight = cached_weight(settings, record.model)
    return BudgetGuard(
        store=budgets,
        fork_id=record.fork_id,
        session=record.parent_session,
        max_tokens=record.options.max_tokens,
        weight=weight,
        used=journal_tokens(entries, weight),
        until=until,
        rides=rides,
    )


@dataclass(frozen=True)
class BudgetPark:
    """What parks a fork at a budget: the fenced pause, the resume, the budgets, and the worker's requeue."""

    leases: Leases
    store: ForkStore
    budgets: BudgetStore
    requeue: Callable[[str, str, int], None] | None

    def park(self, claim: Claim, digest: str, stop: BudgetReached) -> None:
        """Park the fork `paused` (`budget_reached`), in its session's budget-paused forks when that budget
        stopped it.

        A raise of the budget between the check and this pause finds the fork in no set: so the budget is read
        again after the pause, and a fork no longer over it is resumed here (the raise may resume it too: one of
        the two takes it out of `paused`, and only that one enqueues it).
        """
        session = stop.session if stop.kind is BudgetKind.SESSION else None
        self.leases.pause(claim, PauseReason.BUDGET_REACHED.value, detail=stop.detail(), budget_session=session)
        log.info("fork %s: paused, %s", claim.fork_id, stop.detail())
        if session is None:
            return
        read = lambda: self.budgets.read(session)  # noqa: E731
        if ride_out(read, until=claim.clock.deadline, what="reading its budget", fork_id=claim.fork_id).reached:
            return
        if self.store.resume(claim.fork_id) and self.requeue is not None:
            self.requeue(claim.fork_id, digest, claim.attempt + 1)
        self.budgets.resumed(session, claim.fork_id)

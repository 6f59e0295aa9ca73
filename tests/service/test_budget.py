"""The worker's budget guard against a real (private) Redis: it stops a fork before a model call at its max_tokens
or its session's budget, charges each response once, and a pause that a raise overtook resumes at once."""

from __future__ import annotations

import pytest
import redis

from tests.conftest import TEST_NAMESPACE, put_queued_fork
from workers.base.keys import Keys
from workers.loop.budget import BudgetReached
from workers.loop.child import StopReason
from workers.providers import ModelRequest, TokenUsage
from workers.records.budget import BudgetKind
from workers.records.fork import Status
from workers.service.budget import BudgetGuard, BudgetPark
from workers.service.outcome import STOPPED, Outcome
from workers.store.budget import BudgetStore
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases

KEYS = Keys(TEST_NAMESPACE)
SESSION = "s-unit"  # put_queued_fork's session
USAGE = TokenUsage(input_tokens=80, output_tokens=20)


def request(step: int) -> ModelRequest:
    return ModelRequest(fork_id="f-guard", step=step, model=None, system_instruction=None, tools=[], messages=[])


def guard(client: redis.Redis, *, max_tokens: int | None = None, used: int = 0) -> BudgetGuard:
    store = BudgetStore(client, KEYS, ttl_s=3600)
    return BudgetGuard(store, "f-guard", SESSION, max_tokens, weight=1.0, used=used)


def stores(client: redis.Redis) -> tuple[ForkStore, BudgetStore, Leases]:
    """The fork, budget and lease stores a budget pause writes through."""
    forks, budgets = ForkStore(client, KEYS, ttl_s=3600), BudgetStore(client, KEYS, ttl_s=3600)
    return forks, budgets, Leases(client, KEYS, ttl_ms=10_000, retention_s=3600)


def running(forks: ForkStore, leases: Leases, fork_id: str) -> tuple[str, Claim]:
    """A queued fork `fork_id` claimed by one worker: its digest and the claim."""
    digest = put_queued_fork(forks, fork_id)
    claim = leases.claim(fork_id, "worker-a")
    assert isinstance(claim, Claim)
    return digest, claim


def test_a_fork_under_its_budgets_goes_on_without_waiting_and_each_response_is_charged_once(
    redis_client: redis.Redis,
) -> None:
    budget = guard(redis_client, max_tokens=1_000)

    assert budget.enter(request(0)) == 0.0
    budget.leave(request(0), USAGE)
    budget.leave(request(1), None)  # a failed call costs nothing
    second = guard(redis_client, max_tokens=1_000, used=100)  # a revived run: its journal holds step 0
    second.leave(request(0), USAGE)  # a repeat of a charged step

    assert budget.used == 100
    assert budget.store.read(SESSION).used == 100


def test_a_fork_at_its_max_tokens_is_stopped_before_the_call_naming_that_budget(redis_client: redis.Redis) -> None:
    budget = guard(redis_client, max_tokens=150, used=100)
    budget.enter(request(1))
    budget.leave(request(1), USAGE)

    with pytest.raises(BudgetReached) as stop:
        budget.enter(request(2))

    assert (stop.value.reason, stop.value.kind, stop.value.used, stop.value.limit) == (
        StopReason.BUDGET_REACHED,
        BudgetKind.FORK,
        200,
        150,
    )
    assert "max_tokens is reached: used 200 of 150 tokens" in stop.value.detail()
    assert STOPPED[StopReason.BUDGET_REACHED] is Outcome.PAUSED


def test_a_fork_whose_session_used_its_budget_is_stopped_naming_the_command_that_raises_it(
    redis_client: redis.Redis,
) -> None:
    budget = guard(redis_client)
    budget.store.set(SESSION, 50)
    budget.store.charge(SESSION, "f-other", 0, 60)

    with pytest.raises(BudgetReached) as stop:
        budget.enter(request(0))

    assert (stop.value.kind, stop.value.used, stop.value.limit) == (BudgetKind.SESSION, 60, 50)
    assert f"forkq budget --session {SESSION} --tokens N" in stop.value.detail()


def test_a_fork_paused_at_its_session_budget_after_a_raise_resumes_at_once(redis_client: redis.Redis) -> None:
    # Given a running fork stopped at its session's budget
    forks, budgets, leases = stores(redis_client)
    digest, claim = running(forks, leases, "f-raced")
    stop = BudgetReached(BudgetKind.SESSION, fork_id="f-raced", session=SESSION, used=100, limit=100)
    requeued: list[tuple[str, str, int]] = []

    # When the budget is raised after the check, before the pause (the raise found no fork in the set)
    assert budgets.set(SESSION, 1_000)[1] == []
    BudgetPark(leases, forks, budgets, lambda *job: requeued.append(job)).park(claim, digest, stop)

    # Then the pause sees the raise: the fork is queued again, its job sent, and it is in no set
    assert forks.state("f-raced").status is Status.QUEUED
    assert requeued == [("f-raced", digest, claim.attempt + 1)]
    assert budgets.paused(SESSION) == []


def test_a_fork_paused_at_its_own_max_tokens_joins_no_sessions_set(redis_client: redis.Redis) -> None:
    forks, budgets, leases = stores(redis_client)
    digest, claim = running(forks, leases, "f-own")
    stop = BudgetReached(BudgetKind.FORK, fork_id="f-own", session=SESSION, used=10, limit=10)

    BudgetPark(leases, forks, budgets, None).park(claim, digest, stop)

    assert forks.state("f-own").status is Status.PAUSED
    assert budgets.paused(SESSION) == []

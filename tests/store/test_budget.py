"""Session budgets in a real (private) Redis: a charge counts once per fork and step, a set answers the forks the
budget paused, and a budget pause joins the session's set with its pause, and leaves it with the resume."""

from __future__ import annotations

import redis

from tests.conftest import TEST_NAMESPACE, put_queued_fork
from workers.base.keys import Keys
from workers.records.fork import Status
from workers.records.parked import ResumeWait
from workers.store.budget import BudgetStore, SessionBudget
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases

KEYS = Keys(TEST_NAMESPACE)
SESSION = "s-budget"


def budgets(client: redis.Redis) -> BudgetStore:
    return BudgetStore(client, KEYS, ttl_s=3600)


def test_a_session_without_a_budget_has_no_limit_and_counts_what_its_forks_used(redis_client: redis.Redis) -> None:
    store = budgets(redis_client)

    assert store.read(SESSION) == SessionBudget.of(SESSION, None, 0)
    assert store.charge(SESSION, "f-a", 0, 120) == SessionBudget(session=SESSION, tokens=None, used=120, left=None)
    assert not store.read(SESSION).reached


def test_a_response_is_charged_once_however_often_its_fork_and_step_are_charged_again(
    redis_client: redis.Redis,
) -> None:
    store = budgets(redis_client)
    store.set(SESSION, 1_000)

    store.charge(SESSION, "f-a", 0, 100)
    store.charge(SESSION, "f-a", 0, 100)  # a retried write
    store.charge(SESSION, "f-a", 1, 100)
    store.charge(SESSION, "f-a", 0, 100)  # a revived run's repeat of an earlier step
    store.charge(SESSION, "f-b", 0, 50)  # another fork's own step 0

    assert store.read(SESSION) == SessionBudget.of(SESSION, 1_000, 250)
    assert store.read(SESSION).left == 750
    # the keys live under the session's hash tag, for the retention
    assert 0 < redis_client.ttl(KEYS.session_budget(SESSION)) <= 3600
    assert 0 < redis_client.ttl(KEYS.session_budget_charged(SESSION)) <= 3600


def test_a_budget_used_up_is_reached_and_left_never_goes_below_zero(redis_client: redis.Redis) -> None:
    store = budgets(redis_client)
    store.set(SESSION, 100)

    after = store.charge(SESSION, "f-a", 0, 130)

    assert (after.reached, after.used, after.left) == (True, 130, 0)


def test_a_budget_paused_fork_joins_the_sessions_set_with_its_pause_and_a_raise_answers_it(
    redis_client: redis.Redis,
) -> None:
    # Given a running fork, and a session budget it used up
    forks, store = ForkStore(redis_client, KEYS, ttl_s=3600), budgets(redis_client)
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    put_queued_fork(forks, "f-paused")
    claim = leases.claim("f-paused", "worker-a")
    assert isinstance(claim, Claim)
    store.set(SESSION, 100)
    store.charge(SESSION, "f-paused", 0, 100)

    # When the worker pauses it at that budget
    leases.pause(claim, "budget_reached", detail="the budget of session s-budget is reached", budget_session=SESSION)

    # Then its state says so (the word, and the detail apart), and the session's set holds it
    state = forks.state("f-paused")
    assert state.status is Status.PAUSED
    assert state.waiting_for == ResumeWait(reason="budget_reached", detail="the budget of session s-budget is reached")
    assert store.paused(SESSION) == ["f-paused"]
    # a set that leaves the budget used up answers no fork; one above what was used answers it
    assert store.set(SESSION, 100) == (SessionBudget.of(SESSION, 100, 100), [])
    assert store.set(SESSION, 500) == (SessionBudget.of(SESSION, 500, 100), ["f-paused"])
    # and the resume clears the detail with the wait
    assert forks.resume("f-paused")
    store.resumed(SESSION, "f-paused")
    assert store.paused(SESSION) == []
    assert "waiting_detail" not in {k.decode() for k in redis_client.hkeys(KEYS.state("f-paused"))}


def test_a_pause_that_is_not_a_budgets_keeps_its_sentence_and_no_detail(redis_client: redis.Redis) -> None:
    forks = ForkStore(redis_client, KEYS, ttl_s=3600)
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    put_queued_fork(forks, "f-tool")
    claim = leases.claim("f-tool", "worker-a")
    assert isinstance(claim, Claim)

    leases.pause(claim, "declared tool(s) count not available on this worker")

    assert forks.state("f-tool").waiting_for == ResumeWait(reason="declared tool(s) count not available on this worker")
    assert budgets(redis_client).paused(SESSION) == []

"""Token budgets with real processes: forks pause at a budget before their next model call, and go on when it is
raised, with no side effect twice, across a revival too.

The `forkq worker` subprocesses, sweepers and counted side effects are those of the revival tests
(tests/e2e/test_revival.py): `count_effect` appends its call's idempotency key to a ledger file, once per run, so a
line seen twice is a side effect run twice. Every scripted model response reports 100 tokens (80 in, 20 out).
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.test_revival import (  # noqa: F401  (fixtures)
    REVIVAL_S,
    Cluster,
    call,
    cluster,
    effect_key,
    make_cluster,
    step,
    testtools_dir,
    text,
)
from workers.errors import BudgetExhausted, ForkNotFound, ForkParked
from workers.records.fork import Status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

USAGE = {"input_tokens": 80, "output_tokens": 20}  # 100 tokens a response
SESSION_S = 30.0


def billed(scripted: dict[str, Any]) -> dict[str, Any]:
    """A scripted step that reports 100 tokens."""
    return {**scripted, "usage": USAGE}


def paused_at_budget(forks: Cluster, fid: str) -> bool:
    """True once the fork is parked paused with the reason `budget_reached` (False before it is launched)."""
    try:
        state = forks.store.state(fid)
    except ForkNotFound:
        return False
    wait = state.waiting_for
    return state.status is Status.PAUSED and wait is not None and getattr(wait, "reason", None) == "budget_reached"


def model_entries(forks: Cluster, fid: str) -> int:
    return sum(1 for entry in forks.leases.journal(fid) if entry.kind == "model")


def test_a_fork_stops_at_its_max_tokens_before_its_next_model_call_and_parks_paused_budget_reached(
    cluster: Cluster,  # noqa: F811
    forkq_cli: Callable[..., tuple[int, str, str]],
) -> None:
    # Given a fork with max_tokens 200 whose model makes two tool calls, then answers
    cluster.script(billed(step(0.0, call("e1"))), billed(step(0.0, call("e2"))), billed(step(0.0, text("done"))))
    cluster.start("w1")
    fid = cluster.launch(max_tokens=200)

    # When it has used 200 tokens in two responses
    cluster.wait_for(lambda: paused_at_budget(cluster, fid), SESSION_S, "the fork to pause at its budget", fid)

    # Then it made no third model call: it is parked paused, reason `budget_reached`, with the numbers apart
    code, out, _ = forkq_cli("status", fid, "--json")
    waiting = json.loads(out)["waiting_for"]
    assert (code, json.loads(out)["status"], waiting["kind"], waiting["reason"]) == (
        0,
        "paused",
        "resume",
        "budget_reached",
    )
    assert "its own max_tokens is reached: used 200 of 200 tokens" in waiting["detail"]
    assert [e.data.step for e in cluster.of_type(fid, "model_call")] == [1, 2, 3]
    assert model_entries(cluster, fid) == 2
    # its journal is kept, each side effect ran once, and `result --wait` exits 3 as for any parked fork
    assert cluster.assert_effects_at_most_once(fid) == Counter(
        {effect_key(fid, 0, "e1"): 1, effect_key(fid, 1, "e2"): 1}
    )
    code, _, err = forkq_cli("result", fid, "--wait", "--timeout", "5")
    assert code == 3 and "budget_reached" in err and "max_tokens" in err, err
    with pytest.raises(ForkParked):
        cluster.client.wait(fid, timeout=5)
    # inspect shows the fork's max_tokens, used and left, and its session's budget (none set: counted all the same)
    code, out, _ = forkq_cli("inspect", fid)
    assert "max_tokens: used 200 of 200 tokens, 0 left" in out
    assert f"session budget ({cluster.parent['session_id']}): no limit, used 200 tokens" in out
    # and a resume is refused, since nothing raises a launch's max_tokens: the fork stays as it is
    code, _, err = forkq_cli("resume", fid)
    assert code == 1 and "stays paused" in err and "cannot be raised" in err, err
    with pytest.raises(BudgetExhausted) as refused:
        cluster.client.resume(fid)
    assert refused.value.budget == "max_tokens"
    assert cluster.store.state(fid).status is Status.PAUSED


def test_a_session_budget_pauses_two_forks_and_raising_it_resumes_both_to_their_end_with_no_side_effect_twice(
    cluster: Cluster,  # noqa: F811
    forkq_cli: Callable[..., tuple[int, str, str]],
) -> None:
    # Given a session budget of 250 tokens, and two forks of that session that each need three responses
    cluster.script(billed(step(0.1, call("e1"))), billed(step(0.1, call("e2"))), billed(step(0.0, text("done"))))
    session = cluster.parent["session_id"]
    code, out, _ = forkq_cli("budget", "--session", session, "--tokens", "250", "--json")
    assert (code, json.loads(out)) == (0, {"session": session, "tokens": 250, "used": 0, "left": 250, "resumed": []})
    cluster.start("w1", concurrency=4)
    forks = [cluster.launch(), cluster.launch()]

    # When both have run until the budget is used up
    for fid in forks:
        cluster.wait_for(lambda f=fid: paused_at_budget(cluster, f), SESSION_S, "the fork to pause", fid)

    # Then both are paused, each before a model call, and the session used its budget (each fork at most one call
    # past it: the check comes before a call, the charge after it)
    budget = cluster.client.budget(session)
    assert 250 <= budget.used <= 250 + 100 * len(forks) and budget.left == 0, budget
    assert budget.used == sum(100 * model_entries(cluster, fid) for fid in forks)
    for fid in forks:
        assert "the budget of session" in (cluster.store.state(fid).waiting_for.detail or "")  # type: ignore[union-attr]
    code, out, _ = forkq_cli("budget", "--session", session)
    assert out == f"session {session}: used {budget.used:,} of 250 tokens, 0 left\n"

    # When the budget is raised with `forkq budget`
    code, out, _ = forkq_cli("budget", "--session", session, "--tokens", "10000", "--json")

    # Then it resumed both, and both finish with identical inputs, each side effect once
    assert code == 0 and sorted(json.loads(out)["resumed"]) == sorted(forks), out
    for fid in forks:
        assert cluster.result(fid, timeout=SESSION_S).output == "done"
        cluster.assert_ended_once(fid)
        assert cluster.assert_effects_at_most_once(fid) == Counter(
            {effect_key(fid, 0, "e1"): 1, effect_key(fid, 1, "e2"): 1}
        )
        cluster.assert_requests_replayed_exactly(fid)
    # and every response was charged once: 3 each
    assert cluster.client.budget(session).used == 600
    assert cluster.client.budget(session).resumed == []


def test_a_nested_subagent_shares_its_callers_session_budget_pauses_at_it_and_resumes_when_it_is_raised(
    make_cluster: Callable[..., Cluster],  # noqa: F811
    redis_url: str,
) -> None:
    # Given workers allowing one nesting level, a session budget of 150 tokens, and a script whose first response
    # calls the Agent tool (the nested subagent's own Agent call is refused at the depth limit)
    cluster = make_cluster(redis_url, FORKQ_MAX_SUBAGENT_DEPTH="2")  # noqa: F811
    nested = {"description": "count", "prompt": "Count.", "subagent_type": "general-purpose"}
    agent_call = {"functionCall": {"id": "a1", "name": "Agent", "args": nested}}
    cluster.script(billed(step(0.0, agent_call)), billed(step(0.0, call("e1"))), billed(step(0.0, text("done"))))
    session = cluster.parent["session_id"]
    cluster.client.set_budget(session, tokens=150)
    cluster.start("w1", concurrency=4)

    # When a regular subagent of the session (a fork cannot spawn) launches a nested subagent
    fid = cluster.launch({"description": "delegate", "prompt": "Delegate.", "subagent_type": "general-purpose"})
    child = f"{fid}.0.0"
    cluster.wait_for(lambda: paused_at_budget(cluster, child), SESSION_S, "the nested subagent to pause", child)

    # Then the subagent, charged to its caller's session, paused before its second model call
    assert cluster.store.get_record(child, cluster.store.state(child).digest).parent_session == session
    assert model_entries(cluster, child) == 1
    assert cluster.client.budget(session).used == 200
    assert cluster.store.state(fid).status is Status.RUNNING  # its caller waits for it (its next call would pause)

    # When the budget is raised from Python
    raised = cluster.client.set_budget(session, tokens=10_000)

    # Then the subagent resumes and ends, its caller gets its output and ends too, each side effect once
    assert raised.resumed == [child]
    cluster.result(fid, timeout=SESSION_S)
    cluster.assert_ended_once(fid)
    cluster.assert_ended_once(child)
    assert cluster.assert_effects_at_most_once(fid) == Counter({effect_key(fid, 1, "e1"): 1})
    assert cluster.assert_effects_at_most_once(child) == Counter({effect_key(child, 1, "e1"): 1})
    assert cluster.client.budget(session).used == 600


def test_a_budget_pause_holds_across_a_revival_and_its_usage_is_charged_once(cluster: Cluster) -> None:  # noqa: F811
    # Given a session budget of 150 tokens, two workers and a sweeper, and a fork whose second response is slow
    cluster.script(billed(step(0.2, call("e1"))), billed(step(2.5, call("e2"))), billed(step(0.0, text("done"))))
    session = cluster.parent["session_id"]
    cluster.client.set_budget(session, tokens=150)
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()

    # When the worker running it is SIGKILLed during that second model call
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=2), 10, "the second model call", fid)
    victim = cluster.proc_of(cluster.owner_pid(fid, attempt=1))
    victim.send(signal.SIGKILL)

    # Then the revived run replays the first response (not charged again), asks for the second once more, and
    # stops at the budget before the third
    cluster.wait_for(lambda: paused_at_budget(cluster, fid), REVIVAL_S + 10, "the revived fork to pause", fid)
    assert len(cluster.of_type(fid, "revived")) == 1
    assert cluster.owner_pid(fid, attempt=2) != victim.pid
    assert model_entries(cluster, fid) == 2
    assert cluster.client.budget(session).used == 200
    assert cluster.client.fork_budget(fid).used == 200

    # When the budget is raised
    assert cluster.client.set_budget(session, tokens=1_000).resumed == [fid]

    # Then it finishes from its journal, each side effect once, each response charged once
    cluster.result(fid, timeout=SESSION_S)
    cluster.assert_ended_once(fid)
    assert cluster.assert_effects_at_most_once(fid) == Counter(
        {effect_key(fid, 0, "e1"): 1, effect_key(fid, 1, "e2"): 1}
    )
    cluster.assert_requests_replayed_exactly(fid)
    assert cluster.client.budget(session).used == 300


def test_a_launch_keeps_max_tokens_in_its_record_and_one_without_it_has_no_such_option(cluster: Cluster) -> None:  # noqa: F811
    capped = cluster.launch(max_tokens=5_000)
    plain = cluster.launch()

    assert cluster.client.inspect(capped)["max_tokens"] == 5_000
    assert cluster.store.get_record(capped, cluster.store.state(capped).digest).options.max_tokens == 5_000
    plain_record = cluster.store.get_record(plain, cluster.store.state(plain).digest)
    assert "max_tokens" not in plain_record.options.model_dump()

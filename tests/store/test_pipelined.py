"""Scripts in one round trip, and riders on a fork's fenced writes, against a real (private) Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tests.conftest import TEST_NAMESPACE, put_queued_fork
from workers.base.keys import Keys
from workers.errors import LeaseLost
from workers.history.messages import Content, Part
from workers.records.journal import EntryKind, JournalEntry
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases
from workers.store.pipelined import Rider, ScriptCall, run_scripts

KEYS = Keys(TEST_NAMESPACE)
INCR = "return redis.call('INCR', KEYS[1])"  # not idempotent: a call run twice shows it


def test_after_redis_lost_its_scripts_only_the_refused_calls_run_again(redis_client: redis.Redis) -> None:
    # Given one script Redis knows and one it lost (a SCRIPT FLUSH after both were loaded)
    known, lost = redis_client.register_script(INCR), redis_client.register_script(INCR + " + 0")
    run_scripts(redis_client, [ScriptCall(known, ["k:a"], []), ScriptCall(lost, ["k:b"], [])])
    redis_client.script_flush()
    known.sha = redis_client.script_load(known.script)

    # When both run in one round trip
    replies = run_scripts(redis_client, [ScriptCall(known, ["k:a"], []), ScriptCall(lost, ["k:b"], [])])

    # Then each ran once more: the refused one was loaded and run again, the other was not repeated
    assert replies == [2, 2]
    assert redis_client.get("k:a") == b"2" and redis_client.get("k:b") == b"2"


def test_a_refused_call_is_its_own_reply_and_the_others_stand(redis_client: redis.Redis) -> None:
    broken = redis_client.register_script("return redis.call('NOSUCHCOMMAND')")
    good = redis_client.register_script(INCR)
    calls = [ScriptCall(broken, ["k:x"], []), ScriptCall(good, ["k:y"], [])]

    replies = run_scripts(redis_client, calls, raise_on_error=False)

    assert isinstance(replies[0], redis.ResponseError) and "unknown redis command" in str(replies[0]).lower()
    assert replies[1] == 1
    with pytest.raises(redis.ResponseError):
        run_scripts(redis_client, calls)


def running(redis_client: redis.Redis, fork_id: str) -> tuple[Leases, Claim]:
    put_queued_fork(ForkStore(redis_client, KEYS, ttl_s=3600), fork_id)
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    claim = leases.claim(fork_id, "worker-a")
    assert isinstance(claim, Claim)
    return leases, claim


def rider(redis_client: redis.Redis, key: str, answers: list[Any]) -> Rider:
    return Rider(ScriptCall(redis_client.register_script(INCR), [key], []), answers.append, answers.append)


def entry(seq: int) -> JournalEntry:
    return JournalEntry(seq=seq, step=0, kind=EntryKind.MESSAGE, content=Content(role="user", parts=[Part(text="hi")]))


def test_riders_go_with_an_append_and_are_handed_their_replies(redis_client: redis.Redis) -> None:
    leases, claim = running(redis_client, "f-riders")
    answers: list[Any] = []
    seq = len(leases.journal("f-riders"))

    leases.append(
        claim, entry(seq), riders=[rider(redis_client, "k:r1", answers), rider(redis_client, "k:r2", answers)]
    )

    assert answers == [1, 1]
    assert [e.seq for e in leases.journal("f-riders")][-1] == seq


def test_a_refused_write_still_runs_its_riders_and_then_raises(redis_client: redis.Redis) -> None:
    # Given a claim made stale by a newer one (the fork was revived behind it)
    leases, claim = running(redis_client, "f-stale")
    redis_client.hincrby(KEYS.state("f-stale"), "epoch", 1)
    answers: list[Any] = []

    # When it appends with a rider, Then the append is refused, and the rider ran all the same (a call's release
    # or charge does not depend on the fork still being this worker's)
    with pytest.raises(LeaseLost):
        leases.append(claim, entry(99), riders=[rider(redis_client, "k:stale", answers)])
    assert answers == [1]
    assert redis_client.get("k:stale") == b"1"


def test_riders_no_write_took_are_sent_on_their_own_and_a_failure_reaches_each(redis_client: redis.Redis) -> None:
    leases, claim = running(redis_client, "f-alone")
    answers: list[Any] = []
    leases.send_riders(claim, [rider(redis_client, "k:alone", answers)])
    assert answers == [1]

    claim.clock.until = float("-inf")  # the lease certainly lapsed: no retry through the outage
    unreachable = Leases(redis.Redis(port=1, socket_connect_timeout=0.2), KEYS, ttl_ms=10_000, retention_s=3600)
    unreachable.send_riders(claim, [rider(redis_client, "k:never", answers)])
    assert isinstance(answers[1], LeaseLost) and "Redis did not answer" in str(answers[1])
    assert redis_client.get("k:never") is None


def test_a_rider_whose_handler_fails_leaves_the_others_answered_and_the_write_written(
    redis_client: redis.Redis,
) -> None:
    leases, claim = running(redis_client, "f-handler")
    answers: list[Any] = []

    def broken(reply: Any) -> None:
        raise RuntimeError("a bug in a rider's handler")

    call = ScriptCall(redis_client.register_script(INCR), ["k:broken"], [])
    seq = len(leases.journal("f-handler"))
    leases.append(claim, entry(seq), riders=[Rider(call, broken), rider(redis_client, "k:after", answers)])

    assert answers == [1]
    assert [e.seq for e in leases.journal("f-handler")][-1] == seq

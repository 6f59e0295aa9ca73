"""Leases, fencing epochs and fenced writes against a real (private) Redis, without worker processes.

Worker death is simulated deterministically: the lease is made to expire (a short TTL, polled until
Redis drops the key) or the epoch is bumped, and every fenced write must then fail closed.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Callable
from typing import cast

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.conftest import TEST_NAMESPACE, put_queued_fork
from tests.live import stop_redis, wait_until
from workers.base.keys import Keys
from workers.demo.redis_server import RedisServer
from workers.errors import LeaseLost, RecordDecodeError
from workers.records.events import ModelCallData, ModelCallEvent, StepData, StepEvent
from workers.records.fork import ForkResult, Status
from workers.records.journal import JournalEntry
from workers.records.parked import ParkedCall
from workers.store import lease_scripts as lua
from workers.store.claims import FirstWrite, Refusal, RefusalReason
from workers.store.forks import ForkStore
from workers.store.lease import LAPSE_MARGIN_S, RENEW_BATCH, Claim, LeaseKeeper, Leases
from workers.store.presence import owner_token, presence_token

KEYS = Keys(TEST_NAMESPACE)
SHORT_TTL_MS = 150


def make_leases(client: redis.Redis, ttl_ms: int = 10_000) -> Leases:
    return Leases(client, KEYS, ttl_ms=ttl_ms, retention_s=3600)


def model_entry(seq: int, step: int = 0, text: str = "thinking") -> JournalEntry:
    return JournalEntry(seq=seq, step=step, kind="model", content={"role": "model", "parts": [{"text": text}]})


def claimed(leases: Leases, fid: str, owner: str = "worker-a") -> Claim:
    claim = leases.claim(fid, owner)
    assert isinstance(claim, Claim), claim
    return claim


def expire(client: redis.Redis, fid: str) -> None:
    """Wait until Redis itself has dropped the fork's (short) lease."""
    wait_until(lambda: not client.exists(KEYS.lease(fid)), what=f"the lease of {fid} to expire")


def event_types(store: ForkStore, fid: str) -> list[str]:
    return [e.type for e in store.events(fid)]


def state_field(client: redis.Redis, fid: str, name: str) -> str | None:
    value = client.hget(KEYS.state(fid), name)
    return None if value is None else value.decode()


def model_call(step: int, digest: str = "d") -> ModelCallEvent:
    return ModelCallEvent(data=ModelCallData(step=step, request_digest=digest))


def step_event(step: int) -> StepEvent:
    return StepEvent(data=StepData(step=step, tool_calls=[]))


def result_of(fid: str, status: Status = Status.SUCCEEDED) -> ForkResult:
    return ForkResult(fork_id=fid, status=status, output="done")


# ── claim ─────────────────────────────────────────────────────────────────────────────────────


def test_a_claim_reply_of_an_unknown_word_is_a_decode_error_naming_the_fork_the_word_and_the_expected_ones() -> None:
    # Given the words a claim script answers, and one it never does
    assert Refusal.from_reply("leased", fork_id="f-1") == Refusal(RefusalReason.LEASED)
    assert Refusal.from_reply("paused", fork_id="f-1") == Refusal(RefusalReason.NOT_QUEUED, Status.PAUSED)

    # Then the unknown one is refused as a record it cannot read, not a bare ValueError
    with pytest.raises(
        RecordDecodeError,
        match=r"fork f-1: the claim answered 'evicted', expected one of missing, "
        r"forged, leased, running, .*awaiting_approval",
    ) as info:
        Refusal.from_reply("evicted", fork_id="f-1")
    assert info.value.fork_id == "f-1"
    with pytest.raises(RecordDecodeError, match="'queued'"):  # a queued fork is claimed, or `leased`
        Refusal.from_reply("queued", fork_id="f-1")


def test_claim_sets_the_lease_and_increments_epoch_and_attempt(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=5000)

    claim = claimed(leases, fid, "worker-a")

    assert (claim.epoch, claim.attempt, claim.owner) == (1, 1, "worker-a")
    assert redis_client.get(KEYS.lease(fid)) == b"worker-a"
    assert 4000 < redis_client.pttl(KEYS.lease(fid)) <= 5000
    assert (state_field(redis_client, fid, "status"), state_field(redis_client, fid, "owner")) == (
        "running",
        "worker-a",
    )
    # the sweeper's deadline is Redis time + TTL, not the worker's clock
    seconds, micros = redis_client.time()
    now_ms = seconds * 1000 + micros // 1000
    deadline = redis_client.zscore(KEYS.running, fid)
    assert deadline is not None and now_ms + 4000 < deadline <= now_ms + 5000
    started = [e for e in fork_store.events(fid) if e.type == "started"]
    assert [e.wire_data() for e in started] == [{"owner": "worker-a", "attempt": 1, "epoch": 1}]


def test_a_fork_that_is_not_queued_cannot_be_claimed(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    leases = make_leases(redis_client)
    running, _ = make_queued_fork()
    claimed(leases, running, "worker-a")
    finished, _ = make_queued_fork()
    leases.finish(claimed(leases, finished), result_of(finished))
    cancelled, _ = make_queued_fork()
    fork_store.cancel(cancelled)

    assert leases.claim(running, "worker-b") == Refusal(RefusalReason.NOT_QUEUED, Status.RUNNING)
    assert leases.claim(finished, "worker-b") == Refusal(RefusalReason.NOT_QUEUED, Status.SUCCEEDED)
    assert leases.claim(cancelled, "worker-b") == Refusal(RefusalReason.NOT_QUEUED, Status.CANCELLED)
    assert leases.claim("f-never-launched", "worker-b") == Refusal(RefusalReason.MISSING)
    assert redis_client.get(KEYS.lease(running)) == b"worker-a"
    assert state_field(redis_client, running, "epoch") == "1"


def test_a_queued_fork_whose_lease_is_still_held_cannot_be_claimed(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    redis_client.set(KEYS.lease(fid), b"someone-else", px=10_000)

    assert make_leases(redis_client).claim(fid, "worker-b") == Refusal(RefusalReason.LEASED)
    assert state_field(redis_client, fid, "status") == "queued"
    assert state_field(redis_client, fid, "epoch") is None


# ── fenced writes ─────────────────────────────────────────────────────────────────────────────


def test_journal_appends_under_the_claim_are_kept_in_order_and_checked_by_seq(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client)
    claim = claimed(leases, fid)

    leases.append(claim, model_entry(0, text="a"))
    leases.append(claim, model_entry(1, text="b"))
    with pytest.raises(LeaseLost, match=r"refused \(seq\)"):
        leases.append(claim, model_entry(1, text="again"))  # an entry written twice
    with pytest.raises(LeaseLost, match=r"refused \(seq\)"):
        leases.append(claim, model_entry(5, text="gap"))

    assert [e.content.to_wire() for e in leases.journal(fid) if e.content] == [
        {"role": "model", "parts": [{"text": "a"}]},
        {"role": "model", "parts": [{"text": "b"}]},
    ]


def test_fenced_writes_fail_closed_after_the_epoch_is_bumped(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a claim, and then another acquisition recorded behind its back (epoch bumped)
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client)
    claim = claimed(leases, fid)
    leases.append(claim, model_entry(0))
    redis_client.hincrby(KEYS.state(fid), "epoch", 1)

    # Then every fenced write of the old claim is refused as stale, and nothing is written
    with pytest.raises(LeaseLost, match=r"refused \(stale\)"):
        leases.append(claim, model_entry(1))
    with pytest.raises(LeaseLost, match=r"refused \(stale\)"):
        leases.finish(claim, result_of(fid))
    with pytest.raises(LeaseLost, match=r"refused \(stale\)"):
        leases.release(claim, "worker shutdown")

    assert len(leases.journal(fid)) == 1
    assert fork_store.result(fid) is None
    assert state_field(redis_client, fid, "status") == "running"
    assert event_types(fork_store, fid) == ["queued", "started"]


def test_fenced_writes_fail_closed_once_the_sweeper_revived_the_fork_of_an_expired_lease(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    claim = claimed(leases, fid)
    leases.append(claim, model_entry(0))

    expire(redis_client, fid)
    assert leases.revive(fid, max_attempts=3) == "revive"  # queued again, not yet claimed: same epoch

    assert leases.emit(claim, [model_call(2)]) == "queued"
    assert leases.renew([claim]) == [0]
    with pytest.raises(LeaseLost, match=r"refused \(lost\)"):
        leases.append(claim, model_entry(1))
    with pytest.raises(LeaseLost, match=r"refused \(lost\)"):
        leases.finish(claim, result_of(fid))
    with pytest.raises(LeaseLost, match=r"refused \(lost\)"):
        leases.release(claim, "worker shutdown")
    assert len(leases.journal(fid)) == 1
    assert fork_store.result(fid) is None


def test_fenced_writes_fail_closed_after_a_cancel(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client)
    claim = claimed(leases, fid)

    assert fork_store.cancel(fid) is Status.CANCELLED

    with pytest.raises(LeaseLost, match=r"refused \(cancelled\)"):
        leases.append(claim, model_entry(0))
    with pytest.raises(LeaseLost, match=r"refused \(cancelled\)"):
        leases.finish(claim, result_of(fid))
    result = fork_store.result(fid)
    assert result is not None and result.status is Status.CANCELLED
    assert state_field(redis_client, fid, "status") == "cancelled"


def test_a_stale_worker_is_refused_after_its_fork_was_revived_and_claimed_again(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given worker A's claim expired, the fork was revived and worker B claimed it
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    old = claimed(leases, fid, "worker-a")
    leases.append(old, model_entry(0, text="from A"))
    expire(redis_client, fid)
    assert leases.revive(fid, max_attempts=3) == "revive"
    new = claimed(make_leases(redis_client), fid, "worker-b")
    assert (new.epoch, new.attempt) == (2, 2)

    # When A wakes up and writes, then B writes
    with pytest.raises(LeaseLost, match=r"refused \(stale\)"):
        leases.append(old, model_entry(1, text="from A, late"))
    with pytest.raises(LeaseLost, match=r"refused \(stale\)"):
        leases.finish(old, ForkResult(fork_id=fid, status=Status.SUCCEEDED, output="A's answer"))
    leases.append(new, model_entry(1, text="from B"))
    leases.finish(new, ForkResult(fork_id=fid, status=Status.SUCCEEDED, output="B's answer"))

    # Then only B's writes are there
    assert [e.content.parts[0].text for e in leases.journal(fid) if e.content] == ["from A", "from B"]
    result = fork_store.result(fid)
    assert result is not None and result.output == "B's answer"
    assert event_types(fork_store, fid) == ["queued", "started", "revived", "started", "finished"]


def test_finish_writes_the_result_once_and_ends_the_lease(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client)
    claim = claimed(leases, fid)

    leases.finish(claim, result_of(fid))

    assert not redis_client.exists(KEYS.lease(fid))
    assert redis_client.zscore(KEYS.running, fid) is None
    assert state_field(redis_client, fid, "status") == "succeeded"
    result = fork_store.result(fid)
    assert result is not None and result.output == "done"
    assert 0 < redis_client.ttl(KEYS.result(fid)) <= 3600
    with pytest.raises(LeaseLost, match=r"refused \(succeeded\)"):
        leases.finish(claim, ForkResult(fork_id=fid, status=Status.FAILED, error="again"))
    assert [e.type for e in fork_store.events(fid)].count("finished") == 1


def test_finish_appends_the_last_entries_and_events_with_the_result_at_their_position_only(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client)
    claim = claimed(leases, fid)
    leases.append(claim, model_entry(0))

    with pytest.raises(LeaseLost, match=r"refused \(seq\)"):  # not where the journal stands: nothing written
        leases.finish(claim, result_of(fid), model_entry(5, text="late"), events=[step_event(2)])
    assert state_field(redis_client, fid, "status") == "running"
    leases.finish(claim, result_of(fid), model_entry(1, text="done"), events=[step_event(2)])

    assert [e.seq for e in leases.journal(fid)] == [0, 1]
    assert event_types(fork_store, fid)[-2:] == ["step", "finished"]
    assert state_field(redis_client, fid, "status") == "succeeded"


def test_release_hands_the_fork_back_at_once_with_a_released_event(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client)
    claim = claimed(leases, fid, "worker-a")

    leases.release(claim, "worker shutdown")

    assert state_field(redis_client, fid, "status") == "queued"
    assert not redis_client.exists(KEYS.lease(fid))
    # indexed, out of the sweepers' way, until the releasing worker confirms its re-enqueue
    assert fid not in leases.expired()
    leases.enqueued(fid)
    assert redis_client.zscore(KEYS.running, fid) is None
    released = [e for e in fork_store.events(fid) if e.type == "released"]
    assert [e.wire_data() for e in released] == [{"reason": "worker shutdown"}]
    again = claimed(leases, fid, "worker-b")  # no wait for a TTL
    assert (again.epoch, again.attempt) == (2, 2)
    with pytest.raises(LeaseLost):
        leases.append(claim, model_entry(0))


# ── renew ─────────────────────────────────────────────────────────────────────────────────────


def test_renew_extends_live_leases_takes_back_lapsed_ones_never_revived_and_refuses_lost_ones(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given four claims: a live lease, a lapsed one nobody revived, a lapsed one revived, one taken over
    leases = make_leases(redis_client, ttl_ms=2000)
    short = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    live_id, _ = make_queued_fork()
    live = claimed(leases, live_id)
    lapsed_id, _ = make_queued_fork()
    lapsed = claimed(short, lapsed_id)
    revived_id, _ = make_queued_fork()
    revived = claimed(short, revived_id)
    taken_id, _ = make_queued_fork()
    taken = claimed(leases, taken_id, "worker-a")
    redis_client.set(KEYS.lease(taken_id), b"worker-b", px=2000)  # someone else holds it now
    expire(redis_client, lapsed_id)
    expire(redis_client, revived_id)
    assert short.revive(revived_id, max_attempts=3) == "revive"
    redis_client.pexpire(KEYS.lease(live_id), 500)
    score_before = redis_client.zscore(KEYS.running, live_id)

    # When one heartbeat renews them all
    renewed = leases.renew([live, lapsed, revived, taken])

    # Then the live lease is renewed, the lapsed one is its run's again (its fork still runs under its
    # epoch and owner), and the revived and taken ones are refused and left as they are
    assert renewed == [1, 2, 0, 0]
    assert redis_client.pttl(KEYS.lease(live_id)) > 1500
    score_after = redis_client.zscore(KEYS.running, live_id)
    assert score_before is not None and score_after is not None and score_after >= score_before
    assert redis_client.get(KEYS.lease(lapsed_id)) == lapsed.owner.encode()
    assert redis_client.pttl(KEYS.lease(lapsed_id)) > 1500
    assert (state_field(redis_client, lapsed_id, "retaken"), state_field(redis_client, live_id, "retaken")) == (
        "1",
        None,
    )
    assert not redis_client.exists(KEYS.lease(revived_id))
    assert state_field(redis_client, revived_id, "status") == "queued"
    assert redis_client.get(KEYS.lease(taken_id)) == b"worker-b"
    assert leases.renew([]) == []


def test_fenced_writes_take_back_a_lapsed_lease_whose_fork_was_never_revived(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a run whose lease lapsed (as during a Redis outage longer than its remaining TTL), not revived
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    claim = claimed(leases, fid)
    expire(redis_client, fid)
    again = make_leases(redis_client, ttl_ms=5000)

    # When it checkpoints, appends, checkpoints again and finishes
    assert again.emit(claim, [model_call(1)]) == "running"
    assert redis_client.pttl(KEYS.lease(fid)) > 4000  # the checkpoint took the lease back for a whole TTL
    redis_client.delete(KEYS.lease(fid))  # and it lapses once more
    again.append(claim, model_entry(0), events=[step_event(1)])
    assert redis_client.get(KEYS.lease(fid)) == claim.owner.encode()
    redis_client.delete(KEYS.lease(fid))
    again.finish(claim, result_of(fid))

    # Then every write went through under the same epoch: nobody else ever ran the fork
    assert [e.seq for e in leases.journal(fid)] == [0]
    assert event_types(fork_store, fid) == ["queued", "started", "model_call", "step", "finished"]
    assert (state_field(redis_client, fid, "status"), state_field(redis_client, fid, "epoch")) == ("succeeded", "1")
    assert state_field(redis_client, fid, "retaken") == "3"
    assert not redis_client.exists(KEYS.lease(fid))


@pytest.mark.parametrize("then", ["revived", "claimed elsewhere", "cancelled"])
def test_a_lapsed_lease_is_never_taken_back_once_the_fork_moved_on(
    then: str, redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a run whose lease lapsed, and then the fork was revived (and perhaps claimed again), or cancelled
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    stale = claimed(leases, fid, "worker-a")
    expire(redis_client, fid)
    if then == "cancelled":
        fork_store.cancel(fid)
    else:
        assert leases.revive(fid, max_attempts=3) == "revive"
    if then == "claimed elsewhere":
        claimed(make_leases(redis_client), fid, "worker-b")
    events = event_types(fork_store, fid)

    # When the stale run renews, checkpoints and writes
    assert leases.renew([stale]) == [0]
    assert leases.emit(stale, [model_call(2)]) != "running"
    with pytest.raises(LeaseLost):
        leases.append(stale, model_entry(0))
    with pytest.raises(LeaseLost):
        leases.finish(stale, result_of(fid))

    # Then nothing was written and the lease is not the stale run's
    assert event_types(fork_store, fid) == events
    assert leases.journal(fid) == []
    assert redis_client.get(KEYS.lease(fid)) in (None, b"worker-b")
    assert state_field(redis_client, fid, "retaken") is None


def test_a_retried_claim_whose_lease_lapsed_meanwhile_takes_it_back_as_granted(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a claim that ran in Redis (its reply lost) and whose lease then lapsed during the outage
    fid, _ = make_queued_fork()
    first = claimed(make_leases(redis_client, ttl_ms=SHORT_TTL_MS), fid, "worker-a")
    expire(redis_client, fid)

    # When the worker retries the same claim (same owner token) once Redis answers
    retried = claimed(make_leases(redis_client, ttl_ms=5000), fid, "worker-a")

    # Then it gets the same claim back, with the lease, and nothing was claimed twice
    assert (retried.epoch, retried.attempt) == (first.epoch, first.attempt) == (1, 1)
    assert redis_client.get(KEYS.lease(fid)) == b"worker-a"
    assert redis_client.pttl(KEYS.lease(fid)) > 4000
    assert event_types(fork_store, fid) == ["queued", "started"]


# ── revive ────────────────────────────────────────────────────────────────────────────────────


def test_revive_on_a_live_lease_returns_alive_and_leaves_the_fork_running(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=5000)
    claim = claimed(leases, fid)
    redis_client.zadd(KEYS.running, {fid: 0})  # the sweeper's index says "expired", the lease does not

    assert leases.revive(fid, max_attempts=3) == "alive"

    assert state_field(redis_client, fid, "status") == "running"
    assert redis_client.get(KEYS.lease(fid)) == claim.owner.encode()
    score = redis_client.zscore(KEYS.running, fid)
    assert score is not None and score > 0  # re-scored at the lease's real deadline
    assert fid not in leases.expired()
    assert "revived" not in event_types(fork_store, fid)
    leases.append(claim, model_entry(0))  # the live worker keeps writing


def test_a_live_lease_of_a_dead_owner_is_ended_and_the_fork_revived_but_only_that_owners(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a fork running under a lease with most of its TTL left
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=60_000)
    claim = claimed(leases, fid)
    assert redis_client.pttl(KEYS.lease(fid)) > 50_000

    # When a sweeper names another owner as dead, nothing happens
    assert leases.revive(fid, max_attempts=3, dead_owner="host:1:2:someone.else") == "alive"
    assert redis_client.get(KEYS.lease(fid)) == claim.owner.encode()

    # Then naming the lease's own owner ends the lease and revives the fork at once, via its connection
    assert leases.revive(fid, max_attempts=3, dead_owner=claim.owner) == "revive"
    assert redis_client.exists(KEYS.lease(fid)) == 0
    assert state_field(redis_client, fid, "status") == "queued"
    revived = [e.wire_data() for e in fork_store.events(fid) if e.type == "revived"]
    assert revived == [{"attempt": 1, "lost": 1, "via": "connection"}]
    # and the dead owner's writes are refused
    with pytest.raises(LeaseLost):
        leases.append(claim, model_entry(0))


def test_the_forks_a_presence_owns_are_found_among_the_running(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given three running forks, two claimed under one presence token, one under another
    leases = make_leases(redis_client, ttl_ms=60_000)
    mine, theirs = presence_token(), presence_token()
    forks = [make_queued_fork()[0] for _ in range(3)]
    owners = [owner_token(mine), owner_token(mine), owner_token(theirs)]
    for fid, owner in zip(forks, owners, strict=True):
        assert isinstance(leases.claim(fid, owner), Claim)

    # Then each presence owns exactly its own
    assert sorted(leases.owned_by(mine)) == sorted(zip(forks[:2], owners[:2], strict=True))
    assert leases.owned_by(theirs) == [(forks[2], owners[2])]
    assert leases.owned_by(presence_token()) == []


def test_revive_after_expiry_requeues_the_fork_once(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    claimed(leases, fid)
    expire(redis_client, fid)
    wait_until(lambda: fid in leases.expired(), what="the fork to be listed as expired")

    assert leases.revive(fid, max_attempts=3) == "revive"
    assert leases.revive(fid, max_attempts=3) == "queued"  # a second sweeper finds nothing to do

    assert (state_field(redis_client, fid, "status"), state_field(redis_client, fid, "owner")) == ("queued", "")
    revived = [e for e in fork_store.events(fid) if e.type == "revived"]
    assert [e.wire_data() for e in revived] == [{"attempt": 1, "lost": 1, "via": "lease"}]
    # it stays in the running index, out of the sweepers' way, until its job is confirmed enqueued
    assert fid not in leases.expired()
    leases.enqueued(fid)
    assert redis_client.zscore(KEYS.running, fid) is None


def test_revive_at_the_attempt_limit_fails_the_fork_with_worker_lost(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    for attempt in (1, 2):
        claim = claimed(leases, fid)
        assert claim.attempt == attempt
        expire(redis_client, fid)
        assert leases.revive(fid, max_attempts=2) == ("revive" if attempt == 1 else "failed")

    # the state, the result and the finished event give one reason, which names the setting and the fix
    reason = (
        "worker_lost: the worker running this fork was lost 2 times (FORKQ_MAX_ATTEMPTS), so it is not run again; "
        "each run died or stopped renewing its lease: look in the worker logs for what ended it (out of memory, "
        "a killed process, a tool that hangs the process), fix that, then launch the task again"
    )
    state = fork_store.state(fid)
    assert (state.status, state.error) == (Status.FAILED, reason)
    result = fork_store.result(fid)
    assert result is not None and (result.status, result.error) == (Status.FAILED, reason)
    assert redis_client.zscore(KEYS.running, fid) is None
    finished = list(fork_store.events(fid))[-1]
    assert (finished.type, finished.wire_data()) == ("finished", {"status": "failed", "error": reason})
    assert leases.claim(fid, "worker-c") == Refusal(RefusalReason.NOT_QUEUED, Status.FAILED)


@pytest.mark.parametrize("end", ["finish", "cancel"])
def test_revive_of_an_ended_fork_only_drops_it_from_the_running_index(
    end: str, redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client)
    claim = claimed(leases, fid)
    if end == "finish":
        leases.finish(claim, result_of(fid))
    else:
        fork_store.cancel(fid)
    redis_client.zadd(KEYS.running, {fid: 0})
    events_before = event_types(fork_store, fid)

    assert leases.revive(fid, max_attempts=3) == ("succeeded" if end == "finish" else "cancelled")

    assert redis_client.zscore(KEYS.running, fid) is None
    assert event_types(fork_store, fid) == events_before
    assert leases.revive("f-never-launched", max_attempts=3) == "missing"


def test_expired_lists_only_forks_past_their_deadline_oldest_first(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    long_lived = make_leases(redis_client, ttl_ms=60_000)
    short_lived = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    live, _ = make_queued_fork()
    claimed(long_lived, live)
    first, _ = make_queued_fork()
    claimed(short_lived, first)
    second, _ = make_queued_fork()
    claimed(short_lived, second)
    redis_client.zadd(KEYS.running, {first: 1})  # the oldest deadline

    wait_until(lambda: len(long_lived.expired()) == 2, what="both short leases to pass their deadline")

    assert long_lived.expired() == [first, second]
    assert long_lived.expired(limit=1) == [first]


# ── the heartbeat ─────────────────────────────────────────────────────────────────────────────


def test_one_heartbeat_renews_thousands_of_leases_in_order_across_script_calls(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given more claims than one renewal script call takes, every 97th of them taken over by another worker
    leases = make_leases(redis_client, ttl_ms=60_000)
    count = 2 * RENEW_BATCH + 37
    claims = [claimed(leases, make_queued_fork()[0]) for _ in range(count)]
    lost = set(range(0, count, 97)) | {RENEW_BATCH - 1, RENEW_BATCH}  # either side of a call's edge too
    for i in lost:
        redis_client.set(KEYS.lease(claims[i].fork_id), b"another-worker", px=60_000)
    for claim in claims:
        redis_client.pexpire(KEYS.lease(claim.fork_id), 1_000)

    # When one heartbeat renews them all
    renewed = leases.renew(claims)

    # Then each answer is its own claim's, in order: renewed, or refused where another worker holds the lease
    assert renewed == [0 if i in lost else 1 for i in range(count)]
    assert all(redis_client.pttl(KEYS.lease(claims[i].fork_id)) > 50_000 for i in range(count) if i not in lost)
    assert all(redis_client.get(KEYS.lease(claims[i].fork_id)) == b"another-worker" for i in lost)


def test_the_lease_keeper_renews_held_leases_and_flags_lost_ones(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    leases = make_leases(redis_client, ttl_ms=1000)
    keeper = LeaseKeeper(leases, interval_s=3600)  # beats are driven by the test
    kept_id, _ = make_queued_fork()
    kept = claimed(leases, kept_id)
    lost_id, _ = make_queued_fork()
    lost_claim = claimed(leases, lost_id)
    kept_lost = keeper.hold(kept)
    lost_flag = keeper.hold(lost_claim)
    redis_client.hincrby(KEYS.state(lost_id), "epoch", 1)
    redis_client.set(KEYS.lease(lost_id), b"another-worker", px=1000)
    redis_client.pexpire(KEYS.lease(kept_id), 100)

    keeper.beat()

    assert not kept_lost.is_set()
    assert redis_client.pttl(KEYS.lease(kept_id)) > 500
    assert lost_flag.is_set()
    keeper.drop(kept)
    keeper.drop(lost_claim)
    redis_client.pexpire(KEYS.lease(kept_id), 100)
    keeper.beat()  # nothing held: nothing renewed
    expire(redis_client, kept_id)
    keeper.stop()


def test_the_lease_keeper_thread_keeps_a_lease_alive_past_its_ttl(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    leases = make_leases(redis_client, ttl_ms=300)
    keeper = LeaseKeeper(leases, interval_s=0.05)
    fid, _ = make_queued_fork()
    claim = claimed(leases, fid)
    lost = keeper.hold(claim)
    try:
        # Given three TTLs have passed with the heartbeat running
        time.sleep(0.9)  # not a synchronization: three TTLs pass, which the heartbeat must outlive
        # Then the lease is still ours and the sweeper would find it alive
        assert redis_client.get(KEYS.lease(fid)) == claim.owner.encode()
        assert leases.revive(fid, max_attempts=3) == "alive"
        assert not lost.is_set()
    finally:
        keeper.stop()
        keeper.drop(claim)


def test_a_heartbeat_that_cannot_reach_redis_is_retried_not_fatal(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    claim = claimed(make_leases(redis_client), fid)
    # a client pointing at a closed port: every renewal raises a ConnectionError
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    keeper = LeaseKeeper(make_leases(dead), interval_s=3600)
    lost = keeper.hold(claim)

    keeper.beat()

    assert not lost.is_set()  # a missed beat is not a lost lease; the TTL covers a few misses
    keeper.stop()
    dead.close()


def test_fenced_scripts_are_atomic_under_concurrent_claims(
    redis_client: redis.Redis, redis_url: str, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given twenty workers racing to claim the same queued fork with separate connections
    fid, _ = make_queued_fork()
    barrier = threading.Barrier(20)
    outcomes: list[Claim | Refusal] = []
    lock = threading.Lock()

    def race(i: int) -> None:
        with redis.Redis.from_url(redis_url) as own:
            leases = make_leases(own)
            barrier.wait()
            outcome = leases.claim(fid, f"worker-{i}")
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)

    # Then exactly one won, at epoch 1
    winners = [o for o in outcomes if isinstance(o, Claim)]
    assert len(outcomes) == 20 and len(winners) == 1
    assert winners[0].epoch == 1
    assert {o for o in outcomes if isinstance(o, Refusal)} == {Refusal(RefusalReason.NOT_QUEUED, Status.RUNNING)}


def test_releases_at_shutdown_do_not_count_toward_the_worker_lost_limit(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a fork handed back by two graceful shutdowns (rolling restarts), then run by a worker that died
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    for _ in range(2):
        leases.release(claimed(leases, fid), "worker shutdown")
    claimed(leases, fid)
    expire(redis_client, fid)

    # Then one worker death out of three allowed revives it; it is not failed as "died 3 times"
    outcome = leases.revive(fid, max_attempts=3)
    assert outcome == "revive", (outcome, fork_store.state(fid).error)


# ── Redis outages: retried writes, written once ───────────────────────────────────────────────


class LossyProxy:
    """A TCP proxy in front of Redis that loses one reply: a command reaches Redis and runs, then the
    connection is cut before its reply reaches the client (as when Redis restarts at that moment)."""

    def __init__(self, port: int) -> None:
        self.upstream = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.marker: bytes | None = None  # the next command containing it loses its reply
        self.lost = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply_to(self, marker: bytes) -> None:
        """Cut the connection of the next command containing `marker` once Redis has answered it."""
        with self._lock:
            self.marker = marker

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.upstream)
            doomed = threading.Event()  # set once this connection carried the marked command
            threading.Thread(target=self._up, args=(client, server, doomed), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, doomed), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                with self._lock:
                    if self.marker is not None and self.marker in data:
                        self.marker = None
                        doomed.set()  # before the command is sent: its reply cannot come back first
                server.sendall(data)

    def _down(self, server: socket.socket, client: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if doomed.is_set():  # the marked command ran; its reply is lost with the connection
                    self.lost += 1
                    break
                client.sendall(data)
        for end in (client, server):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


def sha(script: str) -> bytes:
    return hashlib.sha1(script.encode()).hexdigest().encode()


def park_calls() -> list[ParkedCall]:
    return [ParkedCall(call_id="c1", index=0, step=1, name="write_file", args={})]


def surface_entry() -> JournalEntry:
    return JournalEntry(seq=0, step=0, kind="surface", tools=["read_file"])


# each write: (its script, what it does under `claim` through `leases`, the events it publishes)
LOSSY_WRITES: dict[str, tuple[str, Callable[[Leases, Claim], object], list[str]]] = {
    "append": (lua.APPEND, lambda ls, c: ls.append(c, model_entry(0), events=[step_event(1)]), ["step"]),
    "emit": (lua.EMIT, lambda ls, c: ls.emit(c, [model_call(1)]), ["model_call"]),
    "finish": (lua.FINISH, lambda ls, c: ls.finish(c, result_of(c.fork_id), model_entry(0)), ["finished"]),
    "release": (lua.RELEASE, lambda ls, c: ls.release(c, "worker shutdown"), ["released"]),
    "pause": (lua.PAUSE, lambda ls, c: ls.pause(c, "a tool is missing"), ["paused"]),
    "park": (lua.PAUSE, lambda ls, c: ls.park(c, park_calls()), ["awaiting_approval"]),
}


@pytest.mark.parametrize("write", list(LOSSY_WRITES))
def test_a_fenced_write_whose_reply_was_lost_is_retried_and_written_once(
    write: str,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    fork_store: ForkStore,
    make_queued_fork: Callable[..., tuple[str, str]],
) -> None:
    # Given a claimed fork, and a client whose connection loses the reply of the write (no retries of its own)
    script, do, published = LOSSY_WRITES[write]
    fid, _ = make_queued_fork()
    claim = claimed(make_leases(redis_client), fid)
    redis_client.script_load(script)
    proxy = LossyProxy(cast(int, redis_server.port))
    lossy = redis.Redis(port=proxy.port, retry=Retry(NoBackoff(), 0))
    try:
        proxy.lose_reply_to(sha(script))

        # When the write runs in Redis but its reply never arrives
        outcome = do(make_leases(lossy), claim)
    finally:
        lossy.close()
        proxy.close()

    # Then the run retried it, found its own effect, and nothing was written twice
    assert proxy.lost == 1
    assert outcome in (None, False, "running", "finished")  # append: no mail; finish: finished
    assert event_types(fork_store, fid) == ["queued", "started", *published]
    entries = redis_client.lrange(KEYS.journal(fid), 0, -1)
    assert entries == ([model_entry(0).encode()] if write in ("append", "finish") else [])
    assert state_field(redis_client, fid, "epoch") == "1"


def test_a_claim_whose_reply_was_lost_is_handed_back_as_granted_and_claims_nothing_twice(
    redis_server: RedisServer,
    redis_client: redis.Redis,
    fork_store: ForkStore,
    make_queued_fork: Callable[..., tuple[str, str]],
) -> None:
    # Given a queued fork whose first claim also records the surface and publishes the first model call
    fid, digest = make_queued_fork()
    record = cast(bytes, redis_client.get(KEYS.bootstrap(fid)))
    redis_client.script_load(lua.CLAIM)
    proxy = LossyProxy(cast(int, redis_server.port))
    lossy = redis.Redis(port=proxy.port, retry=Retry(NoBackoff(), 0))
    try:
        proxy.lose_reply_to(sha(lua.CLAIM))

        # When the claim runs in Redis but its reply never arrives
        first = FirstWrite(record, surface_entry(), model_call(1))
        claim = make_leases(lossy).claim(fid, "worker-a", digest, first=first)
    finally:
        lossy.close()
        proxy.close()

    # Then the retry gets the same claim back: one epoch, one attempt, one surface entry, one of each event
    assert proxy.lost == 1
    assert isinstance(claim, Claim), claim
    assert (claim.epoch, claim.attempt, claim.primed, claim.record) == (1, 1, True, record)
    assert claim.journal == (surface_entry().encode(),)
    assert event_types(fork_store, fid) == ["queued", "started", "model_call"]
    assert redis_client.lrange(KEYS.journal(fid), 0, -1) == [surface_entry().encode()]
    assert (state_field(redis_client, fid, "epoch"), state_field(redis_client, fid, "attempt")) == ("1", "1")


def queue_fork(client: redis.Redis) -> str:
    """A queued fork on `client`'s Redis (a server of the test's own)."""
    fid = "f-outage"
    put_queued_fork(ForkStore(client, KEYS, ttl_s=3600), fid)
    return fid


@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_a_fenced_write_waits_out_a_redis_restart_shorter_than_the_lease(fresh_redis: RedisServer) -> None:
    # Given a fork claimed under a 10 s lease
    with redis.Redis.from_url(fresh_redis.url) as client:
        leases = make_leases(client, ttl_ms=10_000)
        claim = claimed(leases, queue_fork(client))

        # When Redis stops (its AOF kept) and starts again 1.5 s later while the run appends a journal entry
        stop_redis(fresh_redis)
        restarter = threading.Timer(1.5, fresh_redis.restart)
        restarter.start()
        started = time.monotonic()
        try:
            leases.append(claim, model_entry(0), events=[step_event(1)])
            waited = time.monotonic() - started
        finally:
            restarter.join()  # the server is restarted while the fixture still owns it

        # Then the append was retried until Redis answered, and written once
        assert waited >= 1.0
        assert client.lrange(KEYS.journal(claim.fork_id), 0, -1) == [model_entry(0).encode()]
        assert [e.type for e in ForkStore(client, KEYS, ttl_s=3600).events(claim.fork_id)] == [
            "queued",
            "started",
            "step",
        ]
        assert leases.revive(claim.fork_id, max_attempts=3) == "alive"  # the lease kept its TTL across the restart


@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_a_fenced_write_stops_as_lease_lost_once_redis_was_down_past_the_lease(fresh_redis: RedisServer) -> None:
    # Given a fork claimed under a 1.5 s lease
    with redis.Redis.from_url(fresh_redis.url) as client:
        leases = make_leases(client, ttl_ms=1500)
        claim = claimed(leases, queue_fork(client))

        # When Redis is down for longer than the lease while the run appends
        stop_redis(fresh_redis)
        started = time.monotonic()
        with pytest.raises(LeaseLost, match="Redis did not answer") as lost:
            leases.append(claim, model_entry(0))
        gave_up = time.monotonic() - started

        # Then the run retried for the lease TTL (and a margin), then stopped as having lost its lease
        assert lost.value.refusal == "unreachable"
        assert 1.5 <= gave_up < 1.5 + LAPSE_MARGIN_S + 3
        # and the lease had indeed lapsed: the sweeper revives the fork once Redis is back
        fresh_redis.restart()
        assert not client.exists(KEYS.lease(claim.fork_id))
        assert leases.revive(claim.fork_id, max_attempts=3) == "revive"
        assert client.llen(KEYS.journal(claim.fork_id)) == 0


@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_the_heartbeat_renews_as_soon_as_redis_is_back_not_a_beat_later(
    fresh_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a held 12 s lease renewed every 6 s, and Redis stopped right away
    ttl_s, interval_s = 12.0, 6.0
    with redis.Redis.from_url(fresh_redis.url) as client:
        leases = make_leases(client, ttl_ms=int(ttl_s * 1000))
        claim = claimed(leases, queue_fork(client))
        keeper = LeaseKeeper(leases, interval_s=interval_s)
        lost = keeper.hold(claim)
        try:
            stop_redis(fresh_redis)

            # When the beat due at 6 s fails, and Redis is started again just after
            wait_until(
                lambda: any("lease heartbeat failed" in r.getMessage() for r in caplog.records),
                timeout=interval_s + 10,
                what="the heartbeat to fail",
            )
            restarting = time.monotonic()  # Redis is down until this moment: a renewal answered after it is new
            fresh_redis.restart()

            # Then the lease is renewed within a few seconds of Redis answering, not a whole beat (6 s) later
            wait_until(lambda: claim.clock.until > restarting + ttl_s, timeout=interval_s - 2, what="the renewal")
            assert time.monotonic() - restarting < interval_s - 2
            assert client.pttl(KEYS.lease(claim.fork_id)) > (ttl_s - interval_s + 2) * 1000
            assert not lost.is_set()
        finally:
            keeper.stop()
            keeper.drop(claim)


@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_a_claim_is_retried_for_as_long_as_redis_is_down_and_then_claims_the_fork(fresh_redis: RedisServer) -> None:
    # Given a queued fork, a 1 s lease, and Redis down when a worker claims the fork
    with redis.Redis.from_url(fresh_redis.url) as client:
        leases = make_leases(client, ttl_ms=1000)
        fid = queue_fork(client)
        stop_redis(fresh_redis)
        outcome: list[object] = []

        def claim() -> None:
            try:
                outcome.append(leases.claim(fid, "worker-a"))
            except Exception as exc:  # reported by the assertion below
                outcome.append(exc)

        worker = threading.Thread(target=claim, daemon=True)
        worker.start()

        # When Redis stays down well past the lease's TTL (and its margin), then answers again
        time.sleep(1.0 + LAPSE_MARGIN_S + 2.0)  # not a synchronization: the outage, past the lease and its margin
        assert outcome == [] and worker.is_alive()  # still retrying: the claim never ran, nobody else would run it
        fresh_redis.restart()
        worker.join(timeout=15)

        # Then the claim went through once Redis answered: the fork runs, on its first attempt
        [claim_or_error] = outcome
        assert isinstance(claim_or_error, Claim), claim_or_error
        assert (claim_or_error.epoch, claim_or_error.attempt) == (1, 1)
        assert state_field(client, fid, "status") == "running"
        assert client.get(KEYS.lease(fid)) == b"worker-a"


def test_a_stale_runs_checkpoint_publishes_nothing_once_the_fork_moved_on(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a run whose lease expired, and the fork revived and claimed by another worker
    fid, _ = make_queued_fork()
    leases = make_leases(redis_client, ttl_ms=SHORT_TTL_MS)
    stale = claimed(leases, fid, "worker-a")
    expire(redis_client, fid)
    assert leases.revive(fid, max_attempts=3) == "revive"
    fresh = claimed(make_leases(redis_client), fid, "worker-b")
    events = fork_store.events(fid)

    # When the stale run reaches a checkpoint while the fork runs elsewhere, and again after it finished
    running = leases.emit(stale, [model_call(2, "stale")])
    assert fork_store.events(fid) == events
    leases.finish(fresh, result_of(fid))
    events = fork_store.events(fid)
    finished = leases.emit(stale, [model_call(3, "stale")])

    # Then it published nothing and learnt why: the fork is no longer its own
    assert (running, finished) == ("stale", "succeeded")
    assert fork_store.events(fid) == events
    assert leases.emit(fresh, []) == "succeeded"

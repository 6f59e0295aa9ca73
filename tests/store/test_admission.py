"""The admission scripts on a real Redis: slots, rate windows, token settling, cooldowns, fair turns, expiry."""

from __future__ import annotations

import itertools
import time

import redis

from tests.conftest import TEST_NAMESPACE, put_queued_fork
from workers.base.keys import Keys
from workers.records.parked import AdmissionLimit, ModelWait
from workers.store.admission import AdmissionStore, Ask, Capacity, wait_over, wait_shown
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases

KEYS = Keys(TEST_NAMESPACE)
MODEL = "gpt-4.1-mini"
ENDPOINT = "http://127.0.0.1:9/v1"
_ids = itertools.count()


def store(client: redis.Redis, token: str = "host:1:aaaa", *, hold_ttl_ms: int = 10_000) -> AdmissionStore:
    return AdmissionStore(client, KEYS, token=token, hold_ttl_ms=hold_ttl_ms, alive_ttl_ms=10_000)


def ask(admission: AdmissionStore, session: str = "s-a", estimate: int = 10, weight: float = 1.0) -> Ask:
    return Ask(f"{admission.token}|f-{next(_ids)}|0", session, estimate, ENDPOINT, weight)


def test_a_call_goes_out_at_once_while_a_slot_is_free_and_the_next_is_granted_when_it_ends(
    redis_client: redis.Redis,
) -> None:
    admission, capacity = store(redis_client), Capacity(concurrency=1)
    first, second = ask(admission), ask(admission)

    answer = admission.acquire(MODEL, capacity, first)
    queued = admission.acquire(MODEL, capacity, second)

    assert answer.granted and answer.limit is None
    assert not queued.granted and queued.limit is AdmissionLimit.CONCURRENCY
    assert admission.holds(MODEL) == [first.waiter] and admission.queued(MODEL) == [second.waiter]
    # the release hands the slot on in the same script, and tells the caller (the same process) at once
    assert admission.release(MODEL, capacity, first.waiter, 30) == [second.waiter]
    assert admission.holds(MODEL) == [second.waiter] and admission.queued(MODEL) == []


def test_a_grant_for_another_process_waits_for_that_process_to_look(redis_client: redis.Redis) -> None:
    one, two, capacity = store(redis_client, "host:1:aaaa"), store(redis_client, "host:2:bbbb"), Capacity(1)
    held, waiting = ask(one), ask(two)
    one.acquire(MODEL, capacity, held)
    two.acquire(MODEL, capacity, waiting)

    assert one.release(MODEL, capacity, held.waiter) == []  # granted to the other process, not to this one
    looked = two.poll({MODEL: capacity}, {MODEL: [waiting.waiter]})

    assert looked[MODEL].mine == [waiting.waiter] and looked[MODEL].lost == []
    assert two.poll({MODEL: capacity}, {})[MODEL].mine == []  # told once


def test_sessions_take_turns_however_many_calls_each_has_queued(redis_client: redis.Redis) -> None:
    # Given one slot held, session A with six calls queued, then session B with two
    admission, capacity = store(redis_client), Capacity(concurrency=1)
    holder = ask(admission, "s-z")
    admission.acquire(MODEL, capacity, holder)
    calls = [ask(admission, "s-a") for _ in range(6)] + [ask(admission, "s-b") for _ in range(2)]
    for call in calls:
        assert not admission.acquire(MODEL, capacity, call).granted
    session_of = {call.waiter: call.session for call in calls}

    # When each granted call ends in turn
    order, current = [], holder.waiter
    for _ in calls:
        [current] = admission.release(MODEL, capacity, current)
        order.append(session_of[current])

    # Then B's calls are not left behind A's: each round grants one call of each session (in either order)
    # until B has none left
    assert sorted(order[0:2]) == sorted(order[2:4]) == ["s-a", "s-b"]
    assert order[4:] == ["s-a"] * 4


def test_a_session_of_weight_two_takes_two_turns_to_one(redis_client: redis.Redis) -> None:
    admission, capacity = store(redis_client), Capacity(concurrency=1)
    holder = ask(admission, "s-z")
    admission.acquire(MODEL, capacity, holder)
    calls = [ask(admission, "s-a") for _ in range(4)] + [ask(admission, "s-b", weight=2.0) for _ in range(4)]
    for call in calls:
        admission.acquire(MODEL, capacity, call)
    session_of = {call.waiter: call.session for call in calls}

    order, current = [], holder.waiter
    for _ in range(6):
        [current] = admission.release(MODEL, capacity, current)
        order.append(session_of[current])

    assert order.count("s-b") == 4 and order.count("s-a") == 2


def test_rpm_counts_the_calls_of_the_last_sixty_seconds(redis_client: redis.Redis) -> None:
    admission, capacity = store(redis_client), Capacity(rpm=2)
    first, second, third = ask(admission), ask(admission), ask(admission)
    assert admission.acquire(MODEL, capacity, first).granted
    admission.release(MODEL, capacity, first.waiter)
    assert admission.acquire(MODEL, capacity, second).granted
    admission.release(MODEL, capacity, second.waiter)

    queued = admission.acquire(MODEL, capacity, third)
    assert not queued.granted and queued.limit is AdmissionLimit.RPM

    # When the first call's admission is 60 s old (its score moved back, as a minute passing would)
    log_key = KEYS.admission(MODEL)[4]
    redis_client.zadd(log_key, {first.waiter: queued.now_ms - 60_001})

    # Then the window has room again, and the next look grants the queued call
    assert admission.poll({MODEL: capacity}, {})[MODEL].mine == [third.waiter]


def test_tpm_reserves_the_estimate_and_settles_it_with_the_reported_usage(redis_client: redis.Redis) -> None:
    admission, capacity = store(redis_client), Capacity(tpm=1000)
    first, second = ask(admission, estimate=600), ask(admission, estimate=600)
    assert admission.acquire(MODEL, capacity, first).granted
    queued = admission.acquire(MODEL, capacity, second)
    assert not queued.granted and queued.limit is AdmissionLimit.TPM

    # the first call used 150 tokens, not 600: the second fits
    assert admission.release(MODEL, capacity, first.waiter, 150) == [second.waiter]
    assert int(redis_client.hget(KEYS.admission(MODEL)[5], "_sum") or 0) == 750


def test_a_call_estimated_above_the_whole_tpm_goes_out_alone_rather_than_never(redis_client: redis.Redis) -> None:
    admission, capacity = store(redis_client), Capacity(tpm=100)
    huge, small = ask(admission, estimate=5000), ask(admission, estimate=1)

    assert admission.acquire(MODEL, capacity, huge).granted
    assert not admission.acquire(MODEL, capacity, small).granted


def test_a_cooldown_holds_every_call_of_its_endpoint_and_model_until_it_ends(redis_client: redis.Redis) -> None:
    admission, capacity = store(redis_client), Capacity(concurrency=10)
    until, now = admission.cooldown(MODEL, ENDPOINT, 300)
    assert until - now == 300
    # a shorter cooldown reported later does not shorten it; a read changes nothing
    assert admission.cooldown(MODEL, ENDPOINT, 50)[0] == until
    assert admission.cooldown(MODEL, ENDPOINT)[0] == until

    call = ask(admission)
    queued = admission.acquire(MODEL, capacity, call)
    other_endpoint = Ask(f"{admission.token}|f-x|0", "s-a", 1, "https://elsewhere/v1")

    assert not queued.granted and queued.limit is AdmissionLimit.COOLDOWN
    assert admission.acquire("another-model", capacity, other_endpoint).granted
    time.sleep(0.35)  # the cooldown's 300 ms must pass
    assert admission.poll({MODEL: capacity}, {})[MODEL].mine == [call.waiter]
    assert admission.cooldown(MODEL, ENDPOINT)[0] == 0  # over


def test_a_hold_that_is_not_renewed_expires_and_one_that_is_renewed_stays(redis_client: redis.Redis) -> None:
    silent, alive = store(redis_client, "host:1:aaaa", hold_ttl_ms=300), store(redis_client, "host:2:bbbb")
    capacity = Capacity(concurrency=2)
    lapsing, kept = ask(silent), ask(silent)
    silent.acquire(MODEL, capacity, lapsing)
    silent.acquire(MODEL, capacity, kept)
    waiting = ask(alive)
    assert not alive.acquire(MODEL, capacity, waiting).granted

    time.sleep(0.2)  # part of the hold TTL passes; one hold is renewed, the other is not
    silent.renew({MODEL: [kept.waiter]})
    time.sleep(0.2)

    assert alive.poll({MODEL: capacity}, {})[MODEL].mine == [waiting.waiter]
    assert sorted(alive.holds(MODEL)) == sorted([kept.waiter, waiting.waiter])


def test_the_sweeper_frees_a_dead_processs_holds_and_queued_calls(redis_client: redis.Redis) -> None:
    dead, live, capacity = store(redis_client, "host:1:dead"), store(redis_client, "host:2:live"), Capacity(2)
    held = [ask(dead), ask(dead)]
    for call in held:
        dead.acquire(MODEL, capacity, call)
    queued_dead, queued_live = ask(dead), ask(live)
    dead.acquire(MODEL, capacity, queued_dead)
    live.acquire(MODEL, capacity, queued_live)

    sweeper = store(redis_client, "sweeper:0:cccc")
    assert sweeper.release_owner(dead.token) == 2

    assert dead.holds(MODEL) == [] and dead.queued(MODEL) == [queued_live.waiter]
    assert live.poll({MODEL: capacity}, {})[MODEL].mine == [queued_live.waiter]


def test_a_queued_call_of_a_process_that_stopped_looking_is_dropped_and_its_census_finds_it_lost(
    redis_client: redis.Redis,
) -> None:
    quiet = AdmissionStore(redis_client, KEYS, token="host:1:aaaa", hold_ttl_ms=10_000, alive_ttl_ms=200)
    other, capacity = store(redis_client, "host:2:bbbb"), Capacity(concurrency=1)
    holder = ask(other)
    other.acquire(MODEL, capacity, holder)
    dropped, next_in_line = ask(quiet), ask(other)
    quiet.acquire(MODEL, capacity, dropped)
    other.acquire(MODEL, capacity, next_in_line)

    time.sleep(0.3)  # longer than the quiet process's liveness: it did not look meanwhile
    assert other.release(MODEL, capacity, holder.waiter) == [next_in_line.waiter]

    assert quiet.poll({MODEL: capacity}, {MODEL: [dropped.waiter]})[MODEL].lost == [dropped.waiter]


def test_a_forks_wait_shows_in_its_state_and_its_admitted_wait_moves_its_first_start_on(
    redis_client: redis.Redis, fork_store: ForkStore
) -> None:
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    digest = put_queued_fork(fork_store, "f-wait")
    claim = leases.claim("f-wait", "worker-a", digest)
    assert isinstance(claim, Claim)
    first = int(redis_client.hget(KEYS.state("f-wait"), "first_started_ms") or 0)
    admission = store(redis_client)
    wait = ModelWait(model=MODEL, limit=AdmissionLimit.CONCURRENCY, since_ms=first)

    admission.write_waits([wait_shown("f-wait", claim.epoch + 1, claim.owner, wait, 1)])  # another epoch: fenced out
    assert fork_store.state("f-wait").waiting_for is None
    admission.write_waits([wait_shown("f-wait", claim.epoch, claim.owner, wait, 1)])
    assert fork_store.state("f-wait").waiting_for == wait
    [event] = [e for e in fork_store.events("f-wait", count=100) if e.type == "model_wait"]
    assert event.wire_data() == {"step": 1, "model": MODEL, "limit": "concurrency"}

    admission.write_waits([wait_over("f-wait", claim.epoch, claim.owner, 4000)])

    assert fork_store.state("f-wait").waiting_for is None
    assert int(redis_client.hget(KEYS.state("f-wait"), "first_started_ms") or 0) == first + 4000


def test_the_session_tags_stay_bounded_while_many_sessions_pass_through_a_queue_that_never_empties(
    redis_client: redis.Redis,
) -> None:
    admission, capacity = store(redis_client), Capacity(concurrency=1)
    held = ask(admission, "s-holder")
    admission.acquire(MODEL, capacity, held)
    admission.acquire(MODEL, capacity, ask(admission, "s-first"))
    for i in range(400):  # one session after another queues one call; the head is granted as each hold ends
        admission.acquire(MODEL, capacity, ask(admission, f"s-{i}"))
        (held_id,) = admission.holds(MODEL)
        admission.release(MODEL, capacity, held_id)

    assert len(admission.queued(MODEL)) == 1
    assert redis_client.hlen(KEYS.admission(MODEL)[3]) <= 2 + 64


def test_a_hold_past_its_expiry_is_not_brought_back_by_a_late_renewal(redis_client: redis.Redis) -> None:
    admission, capacity = store(redis_client, hold_ttl_ms=50), Capacity(concurrency=1)
    held = ask(admission)
    admission.acquire(MODEL, capacity, held)
    holds_key = KEYS.admission(MODEL)[0]
    expiry = redis_client.zscore(holds_key, held.waiter)
    assert expiry is not None
    while redis_client.time()[0] * 1000 + redis_client.time()[1] // 1000 <= expiry:  # Redis's clock passes it
        time.sleep(0.01)

    admission.renew({MODEL: [held.waiter]})  # a process that was silent longer than its holds' TTL

    assert redis_client.zscore(holds_key, held.waiter) == expiry
    assert admission.acquire(MODEL, capacity, ask(admission)).granted  # the slot is free


def test_the_rate_window_of_a_model_no_longer_called_expires_on_its_own(redis_client: redis.Redis) -> None:
    admission, capacity = store(redis_client), Capacity(rpm=10, tpm=1000)
    held = ask(admission)
    admission.acquire(MODEL, capacity, held)
    admission.release(MODEL, capacity, held.waiter, 20)

    _, _, _, _, log, tokens, *_ = KEYS.admission(MODEL)
    assert 60_000 < redis_client.pttl(log) <= 70_000 and 60_000 < redis_client.pttl(tokens) <= 70_000


def test_freeing_a_dead_process_forgets_the_models_with_nothing_in_flight_or_queued(redis_client: redis.Redis) -> None:
    dead, alive, capacity = store(redis_client, "host:1:dead"), store(redis_client, "host:2:aaaa"), Capacity(1)
    for i in range(20):  # calls of models named by launches, long over
        done = ask(alive)
        alive.acquire(f"gpt-x-{i}", capacity, done)
        alive.release(f"gpt-x-{i}", capacity, done.waiter)
    dead.acquire(MODEL, capacity, ask(dead))
    alive.acquire("gpt-in-use", capacity, ask(alive))

    assert dead.release_owner(dead.token) == 1

    assert redis_client.smembers(KEYS.admission_models) == {b"gpt-in-use"}
    assert alive.acquire(MODEL, capacity, ask(alive)).granted
    assert MODEL.encode() in redis_client.smembers(KEYS.admission_models)


def test_processes_whose_waiters_lapsed_are_forgotten_and_the_live_ones_not_scanned_at_every_look(
    redis_client: redis.Redis,
) -> None:
    admission, capacity = store(redis_client), Capacity(concurrency=1)
    now_ms = int(time.time() * 1000)
    redis_client.hset(KEYS.admission_alive, mapping={f"host:{i}:gone": now_ms - 60_000 for i in range(300)})

    admission.poll({MODEL: capacity}, {})

    assert set(redis_client.hkeys(KEYS.admission_alive)) == {admission.token.encode(), b"_pruned"}
    # a large live cluster: its entries are scanned once, not at every look
    redis_client.hset(KEYS.admission_alive, mapping={f"host:{i}:live": now_ms + 600_000 for i in range(300)})
    before = redis_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
    for _ in range(20):
        admission.poll({MODEL: capacity}, {})
    scans = redis_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0) - before

    assert scans <= 1

"""The sweeper against a real (private) Redis: expired leases revived once, live ones never, bounded attempts.

Expired leases are made deterministically: forks are claimed through `Leases` with a short TTL by an
owner that never renews, and the test waits until Redis has dropped the lease keys.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import redis
from kombu.exceptions import OperationalError

from tests.conftest import TEST_NAMESPACE
from tests.live import wait_until
from workers.base.keys import Keys
from workers.demo.redis_server import RedisServer
from workers.records.fork import BootstrapRecord, Status
from workers.service.sweeper import Sweeper, outage_gap_s
from workers.store.claims import Refusal, RefusalReason
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases
from workers.store.presence import Presence, PresenceWatch, owner_token, presence_token

KEYS = Keys(TEST_NAMESPACE)
SHORT_TTL_MS = 200


@dataclass
class Enqueued:
    """A thread-safe stand-in for the broker: every (fork id, digest, attempt) a sweeper enqueued."""

    jobs: list[tuple[str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, fork_id: str, digest: str, attempt: int) -> None:
        with self.lock:
            self.jobs.append((fork_id, digest, attempt))


def make_sweeper(
    client: redis.Redis, enqueue: Enqueued, *, max_attempts: int = 3, ttl_ms: int = 10_000, interval_s: float = 0.05
) -> Sweeper:
    leases = Leases(client, KEYS, ttl_ms=ttl_ms, retention_s=3600)

    def enqueue_again(fork_id: str, digest: str, attempt: int) -> None:
        # as workers.broker.queue.enqueue_again: the job sent (to the stand-in), then confirmed enqueued
        enqueue(fork_id, digest, attempt)
        leases.enqueued(fork_id)

    return Sweeper(
        leases=leases,
        store=ForkStore(client, KEYS, ttl_s=3600),
        enqueue=enqueue_again,
        max_attempts=max_attempts,
        interval_s=interval_s,
    )


def claim_and_abandon(client: redis.Redis, fork_ids: list[str], ttl_ms: int = SHORT_TTL_MS) -> list[Claim]:
    """Claim each fork as a worker that then dies (never renews); wait until every lease has expired."""
    leases = Leases(client, KEYS, ttl_ms=ttl_ms, retention_s=3600)
    claims = []
    for fid in fork_ids:
        claim = leases.claim(fid, "dead-worker")
        assert isinstance(claim, Claim), claim
        claims.append(claim)
    wait_until(lambda: not any(client.exists(KEYS.lease(fid)) for fid in fork_ids), what="the leases to expire")
    return claims


def event_count(store: ForkStore, fid: str, kind: str) -> int:
    return sum(1 for e in store.events(fid) if e.type == kind)


def test_an_expired_lease_is_revived_and_the_fork_enqueued_for_its_next_attempt(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, digest = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    enqueued = Enqueued()

    outcomes = make_sweeper(redis_client, enqueued).sweep_once()

    assert outcomes == Counter({"revive": 1})
    assert enqueued.jobs == [(fid, digest, 2)]
    assert fork_store.state(fid).status.value == "queued"
    assert event_count(fork_store, fid, "revived") == 1
    assert make_sweeper(redis_client, enqueued).sweep_once() == Counter()  # nothing left to do
    assert len(enqueued.jobs) == 1


def test_a_live_lease_is_never_revived_even_when_its_index_entry_looks_expired(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a worker that stalled past its heartbeat but not past its lease (index score stale)
    fid, _ = make_queued_fork()
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    assert isinstance(leases.claim(fid, "slow-worker"), Claim)
    redis_client.zadd(KEYS.running, {fid: 0})
    enqueued = Enqueued()

    outcomes = make_sweeper(redis_client, enqueued).sweep_once()

    assert outcomes == Counter({"alive": 1})
    assert enqueued.jobs == []
    assert fork_store.state(fid).status.value == "running"
    assert redis_client.get(KEYS.lease(fid)) == b"slow-worker"
    assert event_count(fork_store, fid, "revived") == 0


def test_a_lapsed_lease_is_left_to_its_worker_for_the_grace_and_revived_after_it(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a fork whose lease lapsed just now, and sweepers whose leases give a lapsed lease a 1.5 s grace,
    # whose last pass is older than the outage gap (Redis was unreachable for a while)
    fid, digest = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    enqueued = Enqueued()
    sweeper = make_sweeper(redis_client, enqueued)
    sweeper.leases.lapse_grace_ms = 1500
    seconds, micros = redis_client.time()
    gap_ms = int(outage_gap_s(sweeper.interval_s) * 1000)
    redis_client.hset(KEYS.sweep, "last", seconds * 1000 + micros // 1000 - gap_ms - 1)
    lapsed_at = time.monotonic()

    # When they sweep during the grace
    outcomes = sweeper.sweep_once()

    # Then the fork is left running for its worker to take its lease back: nothing revived or enqueued
    assert outcomes == Counter({"grace": 1})
    assert (fork_store.state(fid).status.value, enqueued.jobs, event_count(fork_store, fid, "revived")) == (
        "running",
        [],
        0,
    )
    # and once the grace has passed without a renewal, the fork is revived as usual
    wait_until(lambda: sweeper.sweep_once() == Counter({"revive": 1}), what="the revival after the grace")
    assert time.monotonic() - lapsed_at >= 1.0
    assert enqueued.jobs == [(fid, digest, 2)]
    assert event_count(fork_store, fid, "revived") == 1


def test_a_fork_whose_worker_keeps_dying_fails_with_worker_lost_at_the_attempt_limit(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    enqueued = Enqueued()
    sweeper = make_sweeper(redis_client, enqueued, max_attempts=2)

    claim_and_abandon(redis_client, [fid])
    assert sweeper.sweep_once() == Counter({"revive": 1})
    claim_and_abandon(redis_client, [fid])
    assert sweeper.sweep_once() == Counter({"failed": 1})

    state = fork_store.state(fid)
    assert (state.status.value, state.attempt) == ("failed", 2)
    assert state.error is not None and state.error.startswith("worker_lost")
    assert [attempt for _, _, attempt in enqueued.jobs] == [2]
    result = fork_store.result(fid)
    assert result is not None and (result.error or "").startswith("worker_lost")


def test_a_fork_cancelled_after_its_lease_expired_is_not_revived(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fid, _ = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    fork_store.cancel(fid)
    enqueued = Enqueued()

    outcomes = make_sweeper(redis_client, enqueued).sweep_once()

    assert outcomes == Counter({"cancelled": 1})
    assert enqueued.jobs == []
    assert fork_store.state(fid).status.value == "cancelled"
    assert redis_client.zscore(KEYS.running, fid) is None


def test_a_fork_cancelled_after_its_revival_is_never_claimed_again(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a fork revived by the sweeper, its job enqueued
    fid, _ = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    enqueued = Enqueued()
    assert make_sweeper(redis_client, enqueued).sweep_once() == Counter({"revive": 1})

    # When the parent cancels before a worker takes the job
    fork_store.cancel(fid)

    # Then the job's claim is refused and the fork stays cancelled
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    assert leases.claim(fid, "worker-b") == Refusal(RefusalReason.NOT_QUEUED, Status.CANCELLED)
    assert fork_store.state(fid).status.value == "cancelled"
    assert event_count(fork_store, fid, "started") == 1


def test_three_concurrent_sweepers_revive_each_of_fifty_expired_forks_exactly_once(
    redis_url: str, redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given fifty forks whose workers died (leases expired)
    forks = dict(make_queued_fork() for _ in range(50))
    claim_and_abandon(redis_client, list(forks))
    enqueued = Enqueued()
    barrier = threading.Barrier(3)
    outcomes: list[Counter[str]] = []
    lock = threading.Lock()

    # When three sweepers, each with its own Redis connection, sweep at the same moment, several passes each
    def sweep() -> None:
        with redis.Redis.from_url(redis_url) as own:
            sweeper = make_sweeper(own, enqueued)
            barrier.wait()
            for _ in range(5):
                counts = sweeper.sweep_once()
                with lock:
                    outcomes.append(counts)

    threads = [threading.Thread(target=sweep) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    # Then each fork was revived once and enqueued once, for attempt 2
    assert sum(outcomes, Counter())["revive"] == 50
    assert Counter(fid for fid, _, _ in enqueued.jobs) == Counter(dict.fromkeys(forks, 1))
    assert all((digest, attempt) == (forks[fid], 2) for fid, digest, attempt in enqueued.jobs)
    assert all(event_count(fork_store, fid, "revived") == 1 for fid in forks)
    assert redis_client.zcard(KEYS.running) == 0


def test_cancels_racing_sweepers_never_resurrect_a_fork(
    redis_url: str, redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given forty expired forks, two sweepers and a parent cancelling every fork, all at once
    forks = dict(make_queued_fork() for _ in range(40))
    claim_and_abandon(redis_client, list(forks))
    enqueued = Enqueued()
    barrier = threading.Barrier(3)

    def sweep() -> None:
        with redis.Redis.from_url(redis_url) as own:
            sweeper = make_sweeper(own, enqueued)
            barrier.wait()
            for _ in range(3):
                sweeper.sweep_once()

    def cancel_all() -> None:
        with redis.Redis.from_url(redis_url) as own:
            store = ForkStore(own, KEYS, ttl_s=3600)
            barrier.wait()
            for fid in forks:
                store.cancel(fid)

    threads = [threading.Thread(target=sweep), threading.Thread(target=sweep), threading.Thread(target=cancel_all)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    # Then every fork is cancelled, revived at most once, and no delivery of its job can claim it
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    for fid in forks:
        assert fork_store.state(fid).status.value == "cancelled", fid
        assert event_count(fork_store, fid, "revived") <= 1
        assert leases.claim(fid, "worker-b") == Refusal(RefusalReason.NOT_QUEUED, Status.CANCELLED)
    assert max(Counter(fid for fid, _, _ in enqueued.jobs).values(), default=0) <= 1


def test_the_sweep_loop_survives_a_redis_outage_and_stops_when_asked(
    fresh_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a sweeper looping over a Redis that goes away and comes back with an expired fork
    client = redis.Redis.from_url(fresh_redis.url, socket_timeout=2)
    store = ForkStore(client, KEYS, ttl_s=3600)
    enqueued = Enqueued()
    sweeper = make_sweeper(client, enqueued)
    stop = threading.Event()
    thread = threading.Thread(target=sweeper.run, args=(stop,))
    thread.start()
    try:
        caplog.set_level(logging.INFO, logger="forkq.sweeper")
        fresh_redis.kill()
        failed = lambda: sum(r.getMessage().startswith("sweep failed") for r in caplog.records) >= 3  # noqa: E731
        wait_until(failed, what="a few sweeps against the dead server")
        assert thread.is_alive()
        fresh_redis.restart()
        record = BootstrapRecord(
            fork_id="f-outage",
            parent_session="s-unit",
            kind="fork",
            seed_chunks=[],
            message_count=0,
            task_prompt="Begin.",
            directive="Do it.",
            description="unit fork",
        )
        data, digest = record.encode()
        store.put_launch(record, data, digest)
        claim_and_abandon(client, ["f-outage"])

        # Then it revives the fork once Redis is back
        wait_until(lambda: enqueued.jobs == [("f-outage", digest, 2)], what="the sweep loop to revive the fork")
    finally:
        stop.set()
        thread.join(10)
        client.close()
    assert not thread.is_alive()


@dataclass
class FlakyBroker(Enqueued):
    """A broker that is down for the first `failures` enqueues (kombu raises OperationalError then)."""

    failures: int = 1

    def __call__(self, fork_id: str, digest: str, attempt: int) -> None:
        with self.lock:
            if self.failures > 0:
                self.failures -= 1
                raise OperationalError("Error 111 connecting to broker: Connection refused.")
        super().__call__(fork_id, digest, attempt)


def test_a_revival_whose_enqueue_failed_is_enqueued_by_a_later_sweep(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given an expired fork, and a broker that is down during the first sweep
    fid, digest = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    broker = FlakyBroker(failures=1)
    sweeper = make_sweeper(redis_client, broker, ttl_ms=SHORT_TTL_MS)
    with contextlib.suppress(OperationalError):
        sweeper.sweep_once()
    assert broker.jobs == []

    # When the broker is back and the sweeper keeps sweeping
    def swept_a_job() -> bool:
        with contextlib.suppress(OperationalError):
            sweeper.sweep_once()
        return bool(broker.jobs)

    def seen() -> str:
        return (
            f"its job: fork is {fork_store.state(fid).status.value}, in the running index: "
            f"{redis_client.zscore(KEYS.running, fid) is not None}; no job was ever enqueued for it"
        )

    wait_until(swept_a_job, 5, seen)

    # Then the fork's job is enqueued after all: a revived fork is never left queued without a job
    assert broker.jobs == [(fid, digest, 2)]


def test_the_sweep_loop_survives_a_broker_outage(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a sweep loop whose first enqueue fails (broker down), and two expired forks
    forks = dict(make_queued_fork() for _ in range(2))
    claim_and_abandon(redis_client, list(forks))
    broker = FlakyBroker(failures=1)
    sweeper = make_sweeper(redis_client, broker, ttl_ms=SHORT_TTL_MS)
    stop = threading.Event()
    crashed: list[BaseException] = []

    def run() -> None:
        try:
            sweeper.run(stop)
        except BaseException as exc:  # the loop must not die; recorded to fail the test with the reason
            crashed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # Then the loop keeps going and both forks end up enqueued
        wait_until(lambda: len(broker.jobs) == 2 or bool(crashed), what="both forks to be enqueued")
    finally:
        stop.set()
        thread.join(10)
    assert crashed == []
    assert sorted(fid for fid, _, _ in broker.jobs) == sorted(forks)


def test_a_sweeper_that_reached_redis_all_along_revives_a_lapsed_lease_at_once_without_the_grace(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given sweepers that have been passing all along, every 10 s: the test's own pauses are far inside the
    # outage gap
    enqueued = Enqueued()
    sweeper = make_sweeper(redis_client, enqueued, interval_s=10.0)
    sweeper.leases.lapse_grace_ms = 60_000
    sweeper.sweep_once()

    # When a worker dies (its lease lapses with no Redis outage), and a pass follows
    fid, digest = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    outcomes = sweeper.sweep_once()

    # Then its fork is revived at that pass, not a minute later: the grace is for outages only
    assert outcomes == Counter({"revive": 1})
    assert enqueued.jobs == [(fid, digest, 2)]


def test_after_no_sweeper_pass_reached_redis_for_a_while_a_lapsed_lease_gets_the_grace(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a sweeper in steady state whose last pass is older than the outage gap (Redis was unreachable)
    enqueued = Enqueued()
    sweeper = make_sweeper(redis_client, enqueued, interval_s=10.0)
    sweeper.leases.lapse_grace_ms = 60_000
    sweeper.sweep_once()
    seconds, micros = redis_client.time()
    gap_ms = int(outage_gap_s(sweeper.interval_s) * 1000)
    redis_client.hset(KEYS.sweep, "last", seconds * 1000 + micros // 1000 - gap_ms - 1)

    # When a lease has lapsed and the sweeper passes again
    fid, _ = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    outcomes = sweeper.sweep_once()

    # Then the fork is left to its worker to take its lease back
    assert outcomes == Counter({"grace": 1})
    assert enqueued.jobs == []


def test_a_sweeper_that_finds_no_earlier_pass_revives_at_once(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given no sweeper pass recorded (a first deployment, or none for a day): no outage to tell of
    enqueued = Enqueued()
    sweeper = make_sweeper(redis_client, enqueued)
    sweeper.leases.lapse_grace_ms = 60_000
    fid, digest = make_queued_fork()
    claim_and_abandon(redis_client, [fid])

    # When the first pass finds a lapsed lease
    outcomes = sweeper.sweep_once()

    # Then it revives the fork at once
    assert outcomes == Counter({"revive": 1})
    assert enqueued.jobs == [(fid, digest, 2)]


# ── the looks at the workers' connections ─────────────────────────────────────────────────────


def looking_sweeper(client: redis.Redis, enqueued: Enqueued, grace_s: float = 0.3) -> Sweeper:
    sweeper = make_sweeper(client, enqueued)
    sweeper.presence = PresenceWatch(client, KEYS, grace_s=grace_s)
    sweeper.presence_s = 0.02
    return sweeper


def test_the_sweep_loop_revives_a_dead_runtimes_fork_long_before_its_lease_ends(
    redis_url: str, redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a runtime's presence and a fork it claimed under a 60 s lease, and a sweep loop that looks
    fid, digest = make_queued_fork()
    presence = Presence(redis.Redis.from_url(redis_url, single_connection_client=True), KEYS, presence_token(), 0.05)
    presence.start()
    leases = Leases(redis_client, KEYS, ttl_ms=60_000, retention_s=3600)
    assert isinstance(leases.claim(fid, owner_token(presence.token)), Claim)
    enqueued = Enqueued()
    stop = threading.Event()
    passes: list[Counter[str]] = []
    thread = threading.Thread(target=looking_sweeper(redis_client, enqueued).run, args=(stop, passes.append))
    thread.start()
    try:
        wait_until(lambda: len(passes) >= 10, what="ten passes of the loop")  # its looks span its grace
        assert enqueued.jobs == []  # alive: nothing to do

        # When the runtime dies: no more pings, and Redis closes its connection
        presence._stop.set()
        redis_client.client_kill_filter(_id=int(redis_client.hget(KEYS.procs, presence.token) or 0))

        # Then the loop revives the fork within a few graces, its lease ended, and forgets the runtime
        wait_until(lambda: enqueued.jobs == [(fid, digest, 2)], timeout=5, what="the dead runtime's fork revived")
        assert redis_client.exists(KEYS.lease(fid)) == 0
        assert [e.data.via for e in fork_store.events(fid) if e.type == "revived"] == ["connection"]
        wait_until(lambda: redis_client.hget(KEYS.procs, presence.token) is None, what="the entry forgotten")
    finally:
        stop.set()
        thread.join(10)
        presence.client.close()


def test_a_redis_user_without_client_list_gets_an_error_naming_the_fix_and_leases_are_still_swept(
    redis_url: str,
    redis_client: redis.Redis,
    make_queued_fork: Callable[..., tuple[str, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a Redis user that may do everything but CLIENT (a managed Redis often refuses it), and an expired fork
    redis_client.acl_setuser("nolist", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"])
    redis_client.execute_command("ACL", "SETUSER", "nolist", "-client")
    limited = redis.Redis.from_url(redis_url.replace("redis://", "redis://nolist:pw@"))
    fid, digest = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    redis_client.hset(KEYS.procs, presence_token(), 424242)  # a worker to look at
    enqueued = Enqueued()
    stop = threading.Event()
    sweeper = looking_sweeper(limited, enqueued)
    thread = threading.Thread(target=sweeper.run, args=(stop,))
    try:
        with caplog.at_level("ERROR", logger="forkq.sweeper"):
            thread.start()
            # Then the lease sweep still revives the fork, the looks are off, with one error naming the fix
            wait_until(lambda: enqueued.jobs == [(fid, digest, 2)], timeout=5, what="the expired fork revived")
            wait_until(lambda: sweeper.presence is None, what="the looks to be turned off")
    finally:
        stop.set()
        thread.join(10)
        limited.close()
        redis_client.acl_deluser("nolist")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "+client|list" in errors[0] and "FORKQ_PRESENCE_CHECK_S=0" in errors[0], errors


def test_a_worker_refused_client_id_stops_its_presence_with_a_warning_naming_the_fix(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    redis_client.acl_setuser("noid", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"])
    redis_client.execute_command("ACL", "SETUSER", "noid", "-client")
    own = redis.Redis.from_url(redis_url.replace("redis://", "redis://noid:pw@"), single_connection_client=True)
    presence = Presence(own, KEYS, presence_token(), interval_s=0.02)
    try:
        with caplog.at_level("WARNING", logger="forkq.presence"):
            presence.start()
            assert presence._thread is not None
            presence._thread.join(timeout=2)
        # the pinger ended (no retry loop against a refusal), nothing is named, and the warning says what to allow
        assert not presence._thread.is_alive()
        assert redis_client.hget(KEYS.procs, presence.token) is None
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "+client|id" in warnings[0], warnings
    finally:
        presence.stop()
        redis_client.acl_deluser("noid")


def test_garbage_in_the_workers_hash_neither_stops_the_looks_nor_the_lease_sweeps(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given entries no worker writes (a value that is no connection id, a huge number) and an expired fork
    redis_client.hset(KEYS.procs, mapping={"host:1:aaaa": "not-an-id", "host:2:bbbb": "9" * 40, "\xff": "-3"})
    fid, digest = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    enqueued = Enqueued()
    stop = threading.Event()
    sweeper = looking_sweeper(redis_client, enqueued)
    thread = threading.Thread(target=sweeper.run, args=(stop,))
    thread.start()
    try:
        # Then the loop still revives the fork, and the looks go on over the entries it can read
        wait_until(lambda: enqueued.jobs == [(fid, digest, 2)], timeout=5, what="the expired fork revived")
        assert sweeper.presence is not None
        assert sweeper.presence.dead() == []
    finally:
        stop.set()
        thread.join(10)


def test_a_look_that_fails_never_keeps_expired_leases_from_being_swept(
    redis_client: redis.Redis, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a sweeper whose every look at the workers' connections fails, and an expired fork
    fid, digest = make_queued_fork()
    claim_and_abandon(redis_client, [fid])
    enqueued = Enqueued()
    sweeper = looking_sweeper(redis_client, enqueued)

    class Broken(PresenceWatch):
        def dead(self) -> list[tuple[str, int]]:
            raise redis.ConnectionError("the look's connection dropped")

    sweeper.presence = Broken(redis_client, KEYS, grace_s=0.3)
    stop = threading.Event()
    thread = threading.Thread(target=sweeper.run, args=(stop,))
    thread.start()
    try:
        # Then the lease sweep revives the fork all the same
        wait_until(lambda: enqueued.jobs == [(fid, digest, 2)], timeout=5, what="the expired fork revived")
    finally:
        stop.set()
        thread.join(10)

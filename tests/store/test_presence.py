"""Worker presence on a real Redis: a runtime's named connection, and the sweeper's look at which are gone."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest
import redis

from tests.conftest import TEST_NAMESPACE
from tests.live import wait_until
from workers.base.keys import Keys
from workers.demo.redis_server import RedisServer
from workers.store.presence import Presence, PresenceWatch, owner_mark, owner_token, owns, presence_token

KEYS = Keys(TEST_NAMESPACE)
GRACE_S = 0.6


@pytest.fixture
def presences() -> Iterator[list[Presence]]:
    """Presences started by the test, stopped after it."""
    started: list[Presence] = []
    yield started
    for presence in started:
        presence.stop()


def start_presence(url: str, started: list[Presence], interval_s: float = 0.05) -> Presence:
    """A runtime's presence: a client holding one connection of its own, named and pinged."""
    own = redis.Redis.from_url(url, single_connection_client=True)
    presence = Presence(own, KEYS, presence_token(), interval_s=interval_s)
    presence.start()
    started.append(presence)
    return presence


def watch_for(watch: PresenceWatch, seconds: float) -> list[tuple[str, int]]:
    """Look every 50 ms for `seconds`; every runtime reported dead (Redis errors count as no report)."""
    dead: list[tuple[str, int]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.ConnectionError):
            dead += watch.dead()
        time.sleep(0.05)  # not a synchronization: the watch's pace over the period the test observes
    return dead


def named_id(client: redis.Redis, presence: Presence) -> int:
    return int(client.hget(KEYS.procs, presence.token) or 0)


def test_an_owner_token_names_its_runtimes_presence_and_its_own_process() -> None:
    token = presence_token()
    owner = owner_token(token)
    assert owns(token, owner)
    assert not owns(presence_token(), owner)
    assert owner_token(token) != owner
    assert int(owner.split(":")[1]) == os.getpid()
    # an owner token written before presence existed (host:pid:thread:random) is owned by no presence
    assert owner_mark("host:12:140000:0123456789ab") is None
    assert owner_mark("not-a-token") is None
    assert owner_mark("host:12:140000:.abc") is None
    assert not owns(token, "host:12:140000:0123456789ab")


def test_a_live_runtime_is_never_reported_dead(
    redis_url: str, redis_client: redis.Redis, presences: list[Presence]
) -> None:
    # Given a runtime's presence and a sweeper's watch with a short grace
    presence = start_presence(redis_url, presences)
    watch = PresenceWatch(redis_client, KEYS, grace_s=GRACE_S)

    # When the sweeper looks for three graces
    dead = watch_for(watch, 3 * GRACE_S)

    # Then it never reports the runtime, whose entry names its open connection
    assert dead == []
    assert named_id(redis_client, presence) in {int(c["id"]) for c in redis_client.client_list()}


def test_a_runtime_whose_connection_closed_for_good_is_reported_after_the_grace_and_not_before(
    redis_url: str, redis_client: redis.Redis, presences: list[Presence]
) -> None:
    # Given a runtime's presence, seen alive by a sweeper's watch
    presence = start_presence(redis_url, presences)
    watch = PresenceWatch(redis_client, KEYS, grace_s=GRACE_S)
    assert watch.dead() == []
    cid = named_id(redis_client, presence)

    # When the runtime dies: its thread stops pinging, and Redis closes its connection
    presence._stop.set()
    assert presence._thread is not None
    presence._thread.join()
    redis_client.client_kill_filter(_id=cid)
    gone_at = time.monotonic()

    # Then the watch reports it once the grace has passed, and not earlier
    reported = wait_until(watch.dead, 5 * GRACE_S, "the watch to report the dead runtime")
    assert reported == [(presence.token, cid)]
    assert time.monotonic() - gone_at >= GRACE_S
    # and once forgotten, its entry is gone and it is not reported again
    watch.forget(presence.token, cid)
    assert redis_client.hget(KEYS.procs, presence.token) is None
    assert watch.dead() == []


def test_a_runtime_whose_connection_is_killed_again_and_again_names_its_new_one_and_is_never_reported(
    redis_url: str, redis_client: redis.Redis, presences: list[Presence]
) -> None:
    # Given a runtime's presence (pinging every 200 ms, as a worker's does with the default 1 s grace)
    presence = start_presence(redis_url, presences, interval_s=GRACE_S / 5)
    watch = PresenceWatch(redis_client, KEYS, grace_s=GRACE_S)
    first = named_id(redis_client, presence)

    # When its connection is killed every 100 ms for two graces, while the watch looks
    deadline = time.monotonic() + 2 * GRACE_S
    dead: list[tuple[str, int]] = []
    while time.monotonic() < deadline:
        redis_client.client_kill_filter(_id=named_id(redis_client, presence))
        time.sleep(0.1)  # not a synchronization: the fault's rhythm, a kill every 100 ms
        dead += watch.dead()
    dead += watch_for(watch, GRACE_S)

    # Then the runtime named each new connection, and the watch never reported it
    assert dead == []
    assert named_id(redis_client, presence) != first
    assert named_id(redis_client, presence) in {int(c["id"]) for c in redis_client.client_list()}


def test_a_removed_entry_comes_back_while_the_runtime_lives(
    redis_url: str, redis_client: redis.Redis, presences: list[Presence]
) -> None:
    # Given a runtime's presence whose entry a sweeper removed (it took a drop for a death)
    presence = start_presence(redis_url, presences, interval_s=0.01)
    cid = named_id(redis_client, presence)
    redis_client.hdel(KEYS.procs, presence.token)

    # Then the runtime names its connection again within its pings
    wait_until(lambda: redis_client.hget(KEYS.procs, presence.token) is not None, 3, "the entry named again")
    assert named_id(redis_client, presence) == cid


def test_a_runtime_that_stops_removes_its_entry_but_not_a_newer_one(
    redis_url: str, redis_client: redis.Redis, presences: list[Presence]
) -> None:
    # Given two presences, the second under the first's token after the first named itself
    first = start_presence(redis_url, presences)
    second = start_presence(redis_url, [], interval_s=10)
    assert named_id(redis_client, first) != 0

    # When the first stops, its entry goes
    first.stop()
    presences.remove(first)
    assert redis_client.hget(KEYS.procs, first.token) is None

    # and an entry naming another connection is left alone by a stale forget
    redis_client.hset(KEYS.procs, second.token, 424242)
    second.stop()
    assert named_id(redis_client, second) == 424242


def test_a_redis_restart_reports_no_runtime_that_reconnects(redis_executable: str, presences: list[Presence]) -> None:
    # Given a Redis of its own with AOF on (the entries survive the restart, naming connections that do not)
    with RedisServer(executable=redis_executable, appendonly=True) as server:
        client = redis.Redis.from_url(server.url)
        presence = start_presence(server.url, presences, interval_s=GRACE_S / 5)
        watch = PresenceWatch(client, KEYS, grace_s=GRACE_S)
        assert watch.dead() == []

        # When Redis is killed and restarted, while the watch looks before, during and after
        server.kill()
        dead = watch_for(watch, 0.5)
        server.restart()
        dead += watch_for(watch, 3 * GRACE_S)

        # Then the runtime named its new connection, and nothing was reported
        assert dead == []
        assert named_id(client, presence) in {int(c["id"]) for c in client.client_list()}
        presence.stop()
        presences.remove(presence)
        client.close()

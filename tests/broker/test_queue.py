"""workers.broker.queue: a re-sent fork's job reaches the broker first, and only then leaves the running index."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis
from kombu.exceptions import OperationalError

from broker_config.settings import Settings
from workers.base.keys import Keys
from workers.broker.queue import enqueue_again
from workers.broker.sender import sender_app
from workers.store.forks import ForkStore
from workers.store.lease import Leases


def running_fork(
    redis_client: redis.Redis, settings: Settings, make_queued_fork: Callable[..., tuple[str, str]]
) -> tuple[str, str, Leases]:
    """A queued fork still in the running index, as a revival, a release or a decision leaves it."""
    fork_id, digest = make_queued_fork()
    keys = Keys(settings.namespace)
    redis_client.zadd(keys.running, {fork_id: 0})
    return fork_id, digest, Leases(redis_client, keys, ttl_ms=10_000, retention_s=3600)


def test_enqueue_again_sends_the_job_then_takes_the_fork_out_of_the_running_index(
    settings: Settings,
    redis_client: redis.Redis,
    fork_store: ForkStore,
    make_queued_fork: Callable[..., tuple[str, str]],
) -> None:
    fork_id, digest, leases = running_fork(redis_client, settings, make_queued_fork)
    app = sender_app(settings)
    try:
        enqueue_again(app, fork_id, digest, 2, queue=settings.queue, store=fork_store, leases=leases)
    finally:
        app.close()

    # the job is on the queue under the broker's task name, task id `<fork id>.<attempt>`
    items = redis_client.lrange(settings.queue, 0, -1)
    assert len(items) == 1
    headers = json.loads(items[0])["headers"]
    assert (headers["task"], headers["id"]) == ("forkq.run_fork", f"{fork_id}.2")
    assert "unit fork" in headers["argsrepr"]  # the Flower row names the fork's description
    assert redis_client.zscore(leases.keys.running, fork_id) is None


def test_a_job_the_broker_refuses_leaves_the_fork_in_the_running_index_for_a_sweeper(
    make_settings: Callable[..., Settings],
    redis_client: redis.Redis,
    fork_store: ForkStore,
    make_queued_fork: Callable[..., tuple[str, str]],
) -> None:
    settings = make_settings(broker_url="redis://127.0.0.1:1/0")  # nothing listens there
    fork_id, digest, leases = running_fork(redis_client, settings, make_queued_fork)
    app = sender_app(settings)
    try:
        with pytest.raises(OperationalError):
            enqueue_again(app, fork_id, digest, 2, queue=settings.queue, store=fork_store, leases=leases)
    finally:
        app.close()

    assert redis_client.zscore(leases.keys.running, fork_id) is not None

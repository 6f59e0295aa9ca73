"""forkq's broker connection: kombu's Redis transports, one Redis client per channel, URLs unchanged."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery
from conftest import PARENT_PATH, TEST_NAMESPACE, TEST_QUEUE, WorkerProcess
from kombu import Exchange, Producer, Queue
from kombu.transport import redis as kombu_redis
from live import stop_redis, wait_until

from broker_config.connection import ForkqConnection, RedisTransport, SentinelTransport
from broker_config.settings import Settings
from workers.app import make_app
from workers.client import ForkClient
from workers.records import Status
from workers.redis_server import RedisServer

SENTINELS = "sentinel://:pw@s1:26379;sentinel://s2:26379"
FORK = {"description": "broker restart", "prompt": "Report back.", "subagent_type": "fork", "fork_turns": "1"}


@pytest.mark.parametrize(
    ("url", "transport", "uri"),
    [
        ("redis://:pw@broker.internal:6380/2", RedisTransport, "redis://:**@broker.internal:6380/2"),
        ("rediss://:pw@broker.internal:6380/2", RedisTransport, "rediss://:**@broker.internal:6380/2"),
        ("redis+socket:///run/redis.sock", RedisTransport, "redis+socket:///run/redis.sock"),
        (SENTINELS, SentinelTransport, "sentinel://:**@s1:26379//"),
    ],
)
def test_every_connection_of_the_app_uses_forkqs_transport_and_names_the_urls_scheme(
    make_settings: Callable[..., Settings], url: str, transport: type, uri: str
) -> None:
    # Given forkq's app on each broker URL form
    app = make_app(make_settings(broker_url=url))

    # When Celery makes its connections: the worker's, the events', the producer pool's, and copies of them
    read, write = app.connection_for_read(), app.connection_for_write()
    from_pool = app.pool.acquire(block=False)
    connections = [read, write, from_pool, write.clone(), copy.copy(write)]

    # Then each one runs forkq's subclass of kombu's transport for the scheme
    assert issubclass(transport, kombu_redis.Transport)
    assert [c.get_transport_cls() for c in connections] == [transport] * len(connections)
    # and names the scheme the operator gave where Flower, the worker banner and logs read it
    for connection in connections:
        assert connection.as_uri() == uri
        assert json.loads(json.dumps(connection.info()))["transport"] == uri.split(":", 1)[0].split("+", maxsplit=1)[0]
    from_pool.release()


def test_rediss_keeps_kombus_tls_defaults(make_settings: Callable[..., Settings]) -> None:
    app = make_app(make_settings(broker_url="rediss://:pw@broker.internal:6380/0"))

    connection = app.connection_for_write()

    assert connection.ssl  # kombu's default for rediss:// without options: TLS, unverified (it warns)
    assert connection.as_uri(include_password=True) == "rediss://:pw@broker.internal:6380/0"


def test_a_channel_publishes_through_one_client_until_its_pool_is_replaced(settings: Settings) -> None:
    # Given a channel of forkq's connection to a real Redis
    connection = ForkqConnection(settings.effective_broker_url)
    channel = connection.channel()
    queue = Queue("forkq-test-conn", Exchange("forkq-test-conn", type="direct"), routing_key="k")
    producer = Producer(channel, exchange=queue.exchange, routing_key="k", serializer="json")
    queue(channel).declare()
    try:
        # When it publishes 50 messages
        first = channel._create_client()
        for i in range(50):
            producer.publish({"n": i})

        # Then all arrive, through the one client the channel built
        assert channel._create_client() is first
        assert redis.Redis.from_url(settings.redis_url).llen("forkq-test-conn") == 50

        # and a channel whose pool was replaced (a reconnect) builds a client on the new pool
        channel._pool = None
        assert channel._create_client() is not first
        assert channel._create_client().connection_pool is channel.pool
    finally:
        redis.Redis.from_url(settings.redis_url).delete("forkq-test-conn")
        connection.release()


def test_a_bare_celery_app_in_the_same_process_keeps_kombus_own_transport(settings: Settings) -> None:
    # forkq's transport is the app's choice, not a change to kombu: another app is untouched
    other = Celery("other", broker=settings.effective_broker_url, set_as_current=False)
    make_app(settings)

    assert other.connection_for_write().get_transport_cls() is kombu_redis.Transport


def test_a_tls_app_and_a_plain_app_on_one_host_never_share_a_connection_pool(
    make_settings: Callable[..., Settings],
) -> None:
    # Given two apps in one process on the same host and port, one of them over TLS
    plain = make_app(make_settings(broker_url="redis://:pw@broker.internal:6380/2"))
    tls = make_app(make_settings(broker_url="rediss://:pw@broker.internal:6380/2"))

    # When each takes a connection from kombu's process-wide pools (plain first)
    plain_conn, tls_conn = plain.pool.acquire(block=False), tls.pool.acquire(block=False)

    # Then the TLS app's pooled connection is its own, with TLS on
    assert plain.pool is not tls.pool
    assert (plain_conn.ssl, bool(tls_conn.ssl)) == (False, True)
    assert tls_conn.as_uri().startswith("rediss://")
    plain_conn.release()
    tls_conn.release()


@pytest.mark.slow
@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_a_worker_with_a_fork_in_flight_keeps_running_through_a_broker_restart(
    fresh_redis: RedisServer, worker_process: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    # Given a worker whose broker is its own Redis, running a fork (its job unacknowledged: acks_late)
    script = tmp_path / "script.json"
    reply = {"role": "model", "parts": [{"text": "done"}]}
    script.write_text(json.dumps({"steps": [{"delay_s": 4.0, "content": reply}]}), encoding="utf-8")
    settings = Settings(redis_url=fresh_redis.url, namespace=TEST_NAMESPACE, queue=TEST_QUEUE)
    worker = worker_process(FORKQ_REDIS_URL=fresh_redis.url, FORKQ_SCRIPT=str(script))
    app = make_app(settings)
    with ForkClient(settings, app=app) as client:
        parent = json.loads(PARENT_PATH.read_text(encoding="utf-8"))
        first = client.launch(parent, FORK)
        wait_until(lambda: any(e.type == "model_call" for e in first.events()), 30, "the fork to start")

        # When Redis stops and starts again: Celery loses its broker connection, closes its channels (whose
        # unacked message cannot be restored while Redis is down) and reconnects
        stop_redis(fresh_redis)
        time.sleep(1.0)
        fresh_redis.restart()

        # Then the worker lives on: the fork in flight finishes, and a fork launched afterwards runs too
        second = client.launch(parent, FORK)
        for handle in (first, second):
            ended = lambda h=handle: worker.process.poll() is not None or client.result(h.fork_id) is not None  # noqa: E731
            wait_until(ended, 60, f"fork {handle.fork_id} to end")
            assert worker.process.poll() is None, f"the worker exited:\n{worker.log()}"
            result = client.result(handle.fork_id)
            assert result is not None and result.status is Status.SUCCEEDED, worker.log()
    app.close()
    assert "Unrecoverable error" not in worker.log()

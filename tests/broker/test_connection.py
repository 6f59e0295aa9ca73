"""forkq's broker connection: kombu's Redis transports, one Redis client per channel, URLs unchanged."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Exchange, Producer, Queue
from kombu.transport import redis as kombu_redis

from broker_config.settings import Settings
from tests.conftest import PARENT_PATH, TEST_NAMESPACE, TEST_QUEUE, WorkerProcess
from tests.live import job_body, kombu_envelope, stop_redis, wait_until
from workers.app import make_app
from workers.base.keys import Keys
from workers.broker.connection import (
    DEAD_ITEMS_MAX,
    DEAD_ITEMS_TTL_S,
    MAX_ENVELOPE_BYTES,
    ForkqConnection,
    RedisTransport,
    Rejected,
    SentinelTransport,
)
from workers.client import ForkClient
from workers.demo.redis_server import RedisServer
from workers.records.fork import Status

SENTINELS = "sentinel://:pw@s1:26379;sentinel://s2:26379"
FORK = {"description": "list files", "prompt": "List the files.", "subagent_type": "fork", "fork_turns": "1"}


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


# ── what reaches a worker's queue: items that are not Celery envelopes, compressed bodies ──────


def _envelope(**changes: Any) -> bytes:
    """A kombu envelope of a well-formed `run_fork` body, with top-level fields changed or removed (None)."""
    envelope = json.loads(kombu_envelope(job_body("f-garbage", "0" * 64, None), queue=TEST_QUEUE, task_id="t-1"))
    for name, value in changes.items():
        if value is None:
            envelope.pop(name, None)
        else:
            envelope[name] = value
    return json.dumps(envelope).encode()


def _with(section: str, **changes: Any) -> bytes:
    """A kombu envelope whose `properties` or `headers` have fields changed."""
    envelope = json.loads(_envelope())
    envelope[section] = {**envelope[section], **changes}
    return json.dumps(envelope).encode()


NOT_ENVELOPES: dict[str, bytes] = {
    "not JSON": b"not json",
    "a JSON array": b"[1,2,3]",
    "a JSON string": b'"a string"',
    "not UTF-8": b"\xff\xfe{}",
    "JSON nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "a kombu type marker kombu cannot decode": b'{"__type__": "nope", "__value__": 1}',
    "an object that is no envelope": b'{"hello": "world"}',
    "properties that are not an object": _envelope(properties=[1]),
    "no delivery tag": _with("properties", delivery_tag=None),
    "delivery_info that is not an object": _with("properties", delivery_info="x"),
    "an unknown body encoding": _with("properties", body_encoding="rot13"),
    "a body that is not base64": _envelope(body="!!not base64!!"),
    "a body that is not a string": _envelope(body=12345),
    "headers that are not an object": _envelope(headers=["task"]),
    "a task name that is not a string": _with("headers", task=["forkq.run_fork"]),
    "a task id that is not a string": _with("headers", id={"a": 1}),
    "a pickle body": _envelope(**{"content-type": "application/x-python-serialize"}),
    "an unknown content type": _envelope(**{"content-type": "application/x-unknown"}),
    "a content type that is not a string": _envelope(**{"content-type": 7}),
}


def _dead_letters(redis_client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in redis_client.lrange(Keys(TEST_NAMESPACE).dead_letters, 0, -1)]


def _raw_of(letter: dict[str, Any]) -> bytes:
    if "raw" in letter:
        return str(letter["raw"]).encode()
    return base64.b64decode(letter.get("raw_base64", ""))


@pytest.mark.slow
def test_a_worker_keeps_serving_after_queue_items_that_are_not_celery_envelopes(
    client: ForkClient,
    worker_process: Callable[..., WorkerProcess],
    redis_client: redis.Redis,
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given a worker process running a fork of a few slow steps
    script = tmp_path / "script.json"
    call = {"functionCall": {"id": "ls", "name": "list_directory", "args": {"path": "."}}}
    steps = [{"delay_s": 0.5, "content": {"role": "model", "parts": [call]}} for _ in range(4)]
    script.write_text(json.dumps({"steps": steps}))
    worker = worker_process(FORKQ_PROVIDER="scripted", FORKQ_SCRIPT=str(script))
    running = client.launch({**parent, "cwd": str(tmp_path)}, FORK)
    wait_until(lambda: running.status().status is Status.RUNNING, 30, "the first fork to run")

    # When items that are not Celery envelopes reach its queue, and its control channel (broadcast, pidbox)
    for item in NOT_ENVELOPES.values():
        redis_client.lpush(TEST_QUEUE, item)
    control = (b'{"no": "envelope"}', b"[1]")
    for item in control:
        redis_client.publish("/0.celery.pidbox", item)
    wait_until(lambda: redis_client.llen(TEST_QUEUE) == 0 or worker.process.poll() is not None, 30, "the items taken")
    assert worker.process.poll() is None, f"the worker exited with {worker.process.poll()}:\n{worker.log()[-3000:]}"

    # Then the worker process still serves: a fork launched afterwards succeeds on it
    after = client.launch({**parent, "cwd": str(tmp_path)}, FORK)
    assert after.wait(timeout=60).status is Status.SUCCEEDED, worker.log()[-3000:]
    assert worker.process.poll() is None, worker.log()[-3000:]
    assert "Unrecoverable error" not in worker.log()
    assert "Connection to broker lost" not in worker.log()  # what a bad control message did: a reconnect
    # and the fork that ran meanwhile was untouched: it succeeded on its first attempt
    result = running.wait(timeout=60)
    assert (result.status, running.status().attempt) == (Status.SUCCEEDED, 1), result.error
    # and every item is in the dead letters, its bytes kept (the first 64 KiB), with a reason naming the fault
    letters = _dead_letters(redis_client)
    for what, item in NOT_ENVELOPES.items():
        kept = [letter for letter in letters if _keeps(letter, item)]
        assert len(kept) == 1, f"{what}: not dead-lettered; dead letters: {[letter['reason'] for letter in letters]}"
        assert kept[0]["queue"] == TEST_QUEUE and kept[0]["reason"], (what, kept)
    # and so is every control message, under the worker's control queue
    others = [letter for letter in letters if letter["queue"] != TEST_QUEUE]
    assert sorted(_raw_of(letter) for letter in others) == sorted(control), others
    assert all(letter["queue"].endswith(".celery.pidbox") for letter in others), others
    assert len(letters) == len(NOT_ENVELOPES) + len(control), [letter["reason"] for letter in letters]


@pytest.mark.slow
def test_a_worker_starts_and_serves_when_the_unacked_hash_holds_entries_kombu_did_not_write(
    client: ForkClient,
    worker_process: Callable[..., WorkerProcess],
    redis_client: redis.Redis,
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given entries in kombu's unacked hash, past their visibility timeout, that are not kombu's JSON
    entries = {"evil-1": b"not json", "evil-2": b"[1]"}
    redis_client.hset("unacked", mapping=entries)
    redis_client.zadd("unacked_index", dict.fromkeys(entries, 1))

    # When a worker starts (it restores unacked messages whose timeout passed)
    worker = worker_process(FORKQ_PROVIDER="scripted")
    handle = client.launch({**parent, "cwd": str(tmp_path)}, FORK)

    # Then it serves, and the entries are out of kombu's hash and in the dead letters
    assert handle.wait(timeout=60).status is Status.SUCCEEDED, worker.log()[-3000:]
    wait_until(lambda: len(_dead_letters(redis_client)) == len(entries), 30, "the entries to be dead-lettered")
    assert worker.process.poll() is None and "Unrecoverable error" not in worker.log(), worker.log()[-3000:]
    assert sorted(_raw_of(letter) for letter in _dead_letters(redis_client)) == sorted(entries.values())
    assert {letter["queue"] for letter in _dead_letters(redis_client)} == {"unacked"}
    # (the fork's own job may still be unacked for a moment: its ack follows its result)
    assert redis_client.hmget("unacked", list(entries)) == [None] * len(entries)
    assert [redis_client.zscore("unacked_index", tag) for tag in entries] == [None] * len(entries)


def _keeps(letter: dict[str, Any], item: bytes) -> bool:
    """The dead letter holds `item`: all of it, or its first bytes and its size."""
    raw = _raw_of(letter)
    return letter.get("raw_bytes") == len(item) and (raw == item or (letter["raw_truncated"] and item.startswith(raw)))


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _settled_worker(
    client: ForkClient, worker_process: Callable[..., WorkerProcess], parent: dict[str, Any], tmp_path: Path
) -> tuple[WorkerProcess, int]:
    """A worker process that has run one fork, and its peak resident size (KiB) by then."""
    worker = worker_process(FORKQ_PROVIDER="scripted")
    first = client.launch({**parent, "cwd": str(tmp_path)}, FORK)
    assert first.wait(timeout=60).status is Status.SUCCEEDED, worker.log()[-3000:]
    return worker, _rss_kib(worker.process.pid, "VmHWM")


@pytest.mark.slow
def test_a_compressed_bomb_is_dead_lettered_before_it_is_inflated(
    client: ForkClient,
    worker_process: Callable[..., WorkerProcess],
    redis_client: redis.Redis,
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given an idle worker process that has run a fork (so its resident size has settled)
    worker, idle_kib = _settled_worker(client, worker_process, parent, tmp_path)

    # When a ~255 KiB message that inflates to 256 MiB reaches its queue (gzip, as kombu names zlib)
    bomb = zlib.compress(b"\0" * (256 * 1024 * 1024), 9)
    assert len(bomb) < 300 * 1024
    envelope = json.loads(kombu_envelope(bomb, queue=TEST_QUEUE, task_id="bomb-1"))
    envelope["headers"]["compression"] = "application/x-gzip"
    item = json.dumps(envelope).encode()
    redis_client.lpush(TEST_QUEUE, item)

    # Then the worker handles it (before forkq refused it, Celery logged a decode error after inflating it)
    handled = ("Can't decode message body", "Unrecoverable error")
    wait_until(lambda: bool(_dead_letters(redis_client)) or any(h in worker.log() for h in handled), 60, "the bomb")
    # without ever growing past twice its idle size
    peak_kib = _rss_kib(worker.process.pid, "VmHWM")
    assert peak_kib <= 2 * idle_kib, f"peak RSS {peak_kib:,} KiB, idle {idle_kib:,} KiB"
    # and it is dead-lettered, with the reason
    wait_until(lambda: bool(_dead_letters(redis_client)), 15, "the bomb to be dead-lettered")
    [letter] = _dead_letters(redis_client)
    assert letter["task_id"] == "bomb-1" and "compress" in letter["reason"], letter
    assert letter["raw_bytes"] == len(item) and letter["raw_truncated"] is True
    # and it keeps serving
    after = client.launch({**parent, "cwd": str(tmp_path)}, FORK)
    assert after.wait(timeout=60).status is Status.SUCCEEDED, worker.log()[-3000:]
    assert worker.process.poll() is None


def _array32(items: bytes, n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + items


def _empty_arrays_body() -> bytes:
    """An 8 MiB Celery body `[[[], [], ...] x 1,000, {}, {}]`: each byte an empty array, a Python list each."""
    inner = _array32(b"\x90" * 8_000, 8_000)
    return b"\x93" + _array32(inner * 1_000, 1_000) + b"\x80\x80"


def _braces_envelope() -> bytes:
    """A job envelope with an extra top-level key holding 11 MiB of `{}`s, a Python dict each."""
    envelope = json.loads(kombu_envelope(job_body("f-braces", "0" * 64, None), queue=TEST_QUEUE, task_id="braces-1"))
    return json.dumps(envelope)[:-1].encode() + b', "x": [' + b"{}," * (11 * 1024 * 1024 // 3) + b"{}]}"


@pytest.mark.slow
def test_items_that_would_build_millions_of_objects_are_dead_lettered_before_they_are_built(
    client: ForkClient,
    worker_process: Callable[..., WorkerProcess],
    redis_client: redis.Redis,
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given an idle worker process that has run a fork (so its resident size has settled)
    worker, idle_kib = _settled_worker(client, worker_process, parent, tmp_path)

    # When items within the envelope size limit reach its queue whose parsing would build millions of
    # objects: a msgpack body of empty arrays (right task, right id) and a JSON envelope of `{}`s
    arrays = kombu_envelope(_empty_arrays_body(), queue=TEST_QUEUE, task_id="arrays-1")
    items = {"arrays-1": arrays, "braces-1": _braces_envelope()}
    for item in items.values():
        assert len(item) <= MAX_ENVELOPE_BYTES
        redis_client.lpush(TEST_QUEUE, item)
    after = client.launch({**parent, "cwd": str(tmp_path)}, FORK)

    # Then the worker refuses both and serves the next fork
    assert after.wait(timeout=120).status is Status.SUCCEEDED, worker.log()[-3000:]
    wait_until(lambda: len(_dead_letters(redis_client)) >= len(items), 30, "the items to be dead-lettered")
    # without ever growing past twice its idle size
    peak_kib = _rss_kib(worker.process.pid, "VmHWM")
    assert peak_kib <= 2 * idle_kib, f"peak RSS {peak_kib:,} KiB, idle {idle_kib:,} KiB"
    # and each is dead-lettered with the reason
    reasons = {letter.get("task_id"): letter["reason"] for letter in _dead_letters(redis_client)}
    assert "arrays and maps" in reasons.get("arrays-1", ""), reasons
    assert "`[` and `{`" in str(reasons), reasons
    assert worker.process.poll() is None and "Unrecoverable error" not in worker.log()


def _dead_items(broker: redis.Redis) -> list[tuple[dict[str, Any], bytes]]:
    """The broker's list of refused items: (their JSON line, their bytes)."""
    entries = broker.lrange(Keys(TEST_NAMESPACE).dead_items, 0, -1)
    return [(json.loads(meta), raw) for meta, _, raw in (entry.partition(b"\n") for entry in entries)]


@pytest.mark.slow
def test_a_refused_item_is_kept_whole_on_the_broker_while_the_records_redis_is_down(
    *,
    make_settings: Callable[..., Settings],
    fresh_redis: RedisServer,
    worker_process: Callable[..., WorkerProcess],
    redis_client: redis.Redis,
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given a worker whose records are on one Redis and whose broker is another, serving
    settings = make_settings(redis_url=fresh_redis.url, broker_url=make_settings().redis_url)
    env = {"FORKQ_REDIS_URL": fresh_redis.url, "FORKQ_BROKER_URL": settings.effective_broker_url}
    worker = worker_process(**env, FORKQ_HEARTBEAT_FILE=str(tmp_path / "heartbeat"))
    app = make_app(settings)
    with ForkClient(settings, app=app) as client, contextlib.closing(app):
        first = client.launch({**parent, "cwd": str(tmp_path)}, FORK)
        assert first.wait(timeout=60).status is Status.SUCCEEDED, worker.log()[-3000:]

    # When the records Redis is down and items that are not jobs reach the queue, one of 1 MiB
    fresh_redis.kill()
    items = [b"not json", b"\xff" + b"x" * (1024 * 1024)]
    for item in items:
        redis_client.lpush(TEST_QUEUE, item)
    wait_until(lambda: len(_dead_items(redis_client)) == len(items), 60, "the items kept on the broker")

    # Then each is kept whole on the broker, with the reason, and the worker still runs
    kept = {raw: meta for meta, raw in _dead_items(redis_client)}
    assert sorted(kept) == sorted(items)
    for item in items:
        assert kept[item]["queue"] == TEST_QUEUE and kept[item]["raw_bytes"] == len(item), kept[item]
        assert "not JSON" in kept[item]["reason"] and kept[item]["raw_truncated"] is False, kept[item]
    assert 0 < redis_client.ttl(Keys(TEST_NAMESPACE).dead_items) <= DEAD_ITEMS_TTL_S
    assert worker.process.poll() is None, worker.log()[-3000:]


def test_the_brokers_list_of_refused_items_keeps_the_newest_few(settings: Settings, redis_client: redis.Redis) -> None:
    # Given forkq's app and a channel of its broker connection
    app = make_app(settings)
    with contextlib.closing(app), app.connection_for_read() as connection:
        channel = connection.default_channel

        # When it refuses more items than the list keeps
        for n in range(DEAD_ITEMS_MAX + 5):
            channel._reject(Rejected.of(TEST_QUEUE, f"item {n}".encode(), "not JSON"))

    # Then the list holds the newest ones only, each whole
    assert [raw for _, raw in _dead_items(redis_client)] == [
        f"item {n}".encode() for n in reversed(range(5, DEAD_ITEMS_MAX + 5))
    ]


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
        time.sleep(1.0)  # not a synchronization: the outage, a fault injected for this long
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

"""A launch queues its own job: the envelope is what `send_task` writes, and the launch script queues it safely."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from broker_config.settings import Settings
from workers.base.codec import decode_message
from workers.base.keys import Keys
from workers.broker.envelope import JobEnvelopes, QueuedJob
from workers.broker.queue import run_fork_call, send_call
from workers.broker.sender import sender_app
from workers.client import ForkClient
from workers.history.selection import ForkSeed, build_fork_seed
from workers.history.snapshot import parse_parent_snapshot
from workers.records.fork import BootstrapRecord, chunk_digest, split_seed
from workers.store.forks import ForkStore

QUEUE = "env-jobs"


@pytest.fixture
def seed(parent: dict[str, Any]) -> ForkSeed:
    return build_fork_seed(parse_parent_snapshot(parent).history, fork_turns="3", directive="Write the tests.")


def launch(store: ForkStore, seed: ForkSeed, fork_id: str) -> tuple[BootstrapRecord, list[bytes]]:
    """A fork launched the way a client launches one, without a job: its record and seed chunks."""
    chunks = split_seed(seed.initial_messages)
    record = BootstrapRecord(
        fork_id=fork_id,
        parent_session="s-1",
        kind="fork",
        seed_chunks=[chunk_digest(c) for c in chunks],
        message_count=len(seed.initial_messages),
        task_prompt=seed.task_prompt,
        directive="Write the tests.",
        description="tests",
    )
    store.put_launch(record, *record.encode(), chunks)
    return record, chunks


def _call(record: bytes | None = b"\x81\xa1a\x01") -> tuple[str, list[Any], str]:
    chunks = [b"context", b"chunk one"]
    return run_fork_call(
        "f-env", "ab" * 32, attempt=1, seed_chunks=chunks, record=record, description="d", parent_session="s"
    )


def _envelope(item: bytes) -> dict[str, Any]:
    envelope = json.loads(item)
    envelope["properties"].pop("delivery_tag")
    return envelope


def _sent_event(item: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    envelope = _envelope(item)
    body = json.loads(base64.b64decode(envelope.pop("body")))
    return envelope, body


@pytest.fixture
def sender(settings: Settings) -> Celery:
    return sender_app(settings)


@pytest.mark.parametrize("record", [None, b"\x81\xa1a\x01"])
def test_the_job_is_the_item_send_task_puts_on_the_queue(
    sender: Celery, redis_client: redis.Redis, record: bytes | None
) -> None:
    # Given a job sent by Celery's own send_task
    call = _call(record)
    send_call(sender, QUEUE, call)
    [theirs] = redis_client.lrange(QUEUE, 0, -1)

    # When the envelope of the same call is built
    envelopes = JobEnvelopes.for_app(sender, QUEUE, redis_client)
    assert envelopes is not None
    ours = envelopes.run_fork("forkq.run_fork", *call)

    # Then it goes to the same list and is the same message, delivery tag aside (a fresh uuid each)
    assert ours.queue_key == QUEUE
    assert _envelope(ours.item) == _envelope(theirs)
    body = decode_message(base64.b64decode(json.loads(ours.item)["body"]), sender_bounds())
    assert body == [call[1], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]


def sender_bounds() -> Any:
    from workers.broker.sender import JOB_BOUNDS

    return JOB_BOUNDS


def test_the_task_sent_event_is_the_one_celery_publishes(sender: Celery, redis_client: redis.Redis) -> None:
    # Given a subscriber on every channel, and a job sent by send_task
    pubsub = redis_client.pubsub()
    pubsub.psubscribe("*")
    pubsub.get_message(timeout=1)
    call = _call()
    send_call(sender, QUEUE, call)
    theirs = _next_message(pubsub)

    # When our envelope of the same call is built
    envelopes = JobEnvelopes.for_app(sender, QUEUE, redis_client)
    assert envelopes is not None
    ours = envelopes.run_fork("forkq.run_fork", *call)

    # Then it is published on the same channel with the same message, clock and timestamp aside
    assert ours.event_channel == theirs["channel"].decode()
    (our_envelope, our_body), (their_envelope, their_body) = _sent_event(ours.event), _sent_event(theirs["data"])
    assert our_envelope == their_envelope
    assert our_body.pop("clock") > their_body.pop("clock")
    assert abs(our_body.pop("timestamp") - their_body.pop("timestamp")) < 60
    assert our_body == their_body
    pubsub.close()


def _next_message(pubsub: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "pmessage":
            return dict(message)
    raise AssertionError("no message published within 5 s")


def test_no_envelopes_when_the_broker_is_another_server_or_database(
    make_settings: Callable[..., Settings], redis_client: redis.Redis
) -> None:
    url = redis_client.connection_pool.connection_kwargs
    other_db = sender_app(make_settings(redis_url=f"redis://{url['host']}:{url['port']}/{int(url.get('db') or 0) + 1}"))
    other_port = sender_app(make_settings(redis_url=f"redis://{url['host']}:1/0"))

    assert JobEnvelopes.for_app(other_db, QUEUE, redis_client) is None
    assert JobEnvelopes.for_app(other_port, QUEUE, redis_client) is None


def test_a_launch_queues_its_job_with_its_record_in_one_round_trip(
    settings: Settings, redis_client: redis.Redis, redis_url: str, parent: dict[str, Any]
) -> None:
    # Given a client whose broker is its Redis (no worker consumes the queue), past its first launch
    client = ForkClient(settings, redis_client=redis_client)
    client.launch(parent, {"description": "warm", "prompt": "p", "subagent_type": "fork"})

    # When a fork is launched, with every command Redis runs watched
    with _Watch(redis_url, redis_client) as watch:
        handle = client.launch(parent, {"description": "d", "prompt": "p", "subagent_type": "fork"})

    # Then the launch was one pipelined round trip of two scripts, the job queued inside the second, after the record
    assert [c for c in watch.commands if not c.startswith("lua ")] == ["EVALSHA", "EVALSHA"]
    inside = [c.removeprefix("lua ") for c in watch.commands if c.startswith("lua ")]
    assert inside.index("SET") < inside.index("LPUSH") < inside.index("PUBLISH")
    [job] = [json.loads(item) for item in redis_client.lrange(settings.queue, 0, -1)][:1]
    assert job["headers"]["id"] == f"{handle.fork_id}.1"
    assert job["headers"]["argsrepr"].startswith(f"('{handle.fork_id}', description='d'")
    # its seed stays in Redis (over FORKQ_INLINE_SEED_MAX_BYTES), its small record rides along for the claim
    args = decode_message(base64.b64decode(job["body"]), sender_bounds())[0]
    assert args[2] is None
    assert args[3] == redis_client.get(client.store.keys.bootstrap(handle.fork_id))
    assert client.status(handle.fork_id).status.value == "queued"


class _Watch:
    """The commands Redis runs while the block runs (MONITOR): `NAME`, or `lua NAME` inside a script."""

    MARK = "forkq-test-watch-end"

    def __init__(self, url: str, client: redis.Redis) -> None:
        self.url = url
        self.client = client
        self.commands: list[str] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _Watch:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def _watch(self) -> None:
        with redis.Redis.from_url(self.url) as watcher, watcher.monitor() as monitor:
            self._ready.set()
            for entry in monitor.listen():
                if self.MARK in entry["command"]:
                    return
                name = entry["command"].split()[0].upper()
                self.commands.append(f"lua {name}" if entry.get("client_type") == "lua" else name)

    def __exit__(self, *exc: object) -> None:
        self.client.echo(self.MARK)
        self._thread.join(5)


def test_a_job_whose_chunk_is_gone_is_queued_only_after_the_chunk_is_written_again(
    redis_client: redis.Redis, seed: ForkSeed, sender: Celery
) -> None:
    # Given a store that wrote a seed's chunks once, and one of them deleted since
    store = ForkStore(redis_client, Keys("t"), ttl_s=3600)
    record, chunks = launch(store, seed, "f-1")
    gone = store.keys.chunk("s-1", record.seed_chunks[1].hex())
    redis_client.delete(gone)
    envelopes = JobEnvelopes.for_app(sender, QUEUE, redis_client)
    assert envelopes is not None

    # When the next launch carries its job
    second = record.model_copy(update={"fork_id": "f-2"})
    data, digest = second.encode()
    job = envelopes.run_fork("forkq.run_fork", *run_fork_call("f-2", digest, attempt=1))
    queued = store.put_launch(second, data, digest, chunks, job=job)

    # Then the script did not queue it (the caller sends it once the chunk is back), and the chunk is back
    assert queued is False
    assert redis_client.llen(QUEUE) == 0
    assert redis_client.exists(gone) == 1


def test_a_conflicting_launch_queues_nothing(redis_client: redis.Redis, seed: ForkSeed, sender: Celery) -> None:
    store = ForkStore(redis_client, Keys("t"), ttl_s=3600)
    record, chunks = launch(store, seed, "f-1")
    other = record.model_copy(update={"description": "another fork under the same id"})
    data, digest = other.encode()
    envelopes = JobEnvelopes.for_app(sender, QUEUE, redis_client)
    assert envelopes is not None
    job: QueuedJob = envelopes.run_fork("forkq.run_fork", *run_fork_call("f-1", digest, attempt=1))

    with pytest.raises(Exception, match="already exists"):
        store.put_launch(other, data, digest, chunks, job=job)

    assert redis_client.llen(QUEUE) == 0

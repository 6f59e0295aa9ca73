"""The reads written once (workers/store/reads.py): the same answers on the blocking and the asyncio client."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis
import redis.asyncio

from workers.base.keys import Keys
from workers.client import ForkClient
from workers.records.fork import ForkResult, ForkState, Status
from workers.store import reads
from workers.store.reads import Command

FORK = {"description": "d", "prompt": "p", "subagent_type": "fork"}


def run_both(redis_url: str, redis_client: redis.Redis, make: Any) -> tuple[Any, Any]:
    """The answer of the read `make()` builds, driven once by each client."""

    async def on_asyncio() -> Any:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await reads.run_async(client, make())
        finally:
            await client.aclose()

    return reads.run(redis_client, make()), asyncio.run(on_asyncio())


def test_every_read_gives_the_same_answer_on_the_blocking_and_the_asyncio_client(
    client: ForkClient, redis_client: redis.Redis, redis_url: str, parent: dict[str, Any]
) -> None:
    # Given two forks of one session, one of them cancelled (a result, a journal read, a finished event)
    first = client.launch(parent, FORK)
    second = client.launch(parent, {**FORK, "prompt": "q"})
    client.cancel(second.fork_id)
    keys, session = client.store.keys, parent["session_id"]

    # Then each read answers the same through both drivers
    for make in (
        lambda: reads.state(keys, first.fork_id),
        lambda: reads.status(keys, first.fork_id),
        lambda: reads.result(keys, second.fork_id),
        lambda: reads.record(keys, first.fork_id, first.digest),
        lambda: reads.journal(keys, second.fork_id),
        lambda: reads.events(keys, second.fork_id),
        lambda: reads.latest_events(keys, second.fork_id, count=1),
        lambda: reads.session_forks(keys, session, limit=10),
        lambda: reads.ended(keys, second.fork_id, deadline=None),
    ):
        blocking, on_asyncio = run_both(redis_url, redis_client, make)
        assert blocking == on_asyncio

    listing = reads.run(redis_client, reads.session_forks(keys, session, limit=10))
    assert [(f.fork_id, f.status) for f in listing] == [(second.fork_id, "cancelled"), (first.fork_id, "queued")]
    assert client.list(session) == [{field: getattr(fork, field) for field in fork.__slots__} for fork in listing]


def test_a_read_of_several_commands_sends_each_step_as_one_batch() -> None:
    read = reads.session_forks(Keys("forkq"), "s-1", limit=5)

    first = next(read)
    second = read.send([[b"f-a", b"f-b"]])

    assert [c.method for c in first] == ["zrevrange"]
    assert [c.method for c in second] == ["hgetall", "get", "xrevrange"] * 2  # one round trip for every fork


def test_a_wait_returns_a_queued_forks_state_once_its_deadline_passes(
    client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    handle = client.launch(parent, FORK)
    started = time.monotonic()

    outcome = reads.run(redis_client, reads.ended(client.store.keys, handle.fork_id, deadline=started + 0.2))

    assert isinstance(outcome, ForkState) and outcome.status is Status.QUEUED
    assert time.monotonic() - started >= 0.2


def test_a_wait_ends_with_the_result_written_while_it_blocks() -> None:
    # Given a wait that has read no result and blocks for the next event
    keys = Keys("forkq")
    read = reads.ended(keys, "f-1", deadline=None)
    next(read)
    state = {b"status": b"running", b"kind": b"fork", b"attempt": b"1", b"digest": b"", b"created_ms": b"1"}
    block = read.send([[], None, state])
    assert block == [Command("xread", ({keys.events("f-1"): "0-0"},), {"count": 1, "block": reads.BLOCK_MAX_MS})]

    # When the result is there on its next round, the wait returns it
    read.send([[]])
    result = ForkResult(fork_id="f-1", status=Status.CANCELLED, error="cancelled by request")
    try:
        read.send([[(b"5-0", {})], result.encode(), state])
    except StopIteration as done:
        assert done.value == result
    else:
        raise AssertionError("the wait did not end")

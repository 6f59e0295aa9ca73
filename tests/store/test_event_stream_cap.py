"""A fork's event stream stays bounded: every writer of it (launch, the worker's writes, the sweeper,
cancel, resume, approve/deny) trims it to about EVENTS_MAXLEN entries, against a real (private) Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest
import redis

from tests.conftest import TEST_NAMESPACE, put_queued_fork
from tests.live import wait_until
from workers.base.keys import Keys
from workers.records.events import ModelCallData, ModelCallEvent, StepData, StepEvent
from workers.records.fork import ForkResult, Status
from workers.records.journal import JournalEntry
from workers.records.parked import ParkedCall
from workers.store import lease_scripts
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases
from workers.store.script_parts import EVENTS_MAXLEN, lua_script

KEYS = Keys(TEST_NAMESPACE)
SHORT_TTL_MS = 100
# events already in the stream when a writer runs: past the cap by more than Redis's trim granularity
OVERFULL = EVENTS_MAXLEN + 1000


def overfill(client: redis.Redis, fid: str) -> None:
    """Fill the fork's event stream past the cap with plain (uncapped) appends."""
    pipe = client.pipeline(transaction=False)
    for _ in range(OVERFULL - cast(int, client.xlen(KEYS.events(fid)))):
        pipe.xadd(KEYS.events(fid), {"type": "filler", "data": "{}"})
    pipe.execute()


def claimed(leases: Leases, fid: str) -> Claim:
    claim = leases.claim(fid, "worker-a")
    assert isinstance(claim, Claim), claim
    return claim


def lapsed(client: redis.Redis, leases: Leases, fid: str) -> None:
    """Claim the fork under a short lease and wait until Redis has dropped it (a lost worker)."""
    claimed(leases, fid)
    wait_until(lambda: not client.exists(KEYS.lease(fid)), 5, "the lease to expire")


def entry(seq: int) -> JournalEntry:
    return JournalEntry(seq=seq, step=0, kind="model", content={"role": "model", "parts": [{"text": "hm"}]})


MODEL_CALL = ModelCallEvent(data=ModelCallData(step=1, request_digest="d"))
PENDING = [ParkedCall(call_id="c1", name="write_file", args={}, index=0, step=1)]

# each writer: (what puts the fork where the writer applies, the write itself); both get (store, leases, fork id)
Step = Callable[[ForkStore, Leases, str], object]
WRITERS: dict[str, tuple[Step, Step]] = {
    "launch": (lambda s, ls, f: None, lambda s, ls, f: put_queued_fork(s, f)),
    "claim": (lambda s, ls, f: put_queued_fork(s, f), lambda s, ls, f: claimed(ls, f)),
    "append": (
        lambda s, ls, f: put_queued_fork(s, f),
        lambda s, ls, f: ls.append(claimed(ls, f), entry(0), events=[StepEvent(data=StepData(step=1, tool_calls=[]))]),
    ),
    "emit": (
        lambda s, ls, f: put_queued_fork(s, f),
        lambda s, ls, f: ls.emit(claimed(ls, f), [MODEL_CALL]),
    ),
    "finish": (
        lambda s, ls, f: put_queued_fork(s, f),
        lambda s, ls, f: ls.finish(claimed(ls, f), ForkResult(fork_id=f, status=Status.SUCCEEDED, output="ok")),
    ),
    "release": (lambda s, ls, f: put_queued_fork(s, f), lambda s, ls, f: ls.release(claimed(ls, f), "shutdown")),
    "pause": (lambda s, ls, f: put_queued_fork(s, f), lambda s, ls, f: ls.pause(claimed(ls, f), "a tool is missing")),
    "park": (lambda s, ls, f: put_queued_fork(s, f), lambda s, ls, f: ls.park(claimed(ls, f), PENDING)),
    "revive": (
        lambda s, ls, f: (put_queued_fork(s, f), lapsed(s.client, ls, f)),
        lambda s, ls, f: ls.revive(f, max_attempts=3),
    ),
    "revive at the attempt limit": (
        lambda s, ls, f: (put_queued_fork(s, f), lapsed(s.client, ls, f)),
        lambda s, ls, f: ls.revive(f, max_attempts=1),
    ),
    "cancel": (lambda s, ls, f: put_queued_fork(s, f), lambda s, ls, f: s.cancel(f)),
    "resume": (
        lambda s, ls, f: (put_queued_fork(s, f), ls.pause(claimed(ls, f), "a tool is missing")),
        lambda s, ls, f: s.resume(f),
    ),
    "decide": (
        lambda s, ls, f: (put_queued_fork(s, f), ls.park(claimed(ls, f), PENDING)),
        lambda s, ls, f: s.decide(f, "c1", "approve"),
    ),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_writer_of_a_fork_event_stream_trims_it_to_the_cap(
    writer: str, redis_client: redis.Redis, fork_store: ForkStore
) -> None:
    # Given a fork where the writer applies, whose event stream is already past the cap
    prepare, write = WRITERS[writer]
    leases = Leases(redis_client, KEYS, ttl_ms=SHORT_TTL_MS, retention_s=3600)
    fid = f"f-cap-{writer.replace(' ', '-')}"
    prepare(fork_store, leases, fid)
    overfill(redis_client, fid)
    before = cast(list[tuple[bytes, object]], redis_client.xrevrange(KEYS.events(fid), count=1))[0][0]

    # When the writer runs
    write(fork_store, leases, fid)

    # Then it appended its event and trimmed the stream back to the cap (Redis trims whole nodes: `~`)
    node = int(cast(dict[str, str], redis_client.config_get("stream-node-max-entries"))["stream-node-max-entries"])
    length = cast(int, redis_client.xlen(KEYS.events(fid)))
    assert redis_client.xrange(KEYS.events(fid), min=f"({before.decode()}", count=1), "the writer appended nothing"
    assert EVENTS_MAXLEN <= length <= EVENTS_MAXLEN + node, length


def test_a_script_with_an_uncapped_event_append_is_refused() -> None:
    with pytest.raises(ValueError, match="uncapped event append") as refused:
        lua_script("redis.call('XADD', KEYS[3], '*', 'type', 'resumed', 'data', '{}')\n")

    assert "'MAXLEN', '~', @MAXLEN@" in str(refused.value)


def test_a_capped_append_gets_the_one_cap() -> None:
    text = lua_script("redis.call('XADD', KEYS[3], 'MAXLEN', '~', @MAXLEN@, '*', 'type', 'x', 'data', '{}')\n")

    assert f"'MAXLEN', '~', {EVENTS_MAXLEN}, '*'" in text
    assert f"'MAXLEN', '~', {EVENTS_MAXLEN}, '*'" in lease_scripts.REVIVE

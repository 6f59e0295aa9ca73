"""ForkStore (workers/store/forks.py) on a real Redis: write-once records, verified seeds, events, cancel (its
script's usage tally is the journal's fold), retention."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.live import wait_until
from tests.loop.test_replay import cases as replay_cases
from tests.loop.test_replay import drive, first_entries
from workers.base import codec
from workers.base.keys import Keys
from workers.demo.redis_server import RedisServer
from workers.errors import (
    ForkNotFound,
    InvalidApproval,
    LeaseLost,
    RecordDecodeError,
    RecordExistsError,
    RecordIntegrityError,
)
from workers.history.messages import Content
from workers.history.selection import ForkSeed, build_fork_seed
from workers.history.snapshot import parse_parent_snapshot
from workers.records.conversation import fold, journal_usage
from workers.records.fork import (
    SEED_INDEX_MIN_CHUNKS,
    BootstrapRecord,
    ChunkCache,
    ForkResult,
    Status,
    chunk_digest,
    split_seed,
)
from workers.records.journal import EntryKind, JournalEntry
from workers.records.parked import ParkedCall, ResumeWait
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases

TTL_S = 3600


@pytest.fixture
def store(redis_client: redis.Redis) -> ForkStore:
    return ForkStore(redis_client, Keys("t"), ttl_s=TTL_S)


@pytest.fixture
def seed(parent: dict[str, Any]) -> ForkSeed:
    return build_fork_seed(parse_parent_snapshot(parent).history, fork_turns="3", directive="Write the tests.")


def make_record(seed: ForkSeed, fork_id: str = "f-1", **fields: Any) -> tuple[BootstrapRecord, list[bytes]]:
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
        **fields,
    )
    return record, chunks


def launch(store: ForkStore, seed: ForkSeed, fork_id: str = "f-1", **fields: Any) -> tuple[BootstrapRecord, str]:
    record, chunks = make_record(seed, fork_id, **fields)
    data, digest = record.encode()
    store.put_launch(record, data, digest, chunks)
    return record, digest


def finished(store: ForkStore, fork_id: str, status: Status = Status.SUCCEEDED) -> ForkResult:
    """Run the real claim and finish of a worker on a launched fork."""
    leases = Leases(store.client, store.keys, ttl_ms=10_000, retention_s=TTL_S)
    claim = leases.claim(fork_id, "worker-1")
    assert isinstance(claim, Claim), claim
    result = ForkResult(fork_id=fork_id, status=status, output="done")
    leases.finish(claim, result)
    return result


# ── write-once bootstrap record ──────────────────────────────────────────────────────────────


def test_a_launch_writes_the_record_the_queued_state_and_the_first_event(store: ForkStore, seed: ForkSeed) -> None:
    record, digest = launch(store, seed)

    state = store.state("f-1")
    assert store.get_record("f-1", digest) == record
    assert (state.status, state.kind, state.description, state.digest, state.attempt) == (
        Status.QUEUED,
        "fork",
        "tests",
        digest,
        0,
    )
    seconds, _ = store.client.time()
    assert state.created_ms is not None and abs(state.created_ms - seconds * 1000) < 5_000
    [event] = store.events("f-1")
    assert (event.type, event.wire_data()) == (
        "queued",
        {"kind": "fork", "digest": digest, "messages": record.message_count},
    )
    assert store.result("f-1") is None


def test_a_queued_forks_event_stream_holds_its_event_without_a_preallocated_node(
    store: ForkStore, seed: ForkSeed
) -> None:
    # Given a fork launched and a worker's first events appended afterwards
    launch(store, seed)
    key = store.keys.events("f-1")
    # Then the stream was written anew (Redis 7 allocates a new stream's first node at 4 KiB)
    queued = store.client.memory_usage(key, samples=0)
    assert queued is not None and queued < 1500, queued
    assert 0 < store.client.ttl(key) <= TTL_S
    # And it keeps taking events in order after it (a worker's claim and finish), ids still increasing
    [first] = store.events("f-1")
    finished(store, "f-1")
    assert [e.type for e in store.events("f-1")] == ["queued", "started", "finished"]
    assert [e.type for e in store.events("f-1", after=first.id)] == ["started", "finished"]


@pytest.mark.parametrize("refused", ["DUMP", "RESTORE"])
def test_a_launch_on_a_server_that_refuses_dump_or_restore_keeps_the_stream_xadd_wrote(
    redis_executable: str, seed: ForkSeed, refused: str
) -> None:
    with RedisServer(extra_args=["--rename-command", refused, ""], executable=redis_executable) as server:
        store = ForkStore(redis.Redis.from_url(server.url), Keys("t"), ttl_s=TTL_S)

        _, digest = launch(store, seed)

        [event] = store.events("f-1")
        assert (event.type, event.data.digest) == ("queued", digest)
        assert 0 < store.client.ttl(store.keys.events("f-1")) <= TTL_S
        store.client.close()


def test_launching_the_same_record_again_is_idempotent(store: ForkStore, seed: ForkSeed) -> None:
    record, digest = launch(store, seed)
    data, _ = record.encode()

    store.put_launch(record, data, digest)

    assert store.client.get(store.keys.bootstrap("f-1")) == data
    assert [e.type for e in store.events("f-1")] == ["queued"]
    assert store.state("f-1").status is Status.QUEUED


def test_a_different_record_under_the_same_fork_id_is_refused_and_the_first_kept(
    store: ForkStore, seed: ForkSeed
) -> None:
    record, _ = launch(store, seed)
    other = record.model_copy(update={"directive": "Something else."})
    other_bytes, other_digest = other.encode()

    with pytest.raises(RecordExistsError) as caught:
        store.put_launch(other, other_bytes, other_digest)

    assert (caught.value.fork_id, caught.value.key) == ("f-1", store.keys.bootstrap("f-1"))
    assert "already exists" in str(caught.value)
    assert store.client.get(store.keys.bootstrap("f-1")) == record.encode()[0]


def test_reading_a_record_verifies_its_digest(store: ForkStore, seed: ForkSeed) -> None:
    _, digest = launch(store, seed)
    key = store.keys.bootstrap("f-1")
    tampered = (store.client.get(key) or b"").replace(b"Write the tests.", b"Write the testz.")
    store.client.set(key, tampered, keepttl=True)

    with pytest.raises(RecordIntegrityError, match=digest[:12]):
        store.get_record("f-1", digest)
    assert store.get_record("f-1", None).directive == "Write the testz."  # unverified read, for inspection


def test_a_missing_or_undecodable_record_is_reported(store: ForkStore) -> None:
    with pytest.raises(ForkNotFound, match="no bootstrap record"):
        store.get_record("f-none", None)
    store.client.set(store.keys.bootstrap("f-junk"), b"\x93junk")
    with pytest.raises(RecordDecodeError):
        store.get_record("f-junk", None)


# ── seed chunks ──────────────────────────────────────────────────────────────────────────────


def test_the_seed_is_rebuilt_from_redis_or_from_inline_chunks(store: ForkStore, seed: ForkSeed) -> None:
    record, _ = launch(store, seed)
    _, chunks = make_record(seed)

    assert store.load_seed(record) == seed
    assert store.load_seed(record, chunks) == seed
    assert store.load_seed(record).to_wire() == seed.to_wire()


def test_a_chunk_missing_from_redis_or_changed_in_it_is_refused(store: ForkStore, seed: ForkSeed) -> None:
    record, _ = launch(store, seed)
    first, last = (store.keys.chunk("s-1", d.hex()) for d in (record.seed_chunks[0], record.seed_chunks[-1]))

    store.client.delete(last)
    with pytest.raises(RecordIntegrityError):
        store.load_seed(record)
    store.client.setrange(first, 5, b"X")
    with pytest.raises(RecordIntegrityError, match="seed chunk 0"):
        store.load_seed(record)


def test_chunks_are_stored_once_and_their_retention_renewed_on_reuse(store: ForkStore, seed: ForkSeed) -> None:
    record, _ = launch(store, seed, "f-1")
    keys = [store.keys.chunk("s-1", d.hex()) for d in record.seed_chunks]
    store.client.expire(keys[0], 10)

    launch(store, seed, "f-2")

    assert len(store.client.keys("t:{parent:s-1}:chunk:*")) == len(keys) + 1  # + the shared context chunk
    assert store.client.ttl(keys[0]) > TTL_S - 60


def test_a_chunk_this_store_wrote_is_not_sent_again_but_written_again_when_it_is_gone(
    store: ForkStore, seed: ForkSeed
) -> None:
    record, _ = launch(store, seed, "f-1")
    keys = [store.keys.chunk("s-1", d.hex()) for d in record.seed_chunks]
    store.client.expire(keys[0], 10)
    store.client.delete(keys[1])
    store.client.config_resetstat()

    launch(store, seed, "f-2")

    # the chunks went as TTL refreshes: the only SETs are the new record's and the deleted chunk's
    sets = store.client.info("commandstats").get("cmdstat_set", {}).get("calls", 0)
    assert sets == 2
    assert all(store.client.ttl(key) > TTL_S - 60 for key in keys)
    assert store.load_seed(store.get_record("f-2", None)) == seed


def test_a_launch_loads_its_scripts_again_after_redis_lost_them(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed, "f-1")
    store.client.script_flush()

    record, digest = launch(store, seed, "f-2")

    assert store.get_record("f-2", digest) == record


def test_with_a_chunk_cache_a_seed_read_before_is_not_read_from_redis_again(
    redis_client: redis.Redis, seed: ForkSeed
) -> None:
    store = ForkStore(redis_client, Keys("t"), ttl_s=TTL_S, chunk_cache=ChunkCache(1 << 20))
    record, digest = launch(store, seed, "f-1")
    data = store.client.get(store.keys.bootstrap("f-1")) or b""
    first = store.load_inputs("f-1", data, digest)
    for key in store.client.keys("t:{parent:s-1}:chunk:*"):
        store.client.delete(key)

    assert store.load_inputs("f-1", data, digest) == first == (record, seed)
    with pytest.raises(RecordIntegrityError):  # the record itself is still verified
        store.load_inputs("f-1", data.replace(b"Write the tests.", b"Write the testz."), digest)


# ── seed index ────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def long_seed(parent: dict[str, Any]) -> ForkSeed:
    """An `all` seed of some 400 messages: more chunks than a record names itself."""
    turns = [
        {"role": role, "parts": [{"text": f"{role} message {i}: " + "lorem ipsum " * (i % 40)}]}
        for i in range(200)
        for role in ("user", "model")
    ]
    history = parse_parent_snapshot({**parent, "history": [*turns, *parent["history"]]}).history
    return build_fork_seed(history, fork_turns=None, directive="Write the tests.")


def test_a_long_seed_is_named_by_one_index_chunk_that_sibling_records_share(
    store: ForkStore, long_seed: ForkSeed
) -> None:
    # Given two forks of one long seed
    record, digest = launch(store, long_seed, "f-1")
    launch(store, long_seed, "f-2")
    assert len(record.seed_chunks) >= SEED_INDEX_MIN_CHUNKS
    # Then each record names the index, not the chunks, and the index is stored once under its digest
    index = record.seed_index_blob()
    assert index is not None
    for fid in ("f-1", "f-2"):
        stored = codec.decode(store.client.get(store.keys.bootstrap(fid)) or b"")
        assert "seed_chunks" not in stored and stored["seed_index"] == chunk_digest(index)
    assert store.client.get(store.keys.chunk("s-1", chunk_digest(index).hex())) == index
    assert len(store.client.keys("t:{parent:s-1}:chunk:*")) == len(record.seed_chunks) + 2  # + context, index
    # And a revived fork rebuilds byte-identical inputs, with and without a chunk cache
    data = store.client.get(store.keys.bootstrap("f-1")) or b""
    assert store.get_record("f-1", digest) == record
    for reader in (store, ForkStore(store.client, store.keys, ttl_s=TTL_S, chunk_cache=ChunkCache(1 << 20))):
        for _ in range(2):  # the second read is the cache's
            got, seed = reader.load_inputs("f-1", data, digest)
            assert got == record and seed.to_wire() == long_seed.to_wire()


def test_a_short_seed_keeps_its_chunk_digests_in_the_record(store: ForkStore, seed: ForkSeed) -> None:
    record, _ = launch(store, seed)

    stored = codec.decode(store.client.get(store.keys.bootstrap("f-1")) or b"")
    assert record.seed_index_blob() is None
    assert stored["seed_chunks"] == record.seed_chunks and "seed_index" not in stored


def test_a_missing_or_changed_seed_index_is_refused(store: ForkStore, long_seed: ForkSeed) -> None:
    record, digest = launch(store, long_seed)
    key = store.keys.chunk("s-1", chunk_digest(record.seed_index_blob() or b"").hex())
    data = store.client.get(store.keys.bootstrap("f-1")) or b""

    store.client.setrange(key, 40, b"X")
    with pytest.raises(RecordIntegrityError, match="seed index"):
        store.load_inputs("f-1", data, digest)
    store.client.delete(key)
    with pytest.raises(RecordIntegrityError, match="seed index"):
        store.get_record("f-1", digest)


def test_a_long_record_stored_with_its_chunk_digests_still_loads(store: ForkStore, long_seed: ForkSeed) -> None:
    # Given a long seed's record as stored before seed indexes: its digests in the record itself
    record, chunks = make_record(long_seed)
    store.put_launch(record, *record.encode(), chunks)
    fields = record.model_dump(exclude={"system_instruction", "tools_json"})
    fields["context_chunk"] = chunk_digest(record.context_blob())
    data, digest = codec.encode_with_digest(fields)
    store.client.set(store.keys.bootstrap("f-1"), data)
    # Then it reads back whole, and its seed is rebuilt
    assert store.get_record("f-1", digest) == record
    got, seed = store.load_inputs("f-1", data, digest)
    assert got == record and seed.to_wire() == long_seed.to_wire()


# ── retention ─────────────────────────────────────────────────────────────────────────────────


def fork_keys(store: ForkStore, fork_id: str) -> list[str]:
    return [k.decode() for k in store.client.keys(f"t:{{{fork_id}}}:*")]


def test_every_key_a_launch_writes_expires_with_the_retention(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)

    ttls = {key: store.client.ttl(key) for key in [*fork_keys(store, "f-1"), *store.client.keys("t:{parent:*")]}
    assert ttls and all(TTL_S - 60 < ttl <= TTL_S for ttl in ttls.values()), ttls


def test_a_finished_fork_keeps_every_record_for_the_retention(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)
    finished(store, "f-1")

    ttls = {key: store.client.ttl(key) for key in fork_keys(store, "f-1")}
    assert store.keys.result("f-1") in ttls
    assert all(TTL_S - 60 < ttl <= TTL_S for ttl in ttls.values()), ttls


def test_a_cancelled_fork_keeps_every_record_for_the_retention(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)
    store.cancel("f-1")

    ttls = {key: store.client.ttl(key) for key in fork_keys(store, "f-1")}
    assert store.keys.result("f-1") in ttls
    assert all(TTL_S - 60 < ttl <= TTL_S for ttl in ttls.values()), ttls


# ── cancel ────────────────────────────────────────────────────────────────────────────────────


def test_cancelling_a_queued_fork_ends_it_with_a_result_and_a_finished_event(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)

    assert store.cancel("f-1") is Status.CANCELLED

    state, result = store.state("f-1"), store.result("f-1")
    assert (state.status, state.error, state.finished_ms is not None) == (
        Status.CANCELLED,
        "cancelled by request",
        True,
    )
    assert result == ForkResult(fork_id="f-1", status=Status.CANCELLED, error="cancelled by request")
    assert [(e.type, e.data.status) for e in store.events("f-1")[1:]] == [("finished", "cancelled")]
    assert store.cancel("f-1") is Status.CANCELLED
    assert len(store.events("f-1")) == 2


def test_cancelling_a_running_fork_marks_it_for_the_worker_to_stop(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)
    leases = Leases(store.client, store.keys, ttl_ms=10_000, retention_s=TTL_S)
    claim = leases.claim("f-1", "worker-1")
    assert isinstance(claim, Claim)

    assert store.cancel("f-1") is Status.CANCELLED
    assert store.state("f-1").status is Status.CANCELLED
    # the worker's next checkpoint reads the status and stops
    assert leases.emit(claim, []) == "cancelled"


def model_entry(seq: int, step: int, tokens: int, cached: int | None = None) -> JournalEntry:
    content = {"role": "model", "parts": [{"functionCall": {"id": f"c{step}", "name": "t", "args": {}}}]}
    return JournalEntry(
        seq=seq,
        step=step,
        kind="model",
        content=content,
        input_tokens=tokens,
        output_tokens=1,
        cached_input_tokens=cached,
    )


def test_a_cancelled_running_fork_keeps_the_usage_its_journal_records(store: ForkStore, seed: ForkSeed) -> None:
    # Given a running fork that made two model calls and one tool call
    launch(store, seed)
    leases = Leases(store.client, store.keys, ttl_ms=10_000, retention_s=TTL_S)
    claim = leases.claim("f-1", "worker-1")
    assert isinstance(claim, Claim)
    result_entry = JournalEntry(seq=1, step=0, kind="tool_result", call_index=0, response={"output": "ok"})
    leases.append(claim, model_entry(0, 0, 120), result_entry)
    leases.append(claim, model_entry(2, 1, 80, cached=64))
    time.sleep(0.05)  # not a synchronization: the fork runs 50 ms, the duration its usage must report

    # When it is cancelled
    assert store.cancel("f-1") is Status.CANCELLED

    # Then its result and finished event keep what it used
    result = store.result("f-1")
    assert result is not None and result.status is Status.CANCELLED
    usage = result.usage
    assert (usage.model_calls, usage.tool_uses, usage.input_tokens, usage.output_tokens) == (2, 1, 200, 2)
    assert usage.total_tokens == 202 and usage.duration_ms >= 50
    assert usage.cached_input_tokens == 64
    assert store.events("f-1")[-1].wire_data()["usage"] == usage.model_dump()


def test_a_cancelled_parked_fork_reports_its_time_until_it_parked(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)
    leases = Leases(store.client, store.keys, ttl_ms=10_000, retention_s=TTL_S)
    claim = leases.claim("f-1", "worker-1")
    assert isinstance(claim, Claim)
    time.sleep(0.05)  # not a synchronization: the fork runs 50 ms before it parks, the duration it must report
    leases.park(claim, [ParkedCall(call_id="w1", index=0, step=0, name="write_file", args={})])
    time.sleep(0.2)  # not a synchronization: time parked, which is not the fork's time and must not count

    store.cancel("f-1")

    times = store.client.hmget(store.keys.state("f-1"), ["first_started_ms", "parked_ms"])
    result = store.result("f-1")
    assert result is not None
    assert result.usage.duration_ms == int(times[1]) - int(times[0]) >= 50


def test_a_paused_fork_waits_for_a_resume_with_its_reason_not_an_error_and_waits_no_more_once_resumed(
    store: ForkStore, seed: ForkSeed
) -> None:
    # Given a running fork that pauses (a tool it started with is missing on this worker)
    launch(store, seed)
    leases = Leases(store.client, store.keys, ttl_ms=10_000, retention_s=TTL_S)
    claim = leases.claim("f-1", "worker-1")
    assert isinstance(claim, Claim)
    leases.pause(claim, "declared tool(s) count not available on this worker")

    # Then its state waits for a resume, for that reason, and holds no error
    state = store.state("f-1")
    assert state.waiting_for == ResumeWait(reason="declared tool(s) count not available on this worker")
    assert state.error is None

    # When it is resumed, it is queued and waits for nothing
    assert store.resume("f-1") is True
    state = store.state("f-1")
    assert (state.status, state.waiting_for, state.error) == (Status.QUEUED, None, None)
    assert store.client.hget(store.keys.state("f-1"), "waiting") is None
    assert store.resume("f-1") is False  # queued, not paused: nothing to resume


def test_a_cancelled_parked_fork_lists_no_call_awaiting_approval(store: ForkStore, seed: ForkSeed) -> None:
    # Given a fork parked on a write
    launch(store, seed)
    leases = Leases(store.client, store.keys, ttl_ms=10_000, retention_s=TTL_S)
    claim = leases.claim("f-1", "worker-1")
    assert isinstance(claim, Claim)
    leases.park(claim, [ParkedCall(call_id="w1", index=0, step=0, name="write_file", args={})])
    assert [call.call_id for call in store.state("f-1").pending_approval] == ["w1"]

    # When it is cancelled, no call waits any more: the state says so (the decision is refused as before)
    store.cancel("f-1")

    state = store.state("f-1")
    assert state.status is Status.CANCELLED and state.pending_approval == []
    with pytest.raises(InvalidApproval, match="is cancelled, not awaiting approval"):
        store.decide("f-1", "w1", "approve")


def test_a_cancel_racing_a_running_fork_counts_every_entry_the_fork_wrote(store: ForkStore, seed: ForkSeed) -> None:
    # Given a fork appending model entries as fast as Redis takes them
    launch(store, seed)
    leases = Leases(store.client, store.keys, ttl_ms=10_000, retention_s=TTL_S)
    claim = leases.claim("f-1", "worker-1")
    assert isinstance(claim, Claim)
    leases.append(claim, model_entry(0, 0, 1))

    appended = [0]

    def run() -> None:
        seq = 1
        with contextlib.suppress(LeaseLost):  # the cancel fences it out
            while True:
                leases.append(claim, model_entry(seq, seq, 1))
                appended[0] = seq
                seq += 1

    writer = threading.Thread(target=run)
    writer.start()
    wait_until(lambda: appended[0] >= 10, 10, "the writer to append entries")

    # When it is cancelled meanwhile
    store.cancel("f-1")
    writer.join(timeout=10)

    # Then the result counts exactly the entries in the journal, which no append can change any more
    journal = leases.journal("f-1")
    result = store.result("f-1")
    assert result is not None and not writer.is_alive()
    assert len(journal) > 1
    assert (result.usage.model_calls, result.usage.input_tokens) == (len(journal), len(journal))


def test_the_cancel_script_tallies_every_entry_appended_after_the_journal_the_client_read(
    store: ForkStore, seed: ForkSeed
) -> None:
    # Given a running fork whose journal the client read when it held one model call
    launch(store, seed)
    leases = Leases(store.client, store.keys, ttl_ms=10_000, retention_s=TTL_S)
    claim = leases.claim("f-1", "worker-1")
    assert isinstance(claim, Claim)
    leases.append(claim, model_entry(0, 0, 100, cached=50))
    read = store.client.lrange(store.keys.journal("f-1"), 0, -1)
    # and to which the fork appended a tool result and two more model calls before the cancel script ran
    tool_result = JournalEntry(seq=1, step=0, kind="tool_result", call_index=0, response={"output": "ok"})
    leases.append(claim, tool_result, model_entry(2, 1, 20, cached=16))
    leases.append(claim, model_entry(3, 2, 3))

    # When the cancel runs with the stale read
    assert store._cancel_tallied("f-1", read) is Status.CANCELLED

    # Then the script counted the three entries the client never saw, and the result holds all four
    result = store.result("f-1")
    assert result is not None and len(read) == 1
    assert (result.usage.model_calls, result.usage.tool_uses, result.usage.input_tokens) == (3, 1, 123)
    assert result.usage.cached_input_tokens == 66  # 50 read by the client, 16 tallied by the script
    assert result.usage.output_tokens == 3 and store.events("f-1")[-1].wire_data()["usage"] == result.usage.model_dump()


@pytest.mark.parametrize("status", [Status.SUCCEEDED, Status.FAILED])
def test_cancelling_a_finished_fork_leaves_it_as_it_was(store: ForkStore, seed: ForkSeed, status: Status) -> None:
    launch(store, seed)
    result = finished(store, "f-1", status)
    events = store.events("f-1")

    assert store.cancel("f-1") is status

    assert store.state("f-1").status is status
    assert store.result("f-1") == result
    assert store.events("f-1") == events


def test_cancelling_or_reading_an_unknown_fork_raises_fork_not_found(store: ForkStore) -> None:
    with pytest.raises(ForkNotFound, match="f-none"):
        store.cancel("f-none")
    with pytest.raises(ForkNotFound, match="f-none"):
        store.state("f-none")
    assert store.client.dbsize() == 0


def emit(store: ForkStore, kind: str, data: dict[str, Any]) -> None:
    """Publish an event in the form a worker's fenced scripts write it (lease_scripts: type, data JSON)."""
    store.client.xadd(store.keys.events("f-1"), {"type": kind, "data": json.dumps(data)})


# ── events ────────────────────────────────────────────────────────────────────────────────────


def test_events_are_read_in_order_from_any_id(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)
    for n in (1, 2, 3):
        emit(store, "step", {"step": n, "tool_calls": []})
    ids = [e.id for e in store.events("f-1")[1:]]

    everything = store.events("f-1")
    after_first = store.events("f-1", after=ids[0])

    assert [e.type for e in everything] == ["queued", "step", "step", "step"]
    assert [e.id for e in everything[1:]] == ids
    assert [e.data.step for e in after_first] == [2, 3]
    assert all(e.at_ms > 0 for e in everything)
    assert store.events("f-1", after=ids[-1]) == []


def test_following_events_waits_for_new_ones_and_stops_at_the_finished_event(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)

    def produce() -> None:
        # not a synchronization: the events come late on purpose, and `follow` must block until they do
        time.sleep(0.2)
        emit(store, "step", {"step": 1})
        time.sleep(0.2)
        emit(store, "finished", {"status": "succeeded"})
        emit(store, "late", {})

    producer = threading.Thread(target=produce)
    producer.start()
    started = time.monotonic()
    followed = [e.type for e in store.follow("f-1", block_ms=100)]
    producer.join()

    assert followed == ["queued", "step", "finished"]
    assert time.monotonic() - started >= 0.35


def test_a_blocking_read_returns_empty_after_its_timeout(store: ForkStore, seed: ForkSeed) -> None:
    launch(store, seed)
    [queued] = store.events("f-1")

    started = time.monotonic()
    assert store.events("f-1", after=queued.id, block_ms=150) == []
    assert time.monotonic() - started >= 0.1


def test_with_a_replica_a_launch_is_acknowledged_only_after_the_replica_has_the_record(
    fresh_redis: RedisServer, redis_executable: str, seed: ForkSeed
) -> None:
    # Given a primary with one connected replica
    assert fresh_redis.port is not None
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(fresh_redis.port)], executable=redis_executable)
    replica.start()
    primary = redis.Redis.from_url(fresh_redis.url)
    follower = redis.Redis.from_url(replica.url)
    try:
        # online: past its initial sync, so it acknowledges the stream (WAIT counts only such replicas)
        online = lambda: primary.info("replication").get("slave0", {}).get("state") == "online"  # noqa: E731
        wait_until(online, 10, "the replica to finish its initial sync")
        store = ForkStore(primary, Keys("t"), ttl_s=TTL_S)
        # When a fork is launched
        record, _ = launch(store, seed)
        # Then the launch waited for the replica (WAIT), and the replica holds the record already
        assert primary.info("commandstats")["cmdstat_wait"]["calls"] >= 1
        assert follower.get(store.keys.bootstrap(record.fork_id)) == primary.get(store.keys.bootstrap(record.fork_id))
    finally:
        primary.close()
        follower.close()
        replica.stop()


# ── the cancel script's own tally is the journal's fold ───────────────────────────────────────
# The script tallies, atomically, the entries appended after the journal the client read; whatever the split,
# the usage must be the fold's (`journal_usage`): for a journal of every entry kind, for generated journals of
# any kinds and fields, and for the journals real loop runs write.

TALLIED = itertools.count()
_TOKENS = st.integers(0, 10**7)


def cancelled_usage(store: ForkStore, seed: ForkSeed, journal: list[bytes], read: int) -> dict[str, Any]:
    """The usage of a queued fork with `journal` cancelled after the client read its first `read` entries."""
    fork_id = f"f-tally-{next(TALLIED)}"
    launch(store, seed, fork_id)
    if journal:
        store.client.rpush(store.keys.journal(fork_id), *journal)
    assert store._cancel_tallied(fork_id, journal[:read]) is Status.CANCELLED
    result = store.result(fork_id)
    assert result is not None
    return result.usage.model_dump()


def assert_script_tallies_the_fold(store: ForkStore, seed: ForkSeed, journal: list[bytes]) -> None:
    entries = []
    for raw in journal:
        with contextlib.suppress(RecordDecodeError):  # an entry that does not decode is skipped by both
            entries.append(JournalEntry.decode(raw, fork_id="f-tally"))
    folded = fold(entries).usage.model_dump()
    assert journal_usage(journal, "f-tally").model_dump() == folded
    assert cancelled_usage(store, seed, journal, 0) == folded  # the script tallies every entry
    assert cancelled_usage(store, seed, journal, len(journal) // 2) == folded  # half each


def every_kind() -> list[JournalEntry]:
    """One journal holding each entry kind, tokens cached and not, and a delivered message."""
    model = Content.model_validate({"role": "model", "parts": [{"functionCall": {"id": "c1", "name": "t"}}]})
    answer = Content.model_validate({"role": "model", "parts": [{"text": "done"}]})
    user = Content.model_validate({"role": "user", "parts": [{"text": "more"}]})
    entries = {
        EntryKind.SURFACE: JournalEntry(seq=0, step=0, kind=EntryKind.SURFACE, tools=["t"]),
        EntryKind.MODEL: JournalEntry(
            seq=1,
            step=0,
            kind=EntryKind.MODEL,
            content=model,
            input_tokens=100,
            output_tokens=9,
            cached_input_tokens=64,
        ),
        EntryKind.APPROVAL: JournalEntry(seq=2, step=0, kind=EntryKind.APPROVAL, call_index=0, decision="approve"),
        EntryKind.TOOL_STARTED: JournalEntry(seq=3, step=0, kind=EntryKind.TOOL_STARTED, call_index=0),
        EntryKind.TOOL_RESULT: JournalEntry(
            seq=4, step=0, kind=EntryKind.TOOL_RESULT, call_index=0, response={"output": "ok"}
        ),
        EntryKind.FEEDBACK: JournalEntry(seq=6, step=1, kind=EntryKind.FEEDBACK, content=user),
        EntryKind.MESSAGE: JournalEntry(seq=8, step=2, kind=EntryKind.MESSAGE, content=user),
    }
    assert set(entries) == set(EntryKind), "add the new entry kind to this journal"
    first = JournalEntry(seq=5, step=1, kind=EntryKind.MODEL, content=answer, input_tokens=120, output_tokens=4)
    last = JournalEntry(seq=7, step=2, kind=EntryKind.MODEL, content=answer, input_tokens=150, output_tokens=2)
    return sorted([*entries.values(), first, last], key=lambda e: e.seq)


def test_the_cancel_script_tallies_a_journal_of_every_entry_kind_as_the_fold_does(
    store: ForkStore, seed: ForkSeed
) -> None:
    journal = [entry.encode() for entry in every_kind()]

    assert_script_tallies_the_fold(store, seed, journal)
    assert cancelled_usage(store, seed, journal, 0)["model_calls"] == 3


@st.composite
def any_journal(draw: st.DrawFn) -> list[bytes]:
    """Entries of any kinds in any order, with any token counts (cached or not), and now and then a damaged one."""
    journal = []
    for seq in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(list(EntryKind)))
        fields: dict[str, Any] = {}
        if kind is EntryKind.MODEL:
            parts = [{"text": "t"}] + [{"functionCall": {"id": f"c{i}"}} for i in range(draw(st.integers(0, 2)))]
            fields = {
                "content": {"role": "model", "parts": parts},
                "input_tokens": draw(_TOKENS),
                "output_tokens": draw(_TOKENS),
                "cached_input_tokens": draw(st.none() | _TOKENS),
            }
        elif kind in (EntryKind.FEEDBACK, EntryKind.MESSAGE):
            fields = {"content": {"role": "user", "parts": [{"text": "m"}]}}
        elif kind is not EntryKind.SURFACE:
            fields = {"call_index": draw(st.integers(0, 2))}
            if kind is EntryKind.TOOL_RESULT:
                fields["response"] = {"output": "ok"}
        journal.append(JournalEntry(seq=seq, step=draw(st.integers(0, 4)), kind=kind, **fields).encode())
        if draw(st.integers(0, 9)) == 0:
            journal.append(b"\xc1 not msgpack")
    return journal


TALLY_PROPERTY = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@TALLY_PROPERTY
@given(journal=any_journal())
def test_the_cancel_script_tallies_any_journal_as_the_fold_does(
    store: ForkStore, seed: ForkSeed, journal: list[bytes]
) -> None:
    assert_script_tallies_the_fold(store, seed, journal)


@TALLY_PROPERTY
@given(case=replay_cases())
def test_the_cancel_script_tallies_the_journal_of_a_loop_run_as_the_fold_does(
    store: ForkStore, seed: ForkSeed, case: Any
) -> None:
    journal = drive(case, first_entries(case)).journal.entries

    assert_script_tallies_the_fold(store, seed, [entry.encode() for entry in journal])

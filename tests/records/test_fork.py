"""Fork records (workers/records/fork.py): the canonical bootstrap bytes and digest, seed chunks, results and state."""

from __future__ import annotations

import hashlib
import random
import zlib
from typing import Any

import pytest

from tests.factories import call, model, response, user
from workers.base import codec
from workers.errors import RecordDecodeError, RecordIntegrityError
from workers.history.messages import Content, dump_contents
from workers.history.selection import ForkSeed
from workers.records.allocation import string_allocation
from workers.records.fork import (
    CHUNK_BOUNDARY_MODULUS,
    CHUNK_FIT_MIN_BYTES,
    CHUNK_MAX_MESSAGES,
    TAIL_MESSAGES,
    BootstrapRecord,
    ChunkCache,
    Declarations,
    ForkResult,
    ForkState,
    Status,
    Usage,
    chunk_digest,
    join_seed,
    split_seed,
)


def conversation(n: int, tag: str = "") -> list[Content]:
    """n Contents alternating user text, model call, user response (distinct by `tag`)."""
    contents: list[Content] = []
    for i in range(n):
        if i % 3 == 0:
            contents.append(user(f"{tag}question {i}: what does module {i} do?"))
        elif i % 3 == 1:
            contents.append(model(call(f"c{tag}{i}", "read_file", {"path": f"src/m{i}.py"})))
        else:
            contents.append(user(response(f"c{tag}{i - 1}", "read_file", f"{tag}contents of m{i}\n" * 5)))
    return contents


def record_for(messages: list[Content], fork_id: str = "f-1", **fields: Any) -> tuple[BootstrapRecord, list[bytes]]:
    chunks = split_seed(messages)
    record = BootstrapRecord(
        fork_id=fork_id,
        parent_session="s-1",
        kind="fork",
        seed_chunks=[chunk_digest(c) for c in chunks],
        message_count=len(messages),
        task_prompt="Begin.",
        directive="Do the task.",
        description="a task",
        **fields,
    )
    return record, chunks


# ── bootstrap record ─────────────────────────────────────────────────────────────────────────


def test_a_record_encodes_to_canonical_bytes_named_by_their_blake2b_256_digest() -> None:
    record, _ = record_for(conversation(10), tools_json='[{"name":"b"},{"name":"a"}]', generation={"z": 1, "a": 2})

    data, digest = record.encode()

    assert digest == hashlib.blake2b(data, digest_size=32).hexdigest()
    assert record.model_copy().encode() == (data, digest)
    assert BootstrapRecord.decode(data, fork_id="f-1", context=record.context_blob()).encode() == (data, digest)
    assert list(codec.decode(data)) == sorted(codec.decode(data))  # map keys sorted


def test_the_stored_record_names_its_context_by_digest_instead_of_copying_it() -> None:
    # the system instruction and tools are shared by every fork of a parent: stored once, as a chunk
    record, _ = record_for(conversation(2), system_instruction="be brief " * 200)
    data, _ = record.encode()

    assert b"be brief" not in data
    assert codec.decode(data)["context_chunk"] == hashlib.blake2b(record.context_blob(), digest_size=32).digest()


def test_a_record_whose_context_chunk_was_altered_is_refused() -> None:
    record, _ = record_for(conversation(2), system_instruction="be brief")
    data, digest = record.encode()
    forged = record.model_copy(update={"system_instruction": "be evil"}).context_blob()

    with pytest.raises(RecordIntegrityError, match="context chunk"):
        BootstrapRecord.decode(data, fork_id="f-1", context=forged, expected_digest=digest)


def test_a_record_decodes_back_when_its_digest_matches() -> None:
    record, _ = record_for(conversation(10), system_instruction={"parts": [{"text": "be brief"}]}, depth=2)
    data, digest = record.encode()

    context = record.context_blob()
    assert BootstrapRecord.decode(data, fork_id="f-1", context=context, expected_digest=digest) == record
    assert BootstrapRecord.decode(data, fork_id="f-1", context=context) == record


def test_a_record_whose_bytes_changed_is_refused_naming_both_digests() -> None:
    record, _ = record_for(conversation(4))
    data, digest = record.encode()
    tampered = data.replace(b"Do the task.", b"Do the tasK.")

    with pytest.raises(RecordIntegrityError) as caught:
        BootstrapRecord.decode(tampered, fork_id="f-1", context=record.context_blob(), expected_digest=digest)

    message = str(caught.value)
    assert digest[:12] in message
    assert codec.digest(tampered)[:12] in message
    assert "modified after launch" in message
    assert caught.value.fork_id == "f-1"


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", codec.encode([1, 2]), codec.encode({"fork_id": "f-1"}), codec.encode({"extra": 1})],
    ids=["empty", "not-msgpack", "a-list", "missing-fields", "unknown-field"],
)
def test_bytes_that_are_not_a_record_raise_record_decode_error(data: bytes) -> None:
    with pytest.raises(RecordDecodeError) as caught:
        BootstrapRecord.decode(data, fork_id="f-1", context=b"")

    assert "f-1" in str(caught.value)


def test_a_record_with_a_field_of_the_wrong_type_is_refused_not_coerced() -> None:
    record, _ = record_for(conversation(4))
    raw = codec.decode(record.encode()[0])
    raw["depth"] = "1"

    with pytest.raises(RecordDecodeError):
        BootstrapRecord.decode(codec.encode(raw), fork_id="f-1", context=record.context_blob())


def test_tool_declarations_keep_the_parents_key_order() -> None:
    tools_json = '[{"name":"grep","parameters":{"type":"object"},"description":"search"}]'
    record, _ = record_for([], tools_json=tools_json)

    assert list(record.tools[0]) == ["name", "parameters", "description"]
    decoded = BootstrapRecord.decode(record.encode()[0], fork_id="f-1", context=record.context_blob())
    assert decoded.tools_json == tools_json


# ── seed chunks ──────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 10, 150])
def test_split_then_join_gives_the_seed_back(n: int) -> None:
    messages = conversation(n)
    record, chunks = record_for(messages)

    seed = join_seed(record, chunks)

    assert seed == ForkSeed(initial_messages=messages, task_prompt="Begin.")
    assert dump_contents(seed.initial_messages) == dump_contents(messages)
    assert sum(len(codec.decode(c)) for c in chunks) == n
    assert (n == 0) == (chunks == [])


def test_a_chunk_is_a_canonical_msgpack_list_of_wire_contents_named_by_its_digest() -> None:
    messages = conversation(20)
    chunks = split_seed(messages)

    assert [item for c in chunks for item in codec.decode(c)] == dump_contents(messages)
    assert all(chunk_digest(c) == hashlib.blake2b(c, digest_size=32).digest() for c in chunks)
    assert split_seed(conversation(20)) == chunks


def test_a_modified_chunk_is_refused_naming_its_index() -> None:
    record, chunks = record_for(conversation(40))
    chunks[1] = chunks[1].replace(b"question", b"questiom")

    with pytest.raises(RecordIntegrityError, match=r"seed chunk 1 .* does not match its digest"):
        join_seed(record, chunks)


def test_a_missing_chunk_is_refused() -> None:
    record, chunks = record_for(conversation(40))
    assert len(chunks) > 2

    with pytest.raises(RecordIntegrityError, match=f"got {len(chunks) - 1} seed chunks"):
        join_seed(record, chunks[:-1])
    with pytest.raises(RecordIntegrityError, match="does not match its digest"):
        join_seed(record, [*chunks[:-1], b""])


def test_a_record_whose_message_count_disagrees_with_its_chunks_is_refused() -> None:
    record, chunks = record_for(conversation(12))
    wrong = record.model_copy(update={"message_count": 11})

    with pytest.raises(RecordIntegrityError, match="seed has 12 messages, the record says 11"):
        join_seed(wrong, chunks)


def test_chunks_in_the_wrong_order_are_refused() -> None:
    record, chunks = record_for(conversation(40))

    with pytest.raises(RecordIntegrityError):
        join_seed(record, list(reversed(chunks)))


def test_chunk_boundaries_are_content_defined_so_a_shared_run_at_another_offset_shares_its_chunks() -> None:
    # Given two seeds that share 300 messages, after prefixes of different lengths, and differ at the end
    shared = conversation(300, tag="shared-")
    first = [*conversation(7, tag="a-"), *shared, *conversation(5, tag="end-a-")]
    second = [*conversation(23, tag="b-"), *shared, *conversation(4, tag="end-b-")]

    # When both are split
    one, two = {chunk_digest(c) for c in split_seed(first)}, {chunk_digest(c) for c in split_seed(second)}

    # Then most chunks of the shared run are stored under the same digests
    shared_chunks = {chunk_digest(c) for c in split_seed(shared)}
    common = one & two
    assert len(common) >= 0.8 * len(shared_chunks)
    common_bytes = sum(len(c) for c in split_seed(second) if chunk_digest(c) in common)
    assert common_bytes >= 0.8 * sum(len(codec.encode(m)) for m in dump_contents(shared))


def test_a_chunk_ends_after_a_boundary_message_and_never_holds_more_than_the_maximum() -> None:
    messages = conversation(400)
    chunks = split_seed(messages)
    encoded = [codec.encode(m) for m in dump_contents(messages)]

    ends = []
    position = 0
    for chunk in chunks[:-1]:
        position += len(codec.decode(chunk))
        ends.append(position - 1)
    assert all(len(codec.decode(c)) <= CHUNK_MAX_MESSAGES for c in chunks)
    body_ends = [e for e in ends if e < len(messages) - TAIL_MESSAGES - 1]
    assert all(
        zlib.crc32(encoded[e]) % CHUNK_BOUNDARY_MODULUS == 0 or (e + 1) % CHUNK_MAX_MESSAGES == 0 for e in body_ends
    )


def test_a_run_without_boundaries_is_cut_at_the_chunk_message_limit() -> None:
    # messages whose encodings never hit a content-defined boundary
    messages: list[Content] = []
    i = 0
    while len(messages) < 3 * CHUNK_MAX_MESSAGES:
        candidate = user(f"note {i}")
        if zlib.crc32(codec.encode(candidate.to_wire())) % CHUNK_BOUNDARY_MODULUS != 0:
            messages.append(candidate)
        i += 1

    sizes = [len(codec.decode(c)) for c in split_seed(messages)]

    assert sizes[:2] == [CHUNK_MAX_MESSAGES, CHUNK_MAX_MESSAGES]
    assert sum(sizes) == len(messages)


def big_conversation(n: int, tag: str) -> list[Content]:
    """n Contents like `conversation`'s, with tool outputs of 0.5-12 KB (chunks reach the size classes)."""
    rnd = random.Random(tag)
    contents = conversation(n, tag)
    for i in range(2, n, 3):
        output = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(80, 2000)))
        contents[i] = user(response(f"c{tag}{i - 1}", "read_file", output))
    return contents


WORDS = ("lease", "fork", "epoch", "journal", "chunk", "record", "worker", "digest", "stream", "seed")


def test_a_large_chunk_ends_where_it_nearly_fills_its_allocation_and_the_seed_wastes_little() -> None:
    messages = big_conversation(600, "fit-")
    chunks = split_seed(messages)
    encoded = [codec.encode(m) for m in dump_contents(messages)]

    # each body chunk ends at a content-defined boundary or limit, or nearly fills its size class
    # (and the next message would not have fit)
    position = 0
    for chunk in chunks[:-2]:
        count = len(codec.decode(chunk))
        position += count
        last, following = encoded[position - 1], encoded[position]
        if zlib.crc32(last) % CHUNK_BOUNDARY_MODULUS != 0 and count < CHUNK_MAX_MESSAGES:
            allocated = string_allocation(len(chunk))
            assert len(chunk) >= CHUNK_FIT_MIN_BYTES and allocated - len(chunk) <= allocated / 32
            assert string_allocation(len(chunk) + len(following) + 2) > allocated
    waste = sum(string_allocation(len(c)) for c in chunks) / sum(map(len, chunks))
    assert waste < 1.075, waste  # content-defined boundaries alone: 1.11 for this conversation


def test_large_chunks_at_another_offset_are_shared_from_the_first_content_defined_boundary_on() -> None:
    shared = big_conversation(300, "shared-")
    first = [*big_conversation(7, "a-"), *shared, *conversation(5, tag="end-a-")]
    second = [*big_conversation(23, "b-"), *shared, *conversation(4, tag="end-b-")]

    one, two = split_seed(first), split_seed(second)

    common = {chunk_digest(c) for c in one} & {chunk_digest(c) for c in two}
    common_bytes = sum(len(c) for c in two if chunk_digest(c) in common)
    assert common_bytes >= 0.8 * sum(len(codec.encode(m)) for m in dump_contents(shared))


def test_the_repaired_end_gets_its_own_chunk_so_siblings_share_everything_before_it() -> None:
    body = conversation(60)
    sibling_a = [*body, model("ack"), user("Directive A"), model("Understood.")]
    sibling_b = [*body, model("ack"), user("Directive B, longer"), model("Understood.")]

    chunks_a, chunks_b = split_seed(sibling_a), split_seed(sibling_b)

    assert chunks_a[:-1] == chunks_b[:-1]
    assert chunks_a[-1] != chunks_b[-1]
    assert len(codec.decode(chunks_a[-1])) == TAIL_MESSAGES


def test_a_chunk_cache_serves_verified_chunks_without_their_bytes() -> None:
    # Given a cache that decoded a record's context and seed chunks once
    record, chunks = record_for(conversation(40))
    cache = ChunkCache(1 << 20)
    data, digest = record.encode()
    first = join_seed(record, chunks, cache)
    assert BootstrapRecord.decode(data, fork_id="f-1", context=record.context_blob(), cache=cache) == record

    # When the same chunks are read again without their bytes
    again = join_seed(record, [b""] * len(chunks), cache)
    decoded = BootstrapRecord.decode(data, fork_id="f-1", context=b"", expected_digest=digest, cache=cache)

    # Then they come from the cache, equal to a fresh decode; a chunk it does not hold is still verified
    assert again == first == join_seed(record, chunks)
    assert decoded == record
    other, other_chunks = record_for(conversation(40, tag="other-"))
    with pytest.raises(RecordIntegrityError, match="seed chunk 0"):
        join_seed(other, [b"", *other_chunks[1:]], cache)


def test_a_chunk_cache_evicts_the_least_recently_used_beyond_its_bytes() -> None:
    cache = ChunkCache(100)
    cache.put(b"a", "A", 40)
    cache.put(b"b", "B", 40)
    assert cache.get(b"a") == "A"  # now the most recent

    cache.put(b"c", "C", 40)
    cache.put(b"huge", "H", 101)  # larger than the whole cache: never kept

    assert [d for d in (b"a", b"b", b"c", b"huge") if d in cache] == [b"a", b"c"]
    held = cache.hold([b"a", b"c"])
    cache.put(b"d", "D", 90)  # evicts both, but what was held stays readable for that read
    assert (held.get(b"a"), held.get(b"c"), b"a" in cache) == ("A", "C", False)


# ── result and state ─────────────────────────────────────────────────────────────────────────


def test_a_result_round_trips_through_its_canonical_bytes() -> None:
    result = ForkResult(
        fork_id="f-1", status=Status.SUCCEEDED, output="done", usage=Usage(input_tokens=3, model_calls=1)
    )

    assert ForkResult.decode(result.encode(), fork_id="f-1") == result
    assert result.encode() == ForkResult.model_validate(result.model_dump()).encode()


def test_only_succeeded_failed_and_cancelled_are_terminal() -> None:
    assert {s for s in Status if s.terminal} == {Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}


def test_state_is_read_from_the_hash_with_empty_fields_as_none() -> None:
    state = ForkState.from_hash(
        "f-1",
        {"status": "running", "kind": "spawn", "attempt": "2", "owner": "", "created_ms": "17", "error": ""},
    )

    assert (state.status, state.kind, state.attempt) == (Status.RUNNING, "spawn", 2)
    assert (state.owner, state.error, state.created_ms, state.started_ms) == (None, None, 17, None)


def test_declarations_are_parsed_once_per_parent_and_shared_by_its_forks() -> None:
    # Given two forks of one parent (equal tools_json) and a fork of another parent
    tools = '[{"name":"grep","parameters":{"type":"object"}},{"name":"edit"}]'
    first, _ = record_for(conversation(3), "f-1", tools_json=tools)
    second, _ = record_for(conversation(3), "f-2", tools_json=tools)
    other, _ = record_for(conversation(3), "f-3", tools_json='[{"name":"read_file"}]')
    declarations = Declarations(max_entries=2)

    # When a worker asks for each fork's declarations
    a, b, c = declarations.of(first), declarations.of(second), declarations.of(other)

    # Then they are the records' declarations, and the siblings share one parsed list
    assert (a, c) == (first.tools, other.tools)
    assert a is b and a is not c
    # and past its bound the cache starts over instead of growing
    declarations.of(record_for(conversation(3), "f-4", tools_json="[]")[0])
    assert len(declarations._parsed) == 1

"""Examples for workers.base.codec: canonical msgpack records and their digest (docs/fork-history.md §7)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import pytest

from tests.factories import agent_call, call, media, model, reminder, response, thought, user
from workers.base.codec import (
    MessageBounds,
    decode,
    decode_message,
    digest,
    encode,
    encode_array,
    encode_map,
    encode_message,
)
from workers.errors import ForkqError, RecordDecodeError
from workers.history.selection import ForkSeed, build_fork_seed

RECORD: dict[str, Any] = {
    "zeta": 1,
    "alpha": {"b": [1, 2, {"y": None, "x": True}], "a": "text"},
    "mid": b"\x00\xffbytes",
    "neg": -5,
    "big": 2**40,
}


def keys_in_encoded_order(data: bytes) -> list[Any]:
    """Every map's keys in the order they stand in the encoded bytes, depth first."""
    found: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, list) and all(isinstance(p, tuple) and len(p) == 2 for p in value) and value:
            found.append([k for k, _ in value])
            for _, v in value:
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(msgpack.unpackb(data, object_pairs_hook=list, raw=False))
    return found


def test_map_keys_are_sorted_at_every_depth() -> None:
    assert keys_in_encoded_order(encode(RECORD)) == [["alpha", "big", "mid", "neg", "zeta"], ["a", "b"], ["x", "y"]]


def test_encoding_the_same_value_twice_gives_identical_bytes() -> None:
    assert encode(RECORD) == encode(RECORD)


def test_the_key_order_of_the_input_does_not_change_the_bytes() -> None:
    reordered = {
        "big": 2**40,
        "neg": -5,
        "mid": b"\x00\xffbytes",
        "alpha": {"a": "text", "b": [1, 2, {"x": True, "y": None}]},
    }
    reordered["zeta"] = 1
    assert list(reordered) != list(RECORD)
    assert encode(reordered) == encode(RECORD)


def test_decode_of_encode_gives_the_value_back() -> None:
    assert decode(encode(RECORD)) == RECORD


def test_bytes_stay_bytes_and_str_stays_str() -> None:
    decoded = decode(encode({"b": b"abc", "s": "abc"}))
    assert type(decoded["b"]) is bytes
    assert type(decoded["s"]) is str
    assert decoded == {"b": b"abc", "s": "abc"}


def test_bytes_are_written_as_msgpack_bin_and_str_as_msgpack_str() -> None:
    assert encode(b"ab") == b"\xc4\x02ab"
    assert encode("ab") == b"\xa2ab"


@pytest.mark.parametrize("value", [{1: "a"}, {"ok": {2: "b"}}, {b"k": 1}, {None: 1}, {(1, 2): 3}])
def test_encode_refuses_a_map_key_that_is_not_a_str(value: dict[Any, Any]) -> None:
    with pytest.raises((TypeError, ValueError, ForkqError)):
        encode(value)


@pytest.mark.parametrize("value", [{1: "a"}, {"ok": {2: "b"}}, {b"k": 1}], ids=["int", "nested-int", "bytes"])
def test_decode_refuses_a_map_key_that_is_not_a_str(value: dict[Any, Any]) -> None:
    with pytest.raises(RecordDecodeError):
        decode(msgpack.packb(value, use_bin_type=True))


def test_decode_refuses_trailing_bytes_and_says_so() -> None:
    with pytest.raises(RecordDecodeError) as caught:
        decode(encode(RECORD) + b"\xc0")
    message = str(caught.value).lower()
    assert "extra" in message or "trailing" in message


def test_decode_refuses_extension_types_and_says_so() -> None:
    data = msgpack.packb({"x": msgpack.ExtType(7, b"pickled?")})
    with pytest.raises(RecordDecodeError) as caught:
        decode(data)
    assert "extension" in str(caught.value).lower()


@pytest.mark.parametrize("cut", [1, 3, 10])
def test_decode_refuses_truncated_data_and_says_so(cut: int) -> None:
    with pytest.raises(RecordDecodeError) as caught:
        decode(encode(RECORD)[:-cut])
    message = str(caught.value).lower()
    assert "incomplete" in message or "truncated" in message


def test_decode_refuses_empty_input() -> None:
    with pytest.raises(RecordDecodeError):
        decode(b"")


def test_a_decode_error_names_the_record_that_failed_and_keeps_the_cause() -> None:
    with pytest.raises(RecordDecodeError) as caught:
        decode(encode(RECORD) + b"\x00", what="bootstrap record f-123")
    assert "bootstrap record f-123" in str(caught.value)
    assert caught.value.__cause__ is not None


def test_the_digest_is_the_blake2b_256_hex_of_the_bytes() -> None:
    data = encode(RECORD)
    assert digest(data) == hashlib.blake2b(data, digest_size=32).hexdigest()
    assert len(digest(data)) == 64
    assert digest(data) != digest(data + b"\x00")


def seed() -> ForkSeed:
    history = [
        reminder("env"),
        user("task", media()),
        model(thought("plan", signature="c2ln"), call("c-1", "grep", {"q": None, "paths": ["a", "b"]})),
        user(response("c-1", "grep", {"hits": [1, 2], "none": None}), "next", envelope={"k": [None]}),
        model(agent_call("c-fork", "Rename it."), agent_call("c-sib", "Document it.")),
    ]
    return build_fork_seed(history, fork_turns="all", directive="Rename it.")


def test_a_seed_round_trips_exactly_through_encode_and_decode() -> None:
    wire = seed().to_wire()
    assert decode(encode(wire)) == wire
    assert ForkSeed.from_wire(decode(encode(wire))) == seed()


def test_a_seed_encodes_to_the_same_bytes_and_digest_every_time() -> None:
    first, second = encode(seed().to_wire()), encode(seed().to_wire())
    assert first == second
    assert digest(first) == digest(second)
    assert encode(decode(first)) == first


@pytest.mark.parametrize("size", [1, 15, 16, 300])
def test_a_map_built_from_encoded_values_has_the_bytes_of_encoding_it_whole(size: int) -> None:
    fields: dict[str, Any] = {f"k{i:03}": {"z": i, "a": [None, b"x"]} for i in range(size)}
    items = [RECORD, "text", 7]

    built = encode_map(fields, {"k050-items": encode_array([encode(v) for v in items])})

    assert built == encode({**fields, "k050-items": items})


def test_a_message_body_is_refused_once_it_holds_more_containers_or_elements_than_its_bounds() -> None:
    # Given bounds of a few containers and elements
    bounds = MessageBounds(containers=4, elements=8, map_entries=4, bin_bytes=16, str_bytes=16)

    # Then a body within them decodes, and one past any bound is refused naming it
    assert decode_message(encode_message([["f-1", b"x"], {}, {"a": None}]), bounds) == [["f-1", b"x"], {}, {"a": None}]
    for body in (
        b"\x94" + b"\x90" * 4,  # five arrays
        encode_message([list(range(9))]),  # nine elements
        encode_message([b"x" * 17]),  # a 17-byte value
    ):
        with pytest.raises(RecordDecodeError, match="not a forkq job"):
            decode_message(body, bounds)

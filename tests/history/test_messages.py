"""Examples for workers.history.messages: the wire round trip and parse_history (docs/fork-history.md §1)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from workers.errors import InvalidHistory
from workers.history.messages import Content, parse_history


def round_trip(raw: dict[str, Any]) -> dict[str, Any]:
    return Content.model_validate(raw).model_dump(mode="json", by_alias=True, exclude_none=True)


WIRE_EXAMPLES: dict[str, dict[str, Any]] = {
    "text": {"role": "user", "parts": [{"text": "fix the bug"}]},
    "thought": {"role": "model", "parts": [{"text": "plan", "thought": True, "thoughtSignature": "c2ln"}]},
    "call": {"role": "model", "parts": [{"functionCall": {"id": "c1", "name": "grep", "args": {"q": "x"}}}]},
    "output": {
        "role": "user",
        "parts": [{"functionResponse": {"id": "c1", "name": "grep", "response": {"output": "3 hits"}}}],
    },
    "error": {
        "role": "user",
        "parts": [{"functionResponse": {"id": "c1", "name": "grep", "response": {"error": "no such file"}}}],
    },
    "media-response": {
        "role": "user",
        "parts": [
            {
                "functionResponse": {
                    "id": "c2",
                    "name": "screenshot",
                    "response": {"output": "attached"},
                    "parts": [{"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}}],
                }
            }
        ],
    },
    "inline-data": {"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}}]},
    "file-data": {
        "role": "user",
        "parts": [{"fileData": {"fileUri": "gs://bucket/a.pdf", "mimeType": "application/pdf"}}],
    },
}


@pytest.mark.parametrize("raw", WIRE_EXAMPLES.values(), ids=WIRE_EXAMPLES.keys())
def test_every_part_kind_round_trips_unchanged(raw: dict[str, Any]) -> None:
    assert round_trip(copy.deepcopy(raw)) == raw


def test_unknown_keys_at_every_level_round_trip_unchanged() -> None:
    raw = {
        "role": "model",
        "parts": [
            {"text": "hi", "videoMetadata": {"startOffset": "1s"}, "partMeta": [1, "two", {"three": 3}]},
            {
                "functionCall": {"id": "c1", "name": "grep", "args": {"q": "x"}, "willContinue": True},
                "thoughtSignature": "c2ln",
                "callMeta": {"x": 1},
            },
            {
                "functionResponse": {
                    "id": "c1",
                    "name": "grep",
                    "response": {"output": "ok"},
                    "scheduling": "WHEN_IDLE",
                    "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA==", "displayName": "a.png"}}],
                },
            },
            {"fileData": {"fileUri": "gs://b/a", "mimeType": "text/plain", "displayName": "a"}},
            {"executableCode": {"language": "PYTHON", "code": "print(1)"}},
        ],
        "contentMeta": {"source": "provider", "ids": [1, 2]},
    }
    assert round_trip(copy.deepcopy(raw)) == raw


def test_nulls_inside_args_response_and_unknown_values_are_kept_exactly() -> None:
    raw = {
        "role": "model",
        "parts": [
            {"functionCall": {"id": "c1", "name": "f", "args": {"a": None, "b": [None, {"c": None}]}}},
            {"functionResponse": {"id": "c1", "name": "f", "response": {"output": None, "error": None}}},
            {"text": "x", "extraThing": {"k": None, "l": [None]}},
        ],
        "extraOnContent": {"nested": None},
    }
    assert round_trip(copy.deepcopy(raw)) == raw


@pytest.mark.parametrize(
    ("with_nulls", "without"),
    [
        ({"role": "user", "parts": [{"text": "a", "thought": None}]}, {"role": "user", "parts": [{"text": "a"}]}),
        (
            {"role": "model", "parts": [{"text": "a", "thoughtSignature": None, "functionCall": None}]},
            {"role": "model", "parts": [{"text": "a"}]},
        ),
        (
            {"role": "user", "parts": [{"text": None, "inlineData": {"mimeType": "image/png", "data": "AA=="}}]},
            {"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA=="}}]},
        ),
        (
            {"role": "user", "parts": [{"functionResponse": {"id": "c", "name": "f", "response": {}, "parts": None}}]},
            {"role": "user", "parts": [{"functionResponse": {"id": "c", "name": "f", "response": {}}}]},
        ),
        ({"role": "user", "parts": None}, {"role": "user"}),
    ],
    ids=["thought", "signature-and-call", "text", "response-parts", "content-parts"],
)
def test_a_null_own_key_counts_as_absent(with_nulls: dict[str, Any], without: dict[str, Any]) -> None:
    assert Content.model_validate(with_nulls) == Content.model_validate(without)
    assert round_trip(with_nulls) == round_trip(without)


def test_parse_history_returns_one_content_per_message() -> None:
    raw = list(WIRE_EXAMPLES.values())
    parsed = parse_history(copy.deepcopy(raw))
    assert [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in parsed] == raw


def names_index(error: InvalidHistory, index: int, later: int) -> bool:
    """The error's `.index` and message name message `index`, and the message does not name `later`."""
    numbers = re.findall(r"\d+", str(error))
    return error.index == index and str(index) in numbers and str(later) not in numbers


BAD_MESSAGES: dict[str, Any] = {
    "no-role": {"parts": [{"text": "a"}]},
    "null-role": {"role": None, "parts": [{"text": "a"}]},
    "system-role": {"role": "system", "parts": [{"text": "a"}]},
    "tool-role": {"role": "tool", "parts": [{"text": "a"}]},
    "role-case": {"role": "User", "parts": [{"text": "a"}]},
    "parts-string": {"role": "user", "parts": "hello"},
    "parts-object": {"role": "user", "parts": {"text": "a"}},
    "parts-of-strings": {"role": "user", "parts": ["hello"]},
    "parts-with-null": {"role": "user", "parts": [{"text": "a"}, None]},
    "string-item": "hello",
    "list-item": [{"role": "user", "parts": []}],
    "null-item": None,
}


@pytest.mark.parametrize("bad", BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_parse_history_names_the_first_bad_message_in_its_index_and_message(bad: Any) -> None:
    # Given two valid messages, then the bad one at index 2, then another bad one
    good = {"role": "user", "parts": [{"text": "ok"}]}
    raw = [good, {"role": "model", "parts": [{"text": "ok"}]}, bad, {"parts": "worse"}]
    # Then the error names message 2
    with pytest.raises(InvalidHistory) as caught:
        parse_history(raw)
    assert names_index(caught.value, 2, later=3)


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        ({"parts": []}, "role"),
        ({"role": "system", "parts": []}, "role"),
        ({"role": "user", "parts": "hello"}, "parts"),
        ({"role": "user", "parts": ["hello"]}, "parts"),
    ],
    ids=["no-role", "bad-role", "parts-not-list", "parts-not-objects"],
)
def test_parse_history_says_what_is_wrong_with_the_message(bad: dict[str, Any], what: str) -> None:
    with pytest.raises(InvalidHistory) as caught:
        parse_history([bad])
    assert caught.value.index == 0
    assert what in str(caught.value)


def test_parse_history_of_an_empty_list_is_empty() -> None:
    assert parse_history([]) == []


def test_parse_history_refuses_a_message_nested_past_the_bound_naming_its_index() -> None:
    args: Any = "leaf"
    for _ in range(600):
        args = {"a": args}
    history = [
        {"role": "user", "parts": [{"text": "hi"}]},
        {"role": "model", "parts": [{"functionCall": {"args": args}}]},
    ]

    with pytest.raises(InvalidHistory) as caught:
        parse_history(history)

    assert caught.value.index == 1
    assert str(caught.value).startswith("history[1] is nested more than 100 levels deep")


def test_parse_history_names_a_huge_number_without_failing_to_print_it() -> None:
    with pytest.raises(InvalidHistory, match="an integer of 16,610 bits"):
        parse_history([{"role": "user", "parts": [{"text": 10**5000}]}])

"""workers.base.limits: nesting depth measured without recursion, and messages that never fail to print a value."""

from __future__ import annotations

import time
from typing import Any

import pytest

from workers.base.limits import (
    MAX_NESTING_DEPTH,
    bad_text,
    find_bad_text,
    has_bad_text,
    nesting_depth,
    nesting_problem,
    shown,
    text_problem,
    too_deep,
)


def chain(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "depth"),
    [(0, 0), ("text", 0), ({}, 1), ([], 1), ({"a": [1, {"b": ()}]}, 4), ([{}, [[]]], 3), (chain(100), 100)],
)
def test_nesting_depth_counts_levels_of_objects_and_arrays(value: Any, depth: int) -> None:
    assert nesting_depth(value) == depth


def test_a_value_nested_200000_deep_is_measured_without_recursion_and_stops_past_the_limit() -> None:
    deep = chain(200_000)

    started = time.perf_counter()
    depth = nesting_depth(deep)
    elapsed = time.perf_counter() - started

    assert depth == MAX_NESTING_DEPTH + 1  # counted up to one past the limit, not to the bottom
    assert too_deep(deep) and not too_deep(chain(MAX_NESTING_DEPTH))
    assert elapsed < 0.5


def test_the_nesting_message_names_the_thing_the_bound_and_the_fix() -> None:
    message = nesting_problem("tools[2]")

    assert message.startswith("tools[2] is nested more than 100 levels deep")
    assert "at most 100 levels" in message and "as a JSON string" in message


@pytest.mark.parametrize(
    ("value", "text"),
    [(10**5000, "an integer of 16,610 bits"), ("x" * 100, "'" + "x" * 59 + "…"), (3, "3"), ([1], "[1]")],
    ids=["5000-digit-int", "long-text", "int", "list"],
)
def test_shown_values_are_brief_and_never_fail(value: Any, text: str) -> None:
    assert shown(value) == text


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ("\udcff", ("", "\udcff")),
        (["ok", {"a": [1, "caf\udce9"]}], ("[1].a[1]", "caf\udce9")),
        ({"ok": 1, "b\ud800": 2}, ("[key 1]", "b\ud800")),
        ({"weird key": {"x": "\ud800"}}, ("['weird key'].x", "\ud800")),
        (("tuple", ["\udfff"]), ("[1][0]", "\udfff")),
    ],
    ids=["scalar", "nested-value", "dict-key", "quoted-key", "tuple"],
)
def test_find_bad_text_names_the_path_of_the_first_string_that_is_not_valid_unicode(value: Any, found: Any) -> None:
    assert has_bad_text(value)
    assert find_bad_text(value) == found


@pytest.mark.parametrize(
    "value",
    ["plain", "café 😀 世界", {"ключ": ["\U0001f600", 5, None, 1.5, b"\xff"]}, chain(MAX_NESTING_DEPTH)],
    ids=["ascii", "non-ascii", "nested-non-ascii", "deep"],
)
def test_valid_text_in_any_script_with_surrogate_pairs_is_accepted(value: Any) -> None:
    assert not has_bad_text(value)
    assert find_bad_text(value) is None and bad_text("x", value) is None


def test_the_text_message_names_the_thing_the_character_and_the_byte_it_stands_for() -> None:
    assert text_problem("the prompt", "ab\udcff") == (
        "the prompt is not valid Unicode text: character 2 is a lone surrogate (U+DCFF, the byte 0xff that is not "
        "UTF-8); send UTF-8 text"
    )
    assert bad_text("history[3]", {"parts": [{"text": "\ud83d"}]}) == (
        "history[3].parts[0].text is not valid Unicode text: character 0 is a lone surrogate (U+D83D, such as a "
        "\\ud83d escape without its pair); send UTF-8 text"
    )
    assert text_problem("x", "fine") is None


def test_a_value_nested_200000_deep_is_searched_for_bad_text_without_recursion() -> None:
    deep: Any = "\ud800"
    for _ in range(200_000):
        deep = [deep]

    assert has_bad_text(deep)
    assert find_bad_text(deep) == ("[0]" * 200_000, "\ud800")

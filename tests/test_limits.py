"""workers.limits: nesting depth measured without recursion, and messages that never fail to print a value."""

from __future__ import annotations

import time
from typing import Any

import pytest

from workers.limits import MAX_NESTING_DEPTH, nesting_depth, nesting_problem, shown, too_deep


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

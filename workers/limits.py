"""Bounds on what a launch may carry, checked before anything is written to Redis.

A parent's data reaches canonical msgpack (which refuses values nested deeper than 255 levels), the
JSON parser (about 1,000) and, on the worker, the provider's request builders. A launch therefore
refuses, up front and naming the field, anything nested deeper than `MAX_NESTING_DEPTH` levels of
objects and arrays: each history message, each tool declaration, the system instruction and the
output schema. The check walks the value with an explicit stack, so a value nested 200,000 deep is
measured and refused, never recursed into.
"""

from __future__ import annotations

from typing import Any, Final

MAX_NESTING_DEPTH: Final = 100  # objects and arrays inside one message, declaration, instruction or schema
MAX_PARENT_FILE_BYTES: Final = 256 * 1024 * 1024  # `forkq launch --parent`
MAX_SCHEMA_FILE_BYTES: Final = 1024 * 1024  # `forkq launch --output-schema`
MAX_SNAPSHOT_DEPTH: Final = 1000  # a parent snapshot's `depth` (nesting is refused far below this)
MAX_LAUNCH_TURNS: Final = 1_000_000  # a launch's `max_turns`
MAX_LAUNCH_WALL_S: Final = 365 * 24 * 3600.0  # a launch's `max_wall_s` (a year)

_CONTAINERS: Final = (dict, list, tuple)


def nesting_depth(value: object, limit: int = MAX_NESTING_DEPTH) -> int:
    """Levels of dicts and lists (or tuples) in `value` (a scalar is 0, `{}` is 1), counted up to `limit + 1`.

    Iterative: the walk stops at the first level past `limit`, so its cost is bounded by the
    containers within `limit + 1` levels, however deep the value goes.
    """
    level: list[dict[Any, Any] | list[Any] | tuple[Any, ...]] = [value] if isinstance(value, _CONTAINERS) else []
    depth = 0
    while level and depth <= limit:
        depth += 1
        deeper: list[dict[Any, Any] | list[Any] | tuple[Any, ...]] = []
        add = deeper.append  # the loop below visits every value of a history: kept tight (bench/history.py)
        for container in level:
            for item in container.values() if isinstance(container, dict) else container:
                if isinstance(item, _CONTAINERS):
                    add(item)
        level = deeper
    return depth


def too_deep(value: object, limit: int = MAX_NESTING_DEPTH) -> bool:
    """True when `value` holds more than `limit` levels of dicts and lists."""
    return nesting_depth(value, limit) > limit


def nesting_problem(what: str, limit: int = MAX_NESTING_DEPTH) -> str:
    """The message for a value nested past `limit`: what it is, the bound, and the fix."""
    return (
        f"{what} is nested more than {limit} levels deep (objects and arrays); forkq accepts at most "
        f"{limit} levels: flatten the value, or send the deep part as a JSON string"
    )


def shown(value: object, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters for a message; never fails (repr of a 5,000-digit int raises)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length():,} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…"

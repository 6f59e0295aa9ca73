"""Bounds on what a launch may carry, checked before anything is written to Redis.

A parent's data reaches canonical msgpack (which refuses values nested deeper than 255 levels), the
JSON parser (about 1,000) and, on the worker, the provider's request builders. A launch therefore
refuses, up front and naming the field, anything nested deeper than `MAX_NESTING_DEPTH` levels of
objects and arrays: each history message, each tool declaration, the system instruction and the
output schema. The check walks the value with an explicit stack, so a value nested 200,000 deep is
measured and refused, never recursed into.

Every string a launch stores must also be valid Unicode: a lone surrogate (what Python makes of a byte
that is not UTF-8 on a command line, or a `"\\ud800"` escape in JSON) cannot be encoded as UTF-8, so
canonical msgpack refuses it. `text_problem` and `bad_text_path` find one, naming where it is.
"""

from __future__ import annotations

from typing import Any, Final

MAX_NESTING_DEPTH: Final = 100  # objects and arrays inside one message, declaration, instruction or schema
MAX_PARENT_FILE_BYTES: Final = 256 * 1024 * 1024  # `forkq launch --parent`
MAX_SCHEMA_FILE_BYTES: Final = 1024 * 1024  # `forkq launch --output-schema`
MAX_SNAPSHOT_DEPTH: Final = 1000  # a parent snapshot's `depth` (nesting is refused far below this)
MAX_LAUNCH_TURNS: Final = 1_000_000  # a launch's `max_turns`
MAX_TOKENS: Final = 10**15  # a launch's `max_tokens`, and a session's token budget: far past any bill, within int64
MAX_LAUNCH_WALL_S: Final = 365 * 24 * 3600.0  # a launch's `max_wall_s` (a year)
MAX_MESSAGE_BYTES: Final = 256 * 1024  # one message `send` gives a fork (UTF-8)
MAX_INBOX_MESSAGES: Final = 100  # messages waiting in one fork's inbox
INBOX_DELIVERY_BATCH: Final = 16  # messages a worker moves from the inbox into the journal at once

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


def text_problem(what: str, value: str) -> str | None:
    """Why `value` cannot be stored as UTF-8 text (it holds a lone surrogate), naming `what`; None when it can."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{what} is not valid Unicode text: {_surrogate(value, exc.start)}; send UTF-8 text"
    return None


def _surrogate(value: str, index: int) -> str:
    code = ord(value[index])
    where = f"character {index:,} is a lone surrogate (U+{code:04X}"
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: how Python keeps a byte that is not UTF-8 in argv or a file name
        return f"{where}, the byte 0x{code - 0xDC00:02x} that is not UTF-8)"
    return f"{where}, such as a \\u{code:04x} escape without its pair)"


def has_bad_text(value: object) -> bool:
    """True when a string in `value` (a value or a dict key, at any depth) is not valid Unicode text.

    Iterative, and tight: it visits every string of a parent's history (bench/history.py).
    """
    stack: list[Any] = [[value]]
    push = stack.append
    while stack:
        container = stack.pop()
        if isinstance(container, dict):
            for key in container:
                if isinstance(key, str) and not key.isascii() and text_problem("", key) is not None:
                    return True
            container = container.values()
        for item in container:
            kind = type(item)
            if kind is str:  # exact types first: the common case, checked without isinstance
                if not item.isascii() and text_problem("", item) is not None:
                    return True
            elif kind is dict or kind is list:
                push(item)
            elif isinstance(item, str):
                if text_problem("", item) is not None:
                    return True
            elif isinstance(item, _CONTAINERS):
                push(item)
    return False


def find_bad_text(value: object, root: str = "") -> tuple[str, str] | None:
    """The path (`root` then `.parts[0].text`, `[2]`, `[key 1]` for a dict's second key) and the string of the
    first string in `value` that is not valid Unicode text; None when there is none. For errors: slower than
    `has_bad_text`, which it runs first."""
    if not has_bad_text(value):
        return None
    # each entry: the item and its path as a chain of (parent chain, segment), joined only for the one found
    stack: list[tuple[Any, Any]] = [(value, None)]
    while stack:
        item, node = stack.pop()
        if isinstance(item, str):
            if text_problem("", item) is not None:
                return root + _joined(node), item
        elif isinstance(item, dict):
            for n, (key, child) in reversed(list(enumerate(item.items()))):
                name = f".{key}" if isinstance(key, str) and key.isidentifier() else f"[{shown(key, 40)}]"
                stack += [(child, (node, name)), (key, (node, f"[key {n}]"))]
        elif isinstance(item, list | tuple):
            stack += [(child, (node, f"[{i}]")) for i, child in reversed(list(enumerate(item)))]
    return None


def _joined(node: Any) -> str:
    segments: list[str] = []
    while node is not None:
        node, segment = node
        segments.append(segment)
    return "".join(reversed(segments))


def bad_text(what: str, value: object) -> str | None:
    """The message for the first string in `value` that is not valid Unicode text, naming where it is under
    `what` (`history[3].parts[0].text`); None when there is none."""
    found = find_bad_text(value, what)
    return None if found is None else text_problem(found[0], found[1])


def shown(value: object, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters for a message; never fails (repr of a 5,000-digit int raises)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length():,} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…"

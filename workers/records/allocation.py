"""How much memory Redis allocates for a string value, so that seed chunks can be cut to fit it.

Redis keeps a string in one allocation (sds header, bytes, terminator) that jemalloc, its default
allocator, rounds up to a size class: four classes per doubling (64, 80, 96, 112, 128 KiB, ...).
Content-defined chunks land anywhere in a class, and wasted 11% of a 5 MB seed's bytes there.
"""

from __future__ import annotations

from typing import Final

SLACK_SHIFT: Final = 5  # a chunk "nearly fills" its allocation when at most 1/32 of it is left over


def fills_its_class(count: int, size: int, item: int) -> bool:
    """Whether a chunk of `count` messages (`size` bytes) nearly fills its Redis allocation, and one more
    message of `item` bytes would take it into the next size class."""
    now = _array_bytes(count, size)
    allocated = string_allocation(now)
    nearly_full = allocated - now <= allocated >> SLACK_SHIFT
    return nearly_full and string_allocation(_array_bytes(count + 1, size + item)) > allocated


def _array_bytes(count: int, size: int) -> int:
    """Bytes of a msgpack array of `count` encoded items of `size` bytes in all."""
    return size + (1 if count < 16 else 3 if count < 1 << 16 else 5)


def string_allocation(length: int) -> int:
    """Bytes Redis allocates for a string value of `length` bytes (from 64 bytes on): its sds header and
    terminator, rounded up to jemalloc's size class (four classes per doubling)."""
    needed = length + (3 if length < 1 << 8 else 5 if length < 1 << 16 else 9) + 1
    step = 1 << max(4, needed.bit_length() - 3)
    return -(-needed // step) * step

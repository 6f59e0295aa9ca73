"""A fork's events as Server-Sent Events, resumable with `Last-Event-ID`.

Each event goes out with its Redis stream id as the SSE `id`, its type as `event` and its data as one
line of JSON; a client that reconnects with the last id it saw gets every event after it, once, in
order (the stream ids are the order). The stream ends after the fork's `finished` event, the one every
end (success, failure, cancel) writes, or at once when the client resumes after it. While nothing
happens, a comment (`: keep-alive`) goes out every `FORKQ_API_KEEPALIVE_S`, so proxies keep the
connection; each wait is one bounded `XREAD BLOCK`, holding a Redis connection and no thread.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any, Final

import redis

from workers.records.events import StreamEvent
from workers.store.reader import AsyncForkReader

EVENT_ID_RE: Final = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
EVENT_ID_PATTERN: Final = f"^{EVENT_ID_RE.pattern}$"
KEEP_ALIVE: Final = b": keep-alive\n\n"
READ_COUNT: Final = 100  # events per read: a long backlog goes out in pieces, each flushed

EVENTS_PATH: Final = "/v1/forks/{fork_id}/events"
DESCRIBED: Final = (
    "Server-Sent Events: one message per event of the fork (a `ForkEvent`): `id:` the event's id, `event:` its "
    "type, `data:` its data as one line of JSON. An event of a type added by a newer server goes out too, with "
    "its own type and data. The stream ends after the `finished` event."
)

log = logging.getLogger("forkq.api")


def document_events(document: dict[str, Any]) -> dict[str, Any]:
    """`document` with the event stream's `text/event-stream` schema: one message per `ForkEvent` member.

    The route declares the `ForkEvent` union as its model (so the union and each type's schemas are in the
    components, for clients' types), which FastAPI puts under `application/json`. A stream's schema
    describes one SSE message, whose `data` is a string: here it is one `oneOf` member per event type, its
    `event` the type and its `data` that type's data as JSON (`contentSchema`).
    """
    schemas = document["components"]["schemas"]
    ok = document["paths"][EVENTS_PATH]["get"]["responses"]["200"]
    union = ok["content"].pop("application/json")["schema"]["$ref"].rsplit("/", 1)[1]
    messages = []
    for kind, ref in schemas[union]["discriminator"]["mapping"].items():
        data = schemas[ref.rsplit("/", 1)[1]]["properties"]["data"]
        message = {
            "id": {"type": "string", "pattern": EVENT_ID_PATTERN},
            "event": {"const": kind},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data},
        }
        messages.append({"type": "object", "properties": message, "required": ["id", "event", "data"]})
    ok["content"]["text/event-stream"] = {"schema": {"oneOf": messages, "description": DESCRIBED}}
    return document


def frame(event: StreamEvent) -> bytes:
    """One SSE message: `id`, `event` and one line of JSON `data` (JSON never holds a raw newline).

    An event of a type this version does not know (`UnknownEvent`) goes out too, as it was stored.
    """
    data = json.dumps(event.wire_data(), ensure_ascii=False, separators=(",", ":"))
    return f"id: {event.id}\nevent: {event.type}\ndata: {data}\n\n".encode()


async def event_stream(
    reader: AsyncForkReader, fork_id: str, *, after: str, keepalive_s: float
) -> AsyncIterator[bytes]:
    """`_messages`, ended early (not failed: the response has started) when Redis fails; the client
    resumes with the last id it got, on this server or another."""
    try:
        async for message in _messages(reader, fork_id, after=after, keepalive_s=keepalive_s):
            yield message
    except redis.RedisError as exc:
        log.warning("fork %s: event stream ended by a Redis error: %s", fork_id, exc)


async def _messages(reader: AsyncForkReader, fork_id: str, *, after: str, keepalive_s: float) -> AsyncIterator[bytes]:
    """The SSE messages of a fork's events after stream id `after`, until its terminal event.

    The first read does not wait, so a client resuming after the end of an ended fork is answered at
    once. A fork found ended (or gone) with nothing after `after` gets one more read, which cannot miss
    its last events (the terminal status and its event are written together), then the stream ends.
    """
    block_ms: int | None = None
    ending = False
    while True:
        events = await reader.events(fork_id, after=after, block_ms=block_ms, count=READ_COUNT)
        for event in events:
            after = event.id
            yield frame(event)
            if event.terminal:
                return
        if not events and ending:
            return
        status = None if events else await reader.status(fork_id)
        ending = not events and (status is None or status.terminal)
        block_ms = None if ending else max(1, int(keepalive_s * 1000))
        if not events and not ending:
            yield KEEP_ALIVE

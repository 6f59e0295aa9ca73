"""The baseline of bench/sse.py: a bare Starlette app under uvicorn that holds Server-Sent Event streams.

Run by the benchmark as `uvicorn --factory bench.bare_sse:make_app`. `GET /events` sends one event, then a
keep-alive comment every `KEEPALIVE_S` until `POST /finish`, then a last event, and ends: the least a server
holding a thousand streams must do, without forkq's token check, Redis reads or fork ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Final

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

KEEPALIVE_S: Final = 15.0  # forkq's default FORKQ_API_KEEPALIVE_S
QUEUED: Final = b'id: 1-0\nevent: queued\ndata: {"kind":"fork"}\n\n'
FINISHED: Final = b'id: 2-0\nevent: finished\ndata: {"status":"succeeded"}\n\n'


def make_app() -> Starlette:
    """The app: `/events` (held until `/finish`), `/finish` and `/healthz`."""
    finished = asyncio.Event()

    async def stream() -> AsyncIterator[bytes]:
        yield QUEUED
        while not finished.is_set():
            try:
                await asyncio.wait_for(finished.wait(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
        yield FINISHED

    async def events(_: Request) -> Response:
        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def finish(_: Request) -> Response:
        finished.set()
        return PlainTextResponse("finished")

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    routes = [Route("/events", events), Route("/finish", finish, methods=["POST"]), Route("/healthz", healthz)]
    return Starlette(routes=routes)

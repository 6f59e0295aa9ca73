"""Request bodies: read whole, bounded, and gzip-decoded, before the app parses them.

A body may come `Content-Encoding: gzip` (a parent snapshot compresses well). Both the bytes sent and the
bytes they inflate to are bounded by `FORKQ_API_MAX_BODY_BYTES`: gzip is decoded as it arrives, asking
zlib for at most what is left under the limit, so a small body that would inflate to gigabytes (a gzip
bomb) is cut off at the limit, never inflated whole. Over the limit: 413; another encoding: 415; gzip that
is not valid: 400. The app then sees a plain body with a true `content-length`.
"""

from __future__ import annotations

import zlib
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from workers.api.problems import send_error
from workers.errors import RequestRefused

WITH_BODY: Final = frozenset({"POST", "PUT", "PATCH"})
GZIP_WBITS: Final = 16 + zlib.MAX_WBITS  # a gzip header and trailer around the deflate stream


class Inflater:
    """Bounded gzip decoding: `feed` compressed bytes, get at most `limit` decoded bytes in all, else RequestRefused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._zlib = zlib.decompressobj(GZIP_WBITS)

    def feed(self, data: bytes) -> bytes:
        """The bytes `data` decodes to (with what earlier feeds left pending)."""
        out = []
        pending = data
        while pending and not self._zlib.eof:
            # one byte past what is left: its presence is how the bomb is noticed, at a bounded cost
            chunk = self._decompress(pending, self.limit - self.size + 1)
            self.size += len(chunk)
            if self.size > self.limit:
                raise too_large(self.limit, "decompressed")
            out.append(chunk)
            pending = self._zlib.unconsumed_tail
        if self._zlib.unused_data:
            raise RequestRefused("the gzip body has data after its end; send one gzip stream", status=400)
        return b"".join(out)

    def finish(self) -> None:
        """Check that the stream ended (a truncated gzip body is refused)."""
        if not self._zlib.eof:
            raise RequestRefused(
                "the gzip body is truncated: it ends before the gzip stream does; send all of it", status=400
            )

    def _decompress(self, data: bytes, max_length: int) -> bytes:
        try:
            return self._zlib.decompress(data, max_length)
        except zlib.error as exc:
            raise RequestRefused(
                f"the body is not valid gzip ({exc}); send it gzip-compressed or plain", status=400
            ) from exc


def too_large(limit: int, what: str) -> RequestRefused:
    """The 413 for a body over the limit."""
    return RequestRefused(
        f"the request body is larger than {limit:,} bytes ({what}), the server's limit (FORKQ_API_MAX_BODY_BYTES); "
        "send a smaller body: a parent snapshot with less history, or a workspace without its largest files "
        '(.gitignore or .forkqignore, or workspace "shared")',
        status=413,
    )


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a request header, or None."""
    return next((value for key, value in scope.get("headers", ()) if key == name), None)


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request's whole body, decoded, within `limit` bytes sent and decoded (else RequestRefused)."""
    encoding = (header(scope, b"content-encoding") or b"identity").decode("latin-1").strip().lower()
    if encoding not in ("identity", "gzip"):
        raise RequestRefused(f"Content-Encoding {encoding!r} is not supported; send the body plain or gzip", status=415)
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, "as sent")
    inflater = Inflater(limit) if encoding == "gzip" else None
    parts: list[bytes] = []
    sent = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            raise RequestRefused("the client disconnected before sending the whole body", status=400)
        data: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        sent += len(data)
        if sent > limit:
            raise too_large(limit, "as sent")
        parts.append(data if inflater is None else inflater.feed(data))
    if inflater is not None:
        inflater.finish()
    return b"".join(parts)


class BodyLimit:
    """ASGI middleware: the body of a POST, PUT or PATCH is read here (bounded, decoded) and passed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WITH_BODY:
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(scope, receive, self.max_bytes)
        except RequestRefused as refused:
            await send_error(send, refused.status, refused.message, headers=[(b"connection", b"close")])
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the whole body once, then the client's own messages (a disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay

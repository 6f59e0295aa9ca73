"""A local HTTP server that answers model-API POSTs from a queue of canned replies and records each request.

A reply's body may be a callable: it gets the `Received` request and returns the body to send, so a
fake model can answer from what it was sent (echo a tool result, pick a branch by the prompt).
`FakeAPI(responder=...)` answers every request with a callable returning a `Reply`, for tests whose
concurrent requests arrive in no fixed order.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """One canned HTTP answer; `delay_s` makes it slow."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Received:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]
    json: Any
    raw: bytes = b""  # the body exactly as sent
    at: float = field(default_factory=time.monotonic)  # when it arrived (time.monotonic)


class FakeAPI:
    """`with FakeAPI() as api:` a server on 127.0.0.1 (free port); `api.replies` is consumed in order."""

    def __init__(self, responder: Callable[[Received], Reply] | None = None) -> None:
        self.responder = responder
        self.replies: deque[Reply] = deque()
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>` (no trailing slash)."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def reply(
        self, body: Any = None, *, status: int = 200, headers: dict[str, str] | None = None, delay_s: float = 0.0
    ):
        """Queue one reply."""
        self.replies.append(Reply(status, body, headers or {}, delay_s))
        return self

    def __enter__(self) -> FakeAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _next(self, received: Received) -> Reply:
        with self._lock:
            self.received.append(received)
            reply = self.replies.popleft() if self.replies else None
        if reply is None and self.responder is not None:
            return self.responder(received)
        if reply is not None and callable(reply.body):
            return Reply(reply.status, reply.body(received), reply.headers, reply.delay_s)
        if reply is not None:
            return reply
        return Reply(599, {"error": {"message": "fake server: no reply queued"}})

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                headers = {k.lower(): v for k, v in self.headers.items()}
                reply = api._next(Received("POST", self.path, headers, body, raw))
                time.sleep(reply.delay_s)  # not a synchronization: a slow server, as slow as the test scripts it
                data = json.dumps(reply.body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

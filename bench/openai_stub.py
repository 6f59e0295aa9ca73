"""An OpenAI-compatible Chat Completions server for benchmarks: at most K requests at once, 429 beyond that.

Run: `python bench/openai_stub.py --port P [--k 50] [--latency-s 1] [--retry-after-s 1] [--calls 3]`.
One asyncio process, so it holds thousands of connections (HTTP/1.1 keep-alive, as the `openai` SDK uses):

- `POST …/chat/completions`: at most K requests are served at once, each answered after a fixed latency;
  one that arrives while K are in service gets `429` with `Retry-After` (whole seconds, as HTTP writes it)
  and an OpenAI error body (`rate_limit_exceeded`), at once. A served request's slot is given back before
  its answer is written, so a client that sends its next request on reading the answer never finds the
  slot still taken.
- The answers are scripted from the request alone, so every fork makes exactly `--calls` model calls: a
  `list_directory` call on `.` (cheap, harmless, and every fork has it) until the request carries
  `calls - 1` answers to the stub's own tool calls (ids `stub-call-N`), then a final text answer.
- `GET /stats`: what it saw, as JSON: requests, served (200), throttled (429), bad requests, the most
  requests in service at once and the most connections open at once, the wall-clock (Unix s) of the
  first request and of the last answer, and per prompt_cache_key (the fork's parent session) the
  requests, served and throttled (the first 10,000 keys).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOOL = "list_directory"
CALL_PREFIX = "stub-call-"
MAX_HEADER_BYTES = 64 << 10
MAX_BODY_BYTES = 64 << 20
MAX_KEYS = 10_000
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 411: "Length Required", 429: "Too Many Requests"}


@dataclass
class Stats:
    """Counters of everything the stub saw (one event loop: no locks)."""

    requests: int = 0
    served: int = 0
    throttled: int = 0
    bad: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    open_connections: int = 0
    max_open_connections: int = 0
    first_request_at: float | None = None
    last_answer_at: float | None = None
    by_key: dict[str, Counter[str]] = field(default_factory=dict)

    def count(self, key: str | None, what: str) -> None:
        """One more `what` (requests, served, throttled) for a prompt_cache_key."""
        name = key or "-"
        if name not in self.by_key and len(self.by_key) >= MAX_KEYS:
            name = "(other)"
        self.by_key.setdefault(name, Counter())[what] += 1

    def as_json(self) -> dict[str, Any]:
        """What `GET /stats` answers."""
        return {
            "requests": self.requests,
            "served": self.served,
            "throttled": self.throttled,
            "bad": self.bad,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "open_connections": self.open_connections,
            "max_open_connections": self.max_open_connections,
            "first_request_at": self.first_request_at,
            "last_answer_at": self.last_answer_at,
            "by_key": {k: dict(v) for k, v in self.by_key.items()},
        }


@dataclass(frozen=True)
class Config:
    """The stub's capacity, latency, `Retry-After` and calls per fork."""

    k: int
    latency_s: float
    retry_after_s: int
    calls: int


def answer(request: dict[str, Any], calls: int, usage: tuple[int, int]) -> dict[str, Any]:
    """The scripted chat.completion for a request: the next tool call, or the final answer."""
    done = sum(
        1
        for m in request.get("messages", [])
        if m.get("role") == "tool" and str(m.get("tool_call_id", "")).startswith(CALL_PREFIX)
    )
    if done < calls - 1:
        call = {"id": f"{CALL_PREFIX}{done + 1}", "type": "function"}
        call["function"] = {"name": TOOL, "arguments": json.dumps({"path": "."})}
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": f"Listed the directory {done} times; nothing to change."}
        finish = "stop"
    return {
        "id": f"chatcmpl-stub-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(request.get("model", "stub")),
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
    }


def error(message: str, code: str) -> dict[str, Any]:
    """An OpenAI error body."""
    return {"error": {"message": message, "type": "requests", "param": None, "code": code}}


class Stub:
    """The server: `await Stub(config).serve(host, port)`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.stats = Stats()

    async def serve(self, host: str, port: int) -> None:
        """Listen until cancelled (a backlog deep enough for a thousand clients connecting at once)."""
        server = await asyncio.start_server(self.connection, host, port, backlog=4096, limit=MAX_HEADER_BYTES)
        print(f"openai stub listening on http://{host}:{port}/v1 (K={self.config.k})", flush=True)
        async with server:
            await server.serve_forever()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: requests one after another until it closes (keep-alive)."""
        stats = self.stats
        stats.open_connections += 1
        stats.max_open_connections = max(stats.max_open_connections, stats.open_connections)
        try:
            while await self.one_request(reader, writer):
                pass
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            stats.open_connections -= 1
            writer.close()

    async def one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read one request, answer it; whether the connection stays open."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, version = [*lines[0].split(" "), "", "", ""][:3]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if "chunked" in headers.get("transfer-encoding", ""):
            await self.write(writer, 411, error("send a Content-Length body", "length_required"), close=True)
            return False
        length = int(headers.get("content-length") or 0)
        if length > MAX_BODY_BYTES:
            await self.write(writer, 400, error(f"body over {MAX_BODY_BYTES} bytes", "too_large"), close=True)
            return False
        body = await reader.readexactly(length) if length else b""
        keep = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        status, payload, extra = await self.route(method, path.split("?")[0], body)
        await self.write(writer, status, payload, extra=extra, close=not keep)
        return keep

    async def route(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
        """The answer to one request: (status, JSON body, extra headers)."""
        if method == "GET" and path == "/stats":
            return 200, self.stats.as_json(), {}
        if method == "GET" and path == "/health":
            return 200, {"ok": True}, {}
        if method != "POST" or not path.endswith("/chat/completions"):
            return 404, error(f"no route {method} {path}; POST /v1/chat/completions or GET /stats", "not_found"), {}
        return await self.completion(body)

    async def completion(self, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
        """A chat completion: 429 at once when K are in service, else the scripted answer after the latency."""
        stats, config = self.stats, self.config
        stats.requests += 1
        if stats.first_request_at is None:
            stats.first_request_at = time.time()
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            stats.bad += 1
            return 400, error("expected a JSON chat.completions request with messages", "invalid_request"), {}
        key = request.get("prompt_cache_key")
        stats.count(key, "requests")
        if stats.in_flight >= config.k:
            stats.throttled += 1
            stats.count(key, "throttled")
            retry = {"Retry-After": str(config.retry_after_s)}
            return 429, error(f"Rate limit reached: {config.k} requests at once", "rate_limit_exceeded"), retry
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            await asyncio.sleep(config.latency_s)
        finally:
            stats.in_flight -= 1  # before the answer is written: the client's next request finds the slot free
        stats.served += 1
        stats.count(key, "served")
        stats.last_answer_at = time.time()
        return 200, answer(request, config.calls, (len(body) // 4, 12)), {}

    async def write(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        payload: dict[str, Any],
        *,
        extra: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        """Write one JSON answer."""
        data = json.dumps(payload).encode()
        head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}", "Content-Type: application/json"]
        head += [f"Content-Length: {len(data)}", f"Connection: {'close' if close else 'keep-alive'}"]
        head += [f"{name}: {value}" for name, value in (extra or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
        await writer.drain()


# ── for the benchmarks that start it ─────────────────────────────────────────────────────────


def command(port: int, *, k: int, latency_s: float, calls: int, retry_after_s: int = 1) -> list[str]:
    """The command line that starts the stub on `port`."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--k", str(k)]
    return [*argv, "--latency-s", str(latency_s), "--retry-after-s", str(retry_after_s), "--calls", str(calls)]


def stats(port: int, timeout_s: float = 10) -> dict[str, Any]:
    """The stub's `GET /stats`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=timeout_s) as reply:
        found: dict[str, Any] = json.loads(reply.read())
        return found


def wait_answering(port: int, exited: Callable[[], str | None], within_s: float = 30) -> None:
    """Until the stub on `port` answers; `exited()` says why a stub that stopped never will (None: it runs).

    Raises:
        RuntimeError: it exited, or did not answer within `within_s`.
    """
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        why = exited()
        if why is not None:
            raise RuntimeError(f"the stub exited: {why}")
        try:
            stats(port, timeout_s=1)
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the stub did not answer within {within_s:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--k", type=int, default=50, help="requests served at once (default 50)")
    parser.add_argument("--latency-s", type=float, default=1.0, help="seconds per served request (default 1)")
    parser.add_argument("--retry-after-s", type=int, default=1, help="the 429's Retry-After, seconds (default 1)")
    parser.add_argument("--calls", type=int, default=3, help="model calls per fork (default 3)")
    args = parser.parse_args(argv)
    if args.k < 1 or args.calls < 1 or args.latency_s < 0 or args.retry_after_s < 0:
        parser.error("--k and --calls must be at least 1, --latency-s and --retry-after-s at least 0")
    config = Config(args.k, args.latency_s, args.retry_after_s, args.calls)
    try:
        asyncio.run(Stub(config).serve(args.host, args.port))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()

"""Fixtures of the HTTP API's tests (tests/api/, and the e2e and CLI tests that serve it): `forkq serve`'s app
under uvicorn, on a free port, in a thread.

tests/conftest.py loads this module as a plugin. The app runs against the private Redis of the session
(`make_settings`), beside in-process workers on the same Redis, namespace and queue; the tests talk to it
with httpx, as any client would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from celery.worker import WorkController

from broker_config.settings import Settings
from tests.live import wait_until
from workers.api.app import make_api

TOKEN = "t0ken-for-the-api-tests"
HASHED_TOKEN = "an0ther-token-stored-as-its-hash"
TOKENS = f"{TOKEN}, sha256:{hashlib.sha256(HASHED_TOKEN.encode()).hexdigest()}"
FORK = {"description": "write expiry tests", "prompt": "Write the expiry tests.", "subagent_type": "fork"}
WARM_UP = threading.Lock()


@dataclass
class Api:
    """A running API server: its base URL and settings, and clients for it."""

    url: str
    settings: Settings

    def client(self, token: str | None = TOKEN, headers: dict[str, str] | None = None, **options: Any) -> httpx.Client:
        """An httpx client of the server, sending `token` as a bearer token (None: no Authorization header)."""
        auth = {} if token is None else {"Authorization": f"Bearer {token}"}
        return httpx.Client(base_url=self.url, headers={**auth, **(headers or {})}, timeout=30, **options)

    def async_client(self, token: str = TOKEN, **options: Any) -> httpx.AsyncClient:
        """An asyncio httpx client of the server."""
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, **options)


@pytest.fixture
def serve_api(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., Api]]:
    """Start the API (uvicorn in a thread) for the test's settings with `overrides`; each is stopped after the test."""
    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(*, require_auth: bool = True, **overrides: Any) -> Api:
        settings = make_settings(**{"api_tokens": TOKENS if require_auth else None, **overrides})
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(make_api(settings, require_auth=require_auth), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="api-server")
        thread.start()
        started.append((server, thread))

        def serving() -> bool:
            assert thread.is_alive(), "the API server's thread ended before it started serving"
            return bool(server.started)

        wait_until(serving, 10, "the API server to start")
        api = Api(url=f"http://127.0.0.1:{sock.getsockname()[1]}", settings=settings)
        # FastAPI builds its routes on the first request, inside `warnings.catch_warnings()`, which is not
        # thread-safe: two servers of one test process building at once can let the warning FastAPI silences
        # escape, and the tests turn warnings into errors. Each server builds them here, one at a time.
        with WARM_UP, api.client(token=TOKEN if require_auth else None) as client:
            assert client.get("/v1/forks/f-warm-up").status_code in (404, 503)  # 503: a test of a Redis outage
        return api

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture
def api(serve_api: Callable[..., Api]) -> Api:
    """The API with the test tokens (a plain one and one given as its SHA-256)."""
    return serve_api()


@pytest.fixture
def scripted_worker(
    make_settings: Callable[..., Settings], start_live_worker: Callable[..., WorkController], tmp_path: Path
) -> Callable[[list[dict[str, Any]]], WorkController]:
    """Start an in-process worker whose model answers with `steps` (the scripted provider's JSON steps)."""

    def start(steps: list[dict[str, Any]]) -> WorkController:
        script = tmp_path / "script.json"
        script.write_text(json.dumps({"steps": steps}), encoding="utf-8")
        from workers.app import make_app

        return start_live_worker(make_app(make_settings(script=script, provider="scripted")))

    return start


def sse_messages(lines: Iterator[str]) -> Iterator[dict[str, str]]:
    """The messages of an SSE stream's lines: each a dict of its fields (`id`, `event`, `data`), or
    `{"comment": ...}` for a comment line."""
    message: dict[str, str] = {}
    for line in lines:
        if line.startswith(":"):
            yield {"comment": line[1:].strip()}
        elif line:
            name, _, value = line.partition(":")
            message[name] = value.removeprefix(" ")
        elif message:
            yield message
            message = {}


def wait_status(http: httpx.Client, fork_id: str, status: str, timeout: float = 30) -> dict[str, Any]:
    """Poll `GET /v1/forks/{id}` until the fork has `status`; its state."""
    seen: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        seen.clear()
        seen.update(http.get(f"/v1/forks/{fork_id}").json())
        return dict(seen) if seen.get("status") == status else None

    state: dict[str, Any] = wait_until(
        reached, timeout, lambda: f"fork {fork_id} to be {status}; it is {seen.get('status')}"
    )
    return state


def no_keys_written(redis_client: Any) -> Callable[[], Any]:
    """A check that the database holds the same keys at its call as now."""
    before = sorted(redis_client.keys("*"))

    def check() -> None:
        assert sorted(redis_client.keys("*")) == before

    return check


@contextlib.contextmanager
def sse(client: httpx.Client, path: str, **headers: str) -> Iterator[Iterator[dict[str, str]]]:
    """An open SSE stream of `path`: its messages, as `sse_messages` gives them."""
    with client.stream("GET", path, headers={"Accept": "text/event-stream", **headers}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield sse_messages(response.iter_lines())

"""The fork's working directory, the tool registry and call helpers that the tool tests share.

tests/conftest.py loads this module as a plugin, so its fixtures (`work`, `live`, `finished`)
reach every test file: the tool tests and tests/subagents/test_capabilities.py start their in-process workers alike.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun

from broker_config.settings import Settings
from tests.loop_support import write_script
from workers.app import make_app, runtime_of
from workers.client import ForkClient
from workers.history.messages import FunctionCall
from workers.service.runner import WorkerRuntime
from workers.tools.builtins import load_tools
from workers.tools.registry import Tool, ToolContext, ToolRegistry


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """The fork's working directory; `tmp_path/outside` holds a secret beside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret: the key is 42\n", encoding="utf-8")
    cwd = tmp_path / "work"
    cwd.mkdir()
    return cwd


def context(cwd: Path, cancelled: Callable[[], bool] | None = None, within_s: float | None = None) -> ToolContext:
    """The context of call c1 of fork f-tools; `within_s`: the fork's wall-clock limit is that far away."""
    extra: dict[str, Any] = {} if cancelled is None else {"cancelled": cancelled}
    if within_s is not None:
        extra["deadline"] = time.monotonic() + within_s
    return ToolContext(fork_id="f-tools", cwd=cwd, call_id="c1", idempotency_key="f-tools:0:c1", **extra)


def run(registry: ToolRegistry, cwd: Path, name: str, **args: Any) -> dict[str, Any]:
    return registry.run(FunctionCall(id="c1", name=name, args=args), context(cwd))


def output(response: dict[str, Any]) -> str:
    assert "error" not in response, response
    text = response["output"]
    assert isinstance(text, str)
    return text


def error(response: dict[str, Any]) -> str:
    assert "output" not in response, response
    text = response["error"]
    assert isinstance(text, str)
    return text


MARGIN_S = 1.5  # scheduling slack on a busy machine


def unblock(path: Path) -> None:
    """Give a reader or writer blocked opening the FIFO its other end, then close it."""
    for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
        with contextlib.suppress(OSError):
            os.close(os.open(path, flags))


def run_bounded(registry: ToolRegistry, work: Path, fifo: Path, name: str, **args: Any) -> dict[str, Any]:
    """`run`, failing the test (rather than hanging it) if the call is still blocked after 10 s."""
    box: dict[str, dict[str, Any]] = {}
    thread = threading.Thread(target=lambda: box.update(result=run(registry, work, name, **args)), daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        unblock(fifo)
        thread.join(5)
        pytest.fail(f"{name} was still blocked on the FIFO after 10 s")
    return box["result"]


@pytest.fixture
def live(make_settings: Callable[..., Settings], tmp_path: Path) -> Iterator[Callable[..., ForkClient]]:
    """An in-process worker (threads pool) on a script, with extra tools; returns a client of its app."""
    with contextlib.ExitStack() as stack:

        def start(
            steps: list[dict[str, Any]], tools: tuple[Tool, ...] = (), concurrency: int = 4, **overrides: Any
        ) -> ForkClient:
            settings = make_settings(script=write_script(tmp_path, steps), **overrides)
            app = make_app(settings)
            stack.callback(app.close)
            registry = load_tools(default_timeout_s=settings.tool_timeout_s)
            for tool in tools:
                registry.register(tool)
            runtime_of(app).tools = registry  # a cached property: the instance attribute replaces it
            client = stack.enter_context(ForkClient(settings, app=app))
            stack.enter_context(
                start_worker(
                    app,
                    pool="threads",
                    concurrency=concurrency,
                    perform_ping_check=False,
                    loglevel="WARNING",
                    shutdown_timeout=30,
                )
            )
            return client

        yield start


def journal_of(settings: Settings, fork_id: str) -> list[Any]:
    return WorkerRuntime(settings).leases.journal(fork_id)


@pytest.fixture
def finished() -> Iterator[dict[str, Any]]:
    """Return values of the deliveries in-process workers finish during the test, by task id."""
    seen: dict[str, Any] = {}
    lock = threading.Lock()

    def record(task_id: str, retval: Any = None, **_: Any) -> None:
        with lock:
            seen[task_id] = retval

    task_postrun.connect(record, weak=False)
    yield seen
    task_postrun.disconnect(record)

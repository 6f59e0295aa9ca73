"""The handler threads (workers/tools/threads.py): reused when idle, started when none is, ended when idle too long.

Through `ToolRegistry.run`, as the child loop calls them: a stuck handler keeps its thread and never delays
the next call, and is still counted as abandoned.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.live import wait_until
from tests.tools_support import context, error, output
from workers.history.messages import FunctionCall
from workers.tools.registry import ABANDONED, Tool, ToolContext, ToolRegistry
from workers.tools.threads import HandlerThreads

MARKER: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="unset")


def thread_tool() -> Tool:
    """Answers with the ident of the thread it ran on, and marks its context."""

    def handler(args: Mapping[str, Any], ctx: ToolContext) -> str:
        seen = MARKER.get()
        MARKER.set("set by an earlier call")
        return f"{threading.get_ident()} {seen}"

    return Tool("which_thread", "Names its thread.", {"type": "object"}, handler)


def stuck_tool(release: threading.Event) -> Tool:
    """Blocks until released, not watching its context."""

    def handler(args: Mapping[str, Any], ctx: ToolContext) -> str:
        release.wait(10)
        return "released"

    return Tool("stuck_here", "Blocks.", {"type": "object"}, handler)


def registry_with(*tools: Tool, timeout_s: float = 5.0) -> ToolRegistry:
    registry = ToolRegistry(default_timeout_s=timeout_s)
    for tool in tools:
        registry.register(tool)
    return registry


def ran_on(registry: ToolRegistry, work: Path) -> tuple[int, str]:
    ident, seen = output(registry.run(FunctionCall(id="t", name="which_thread", args={}), context(work))).split(" ", 1)
    return int(ident), seen


def test_a_second_call_runs_on_the_thread_of_the_first_in_a_fresh_context(tmp_path: Path) -> None:
    registry = registry_with(thread_tool())
    first, _ = ran_on(registry, tmp_path)
    wait_until(lambda: registry.threads.idle() == 1, timeout=2.0, what="the first call's thread to wait")
    second, seen = ran_on(registry, tmp_path)
    assert second == first and first != threading.get_ident()
    assert seen == "unset"  # the first call's context variable did not leak into the second


def test_a_stuck_call_keeps_its_thread_and_the_next_call_runs_at_once(tmp_path: Path) -> None:
    # Given a registry whose only thread runs a call stuck past its time limit
    release = threading.Event()
    registry = registry_with(thread_tool(), stuck_tool(release), timeout_s=0.2)
    stuck = FunctionCall(id="s", name="stuck_here", args={})
    try:
        assert "did not finish within its time limit" in error(registry.run(stuck, context(tmp_path)))
        assert ABANDONED.count("stuck_here") == 1 and registry.threads.idle() == 0

        # When another call comes, Then it runs at once on a new thread
        started = time.monotonic()
        ran_on(registry, tmp_path)
        assert time.monotonic() - started < 0.5
        assert ABANDONED.count("stuck_here") == 1
    finally:
        release.set()
    # and once the stuck handler ends, it is no longer counted and its thread waits for calls too
    wait_until(lambda: ABANDONED.count("stuck_here") == 0, timeout=5.0, what="the abandoned call to end")
    wait_until(lambda: registry.threads.idle() == 2, timeout=5.0, what="both threads to wait")


def test_calls_at_once_each_get_a_thread_and_idle_threads_end() -> None:
    threads = HandlerThreads(idle_s=0.2)
    gate = threading.Barrier(3, timeout=5.0)
    idents: list[int] = []

    def call() -> None:
        idents.append(threading.get_ident())
        gate.wait()  # all three run at the same time: none waited for another's thread

    for _ in range(3):
        threads.submit(call)
    wait_until(lambda: len(idents) == 3 and threads.idle() == 3, timeout=5.0, what="three threads to wait")
    assert len(set(idents)) == 3
    wait_until(lambda: threads.idle() == 0, timeout=5.0, what="the idle threads to end")
    alive = [t for t in threading.enumerate() if t.ident in idents]
    wait_until(lambda: not any(t.is_alive() for t in alive), timeout=5.0, what="the threads to exit")

"""The tool registry (workers/tools/registry.py), run as the child loop runs it: schemas, errors, deadlines.

Arguments are validated against each tool's schema before its handler runs; a handler's failure is an
error response; every call has a deadline and notices a cancel, even when its handler never returns.
The tests at the end run forks stuck in a tool call through an in-process Celery worker on the private Redis.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.live import wait_until
from tests.loop_support import FORK, call, parent_for, step, tool_results, workdir
from tests.tools_support import MARGIN_S, context, error, journal_of, output, run, unblock
from workers.client import ForkClient
from workers.errors import ConfigurationError
from workers.history.messages import FunctionCall
from workers.records.fork import Status
from workers.service.metrics import Metrics
from workers.tools.registry import (
    TOOL_MAX_ABANDONED,
    TOOL_STOP_GRACE_S,
    TOOL_WAIT_POLL_S,
    Tool,
    ToolContext,
    ToolError,
    ToolRegistry,
    resolve_inside,
)

# ── the registry ───────────────────────────────────────────────────────────────────────────────


def test_a_tool_context_is_never_cancelled_by_default(work: Path) -> None:
    assert context(work).cancelled() is False


def test_an_unknown_tool_is_answered_with_the_available_ones(registry: ToolRegistry, work: Path) -> None:
    message = error(run(registry, work, "rm_rf"))
    assert "'rm_rf' is not available" in message and "read_file" in message


def recording_tool(calls: list[Mapping[str, Any]], parameters: Mapping[str, Any]) -> Tool:
    def handler(args: Mapping[str, Any], ctx: ToolContext) -> str:
        calls.append(args)
        return "ran"

    return Tool("record", "Records its arguments.", parameters, handler)


STRICT = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "count": {"type": "integer", "minimum": 1}},
    "required": ["path"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({}, "'path' is a required property"),
        ({"path": 3}, "argument 'path': 3 is not of type 'string'"),
        ({"path": "a", "count": "two"}, "argument 'count': 'two' is not of type 'integer'"),
        ({"path": "a", "count": 0}, "argument 'count': 0 is less than the minimum of 1"),
        ({"path": "a", "file_path": "b"}, "('file_path' was unexpected)"),
    ],
)
def test_arguments_breaking_the_schema_are_refused_before_the_handler_runs(
    work: Path, args: dict[str, Any], expected: str
) -> None:
    calls: list[Mapping[str, Any]] = []
    registry = ToolRegistry()
    registry.register(recording_tool(calls, STRICT))
    message = error(run(registry, work, "record", **args))
    assert expected in message
    assert "Nothing was run" in message and "path (string, required), count (integer)" in message
    assert calls == []


def test_valid_arguments_reach_the_handler(work: Path) -> None:
    calls: list[Mapping[str, Any]] = []
    registry = ToolRegistry()
    registry.register(recording_tool(calls, STRICT))
    assert run(registry, work, "record", path="a", count=2) == {"output": "ran"}
    assert calls == [{"path": "a", "count": 2}]


def test_a_huge_bad_argument_is_clipped_in_the_error(work: Path) -> None:
    registry = ToolRegistry()
    registry.register(recording_tool([], {"type": "object", "properties": {"n": {"type": "integer"}}}))
    message = error(run(registry, work, "record", n="x" * 100_000))
    assert len(message) < 1000 and "…" in message


def test_a_schema_that_is_not_json_schema_is_refused_at_registration() -> None:
    bad = recording_tool([], {"type": "object", "properties": {"n": {"type": "integr"}}})
    with pytest.raises(ConfigurationError, match="'record': its parameters are not a valid JSON schema") as caught:
        ToolRegistry().register(bad)
    assert caught.value.field == "record"


def test_the_declared_schema_draft_is_the_one_validated_against(work: Path) -> None:
    # draft-04's boolean exclusiveMinimum is invalid in 2020-12: registering proves the draft was honoured
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {"n": {"type": "number", "minimum": 0, "exclusiveMinimum": True}},
    }
    registry = ToolRegistry()
    registry.register(recording_tool([], draft4))
    assert "less than or equal to the minimum of 0" in error(run(registry, work, "record", n=0))
    assert run(registry, work, "record", n=1) == {"output": "ran"}


def test_a_tool_put_into_the_dict_directly_is_still_validated(work: Path) -> None:
    calls: list[Mapping[str, Any]] = []
    registry = ToolRegistry()
    registry.tools["record"] = recording_tool(calls, STRICT)
    assert "'path' is a required property" in error(run(registry, work, "record"))
    assert calls == []


def test_handler_failures_become_error_responses(work: Path) -> None:
    def refuse(args: Mapping[str, Any], ctx: ToolContext) -> str:
        raise ToolError("refused: reason given")

    def crash(args: Mapping[str, Any], ctx: ToolContext) -> str:
        raise KeyError("boom")

    registry = ToolRegistry()
    registry.register(Tool("refuse", "Refuses.", {"type": "object"}, refuse))
    registry.register(Tool("crash", "Crashes.", {"type": "object"}, crash))
    assert run(registry, work, "refuse") == {"error": "refused: reason given"}
    assert error(run(registry, work, "crash")) == "tool 'crash' failed: KeyError: 'boom'"


def test_resolve_inside_refuses_an_unresolvable_path(work: Path) -> None:
    with pytest.raises(ToolError, match="cannot be resolved"):
        resolve_inside(work, "bad\0name")


# ── a deadline for every call, and cancellation (issue 11, item 6) ─────────────────────────────


def blocking_tool(release: threading.Event) -> Tool:
    """A handler blocked where it never looks at its deadline, as a plugin's stuck call may be."""

    def handler(args: Mapping[str, Any], ctx: ToolContext) -> str:
        release.wait()
        return "released"

    return Tool("stuck", "Blocks until released.", {"type": "object"}, handler)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set after the test, so the abandoned handler threads end with it."""
    event = threading.Event()
    yield event
    event.set()


STUCK = FunctionCall(id="c1", name="stuck", args={})


def test_a_handler_that_never_returns_is_answered_with_an_error_at_its_time_limit(
    work: Path, release: threading.Event
) -> None:
    registry = ToolRegistry(default_timeout_s=0.5)
    registry.register(blocking_tool(release))
    started = time.monotonic()
    message = error(registry.run(STUCK, context(work)))
    elapsed = time.monotonic() - started
    assert "tool 'stuck' did not finish within its time limit of 0.5 s" in message and "abandoned" in message
    assert 0.5 <= elapsed < 0.5 + TOOL_STOP_GRACE_S + MARGIN_S


def test_the_forks_wall_clock_limit_cuts_a_call_its_tool_would_allow_longer(
    work: Path, release: threading.Event
) -> None:
    registry = ToolRegistry(default_timeout_s=600)
    registry.register(blocking_tool(release))
    started = time.monotonic()
    message = error(registry.run(STUCK, context(work, within_s=0.5)))
    assert "did not finish within its time limit of 0.5 s" in message
    assert time.monotonic() - started < 0.5 + TOOL_STOP_GRACE_S + MARGIN_S
    assert "no time left" in error(registry.run(STUCK, context(work, within_s=-1)))


def test_a_cancelled_fork_stops_waiting_for_a_stuck_handler(work: Path, release: threading.Event) -> None:
    registry = ToolRegistry(default_timeout_s=600)
    registry.register(blocking_tool(release))
    cancel = threading.Event()
    timer = threading.Timer(0.3, cancel.set)
    started = time.monotonic()
    timer.start()
    try:
        message = error(registry.run(STUCK, context(work, cancelled=cancel.is_set)))
    finally:
        timer.cancel()
    assert message == "the fork was cancelled or stopped while tool 'stuck' ran; the call was abandoned"
    assert time.monotonic() - started < 0.3 + TOOL_WAIT_POLL_S + TOOL_STOP_GRACE_S + MARGIN_S


def test_a_handler_that_watches_its_context_stops_at_the_deadline_with_its_own_answer(work: Path) -> None:
    def patient(args: Mapping[str, Any], ctx: ToolContext) -> str:
        while not ctx.cancelled():  # turns true once the caller stops waiting
            time.sleep(0.01)  # not a synchronization of the test: the handler under test polls its context
        raise ToolError(f"stopped {'past' if ctx.seconds_left() <= 0 else 'before'} the deadline")

    registry = ToolRegistry(default_timeout_s=0.3)
    registry.register(Tool("patient", "Waits.", {"type": "object"}, patient))
    assert run(registry, work, "patient") == {"error": "stopped past the deadline"}


def test_a_tool_with_four_abandoned_calls_still_running_is_refused_until_they_end(work: Path) -> None:
    release = threading.Event()
    registry = ToolRegistry(default_timeout_s=0.2)
    registry.register(dataclasses.replace(blocking_tool(release), name="stuck_plugin"))
    metrics = Metrics(CollectorRegistry())
    call = FunctionCall(id="c1", name="stuck_plugin", args={})

    def abandoned() -> float | None:
        return metrics.registry.get_sample_value("forkq_tool_calls_abandoned", {"tool": "stuck_plugin"})

    try:
        for _ in range(TOOL_MAX_ABANDONED):
            assert "did not finish within its time limit" in error(registry.run(call, context(work)))
        assert abandoned() == TOOL_MAX_ABANDONED
        started = time.monotonic()
        message = error(registry.run(call, context(work)))
        assert message.startswith("tool 'stuck_plugin' was not run: 4 earlier calls of it did not finish"), message
        assert "Continue without it" in message and time.monotonic() - started < 0.1
    finally:
        release.set()
    wait_until(lambda: abandoned() is None, timeout=5.0, what="the abandoned threads to end")
    release.clear()
    threading.Timer(0.05, release.set).start()
    assert output(registry.run(call, context(work))) == "released"


# ── through real workers: the fork's view of all this ──────────────────────────────────────────


def fifo_read(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """A plugin reading a file the naive way: open() of a FIFO without a writer blocks in the kernel."""
    with open(ctx.cwd / str(args["path"]), encoding="utf-8") as stream:
        return stream.read()


FIFO_READ = Tool(
    "fifo_read",
    "Reads a file.",
    {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    fifo_read,
)


def with_tools(parent: dict[str, Any], work: Path, *tools: Tool, mode: str = "yolo") -> dict[str, Any]:
    """The parent snapshot for `work`, declaring `tools` besides its own."""
    declared = [*parent["tools"], *(tool.declaration for tool in tools)]
    return parent_for(parent, work, mode, tools=declared)


def test_a_call_stuck_on_a_fifo_is_answered_at_its_time_limit_and_the_fork_goes_on(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a worker whose tool calls have 1 s, and a fork that reads a FIFO with a plugin, read_file and grep
    work = workdir(tmp_path)
    os.mkfifo(work / "pipe")
    steps = [
        step(
            call("p1", "fifo_read", path="pipe"),
            call("r1", "read_file", path="pipe"),
            call("g1", "grep_search", pattern="limiter"),
        ),
        step("done"),
    ]
    client = live(steps, tools=(FIFO_READ,), tool_timeout_s=1.0)

    # When the fork runs
    handle = client.launch(with_tools(parent, work, FIFO_READ), FORK, workspace="shared")
    try:
        result = handle.wait(timeout=30)
    finally:
        unblock(work / "pipe")

    # Then the stuck call got an error at its limit, read_file refused the FIFO, grep skipped it: the fork went on
    assert result.status is Status.SUCCEEDED and result.output == "done", result.error
    responses = tool_results(journal_of(client.settings, handle.fork_id))
    assert "tool 'fifo_read' did not finish within its time limit of 1 s" in responses["p1"]["error"]
    assert responses["r1"]["error"].startswith("'pipe' is a FIFO, not a regular file")
    assert responses["g1"] == {"output": "notes.txt:1:the limiter uses INCR then EXPIRE"}


def test_the_wall_clock_limit_ends_a_fork_stuck_in_a_tool_call(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    work = workdir(tmp_path)
    os.mkfifo(work / "pipe")
    client = live([step(call("p1", "fifo_read", path="pipe")), step("never")], tools=(FIFO_READ,))
    started = time.monotonic()
    handle = client.launch(with_tools(parent, work, FIFO_READ), FORK, max_wall_s=1.5, workspace="shared")
    try:
        result = handle.wait(timeout=30)
    finally:
        unblock(work / "pipe")
    assert result.status is Status.FAILED and (result.error or "").startswith("wall_clock:")
    assert time.monotonic() - started < 1.5 + TOOL_STOP_GRACE_S + 5  # launch and worker pickup included


def test_cancelling_a_fork_stuck_on_a_fifo_frees_its_worker_slot_within_one_heartbeat(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path, finished: dict[str, Any]
) -> None:
    # Given a one-slot worker with a 1 s heartbeat, whose fork is stuck opening a FIFO
    work = workdir(tmp_path)
    os.mkfifo(work / "pipe")
    steps = [step(call("p1", "fifo_read", path="pipe")), step("done")]
    client = live(steps, tools=(FIFO_READ,), concurrency=1, heartbeat_s=1.0, lease_ttl_s=3.0)
    stuck = client.launch(with_tools(parent, work, FIFO_READ), FORK, workspace="shared")
    try:
        wait_until(
            lambda: any(e.kind == "tool_started" for e in journal_of(client.settings, stuck.fork_id)),
            what="the call to start",
        )

        # When it is cancelled
        began = time.monotonic()
        assert stuck.cancel() is Status.CANCELLED
        wait_until(lambda: f"{stuck.fork_id}.1" in finished, timeout=15, what="the delivery to end")
        freed_after = time.monotonic() - began
    finally:
        unblock(work / "pipe")

    # Then the delivery ended within a heartbeat (the stuck handler is not waited for), and the slot runs the next fork
    assert finished[f"{stuck.fork_id}.1"] == "cancelled"
    assert freed_after < 1.0 + TOOL_WAIT_POLL_S + MARGIN_S
    other = tmp_path / "other"
    other.mkdir()
    (other / "pipe").write_text("a plain file\n", encoding="utf-8")
    after = client.launch(with_tools(parent, other, FIFO_READ), FORK, workspace="shared").wait(timeout=20)
    assert after.status is Status.SUCCEEDED and after.output == "done"

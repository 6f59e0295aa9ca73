"""RunObserver: loop events become latencies, counters and per-step `task-progress` Celery events."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import WorkController
from prometheus_client import CollectorRegistry

from broker_config.settings import Settings
from tests.live import wait_until
from workers.app import runtime_of
from workers.client import ForkClient
from workers.records.events import ModelCallData, ModelCallEvent, StepData, StepEvent, ToolData, ToolEvent
from workers.records.fork import Status
from workers.service.metrics import Metrics
from workers.service.outcome import Outcome
from workers.service.progress import RunObserver, step_progress
from workers.service.tasks import final_event


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def model_call(step: int) -> ModelCallEvent:
    return ModelCallEvent(data=ModelCallData(step=step, request_digest="d"))


def step_event(**data: Any) -> StepEvent:
    return StepEvent(data=StepData(**data))


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_model_call_and_step_latencies_tokens_and_tools_are_measured_from_loop_events() -> None:
    # Given an observed run on a hand-moved clock
    registry, clock, sent = CollectorRegistry(), Clock(), []
    run = RunObserver(Metrics(registry), {"read_file"}, attempt=2, progress=sent.append, clock=clock)

    # When step 1 calls the model for 2 s and runs two tools for 1 s, and step 2 answers after 3 s
    run.observe(model_call(1))
    clock.now += 2
    run.observe(step_event(step=1, tool_calls=["read_file", "invented"], input_tokens=10, output_tokens=3))
    run.observe(ToolEvent(data=ToolData(step=1, tool="read_file", ok=True)))
    run.observe(ToolEvent(data=ToolData(step=1, tool="invented", ok=False)))
    clock.now += 1
    run.observe(model_call(2))
    clock.now += 3
    run.observe(step_event(step=2, tool_calls=[], input_tokens=20, output_tokens=5, cached_input_tokens=16))
    assert sample(registry, "forkq_forks_running") == 1
    run.ended(Outcome.SUCCEEDED)
    run.close()

    # Then each model call and each step was timed, and tokens and tools counted
    assert sample(registry, "forkq_model_call_seconds_sum") == 5
    assert sample(registry, "forkq_model_call_seconds_count") == 2
    assert sample(registry, "forkq_step_seconds_sum") == 6  # 3 s (call + tools), then 3 s
    assert sample(registry, "forkq_step_seconds_count") == 2
    assert sample(registry, "forkq_tokens_total", direction="input") == 30
    assert sample(registry, "forkq_tokens_total", direction="output") == 8
    assert sample(registry, "forkq_cached_input_tokens_total") == 16  # a step without the field counts none
    assert sample(registry, "forkq_tool_calls_total", tool="read_file", outcome="ok") == 1
    assert sample(registry, "forkq_tool_calls_total", tool="other", outcome="error") == 1
    assert sample(registry, "forkq_claim_attempt_bucket", le="2.0") == 1
    assert sample(registry, "forkq_claim_attempt_bucket", le="1.0") == 0
    assert sample(registry, "forkq_forks_finished_total", status="succeeded") == 1
    assert sample(registry, "forkq_forks_running") == 0

    # And one progress report per step
    assert [(p["step"], p["tools"], p["attempt"]) for p in sent] == [(1, ["read_file", "invented"], 2), (2, [], 2)]


def test_a_run_stopped_mid_step_does_not_time_the_unfinished_step() -> None:
    registry, clock = CollectorRegistry(), Clock()
    run = RunObserver(Metrics(registry), set(), attempt=1, clock=clock)

    run.observe(model_call(1))
    clock.now += 5
    run.ended(Outcome.RELEASED)
    run.close()

    assert sample(registry, "forkq_step_seconds_count") == 0
    assert sample(registry, "forkq_model_call_seconds_count") == 0
    assert sample(registry, "forkq_forks_finished_total", status="released") == 1


def test_a_run_left_by_an_exception_counts_as_error() -> None:
    registry = CollectorRegistry()
    run = RunObserver(Metrics(registry), set(), attempt=1)

    run.close()  # `ended` never called: an exception left the run

    assert sample(registry, "forkq_forks_finished_total", status="error") == 1
    assert sample(registry, "forkq_forks_running") == 0


def test_a_failing_progress_callback_never_reaches_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    def broken(fields: dict[str, Any]) -> None:
        raise ConnectionError("broker down")

    run = RunObserver(Metrics(CollectorRegistry()), set(), attempt=1, progress=broken)

    run.observe(step_event(step=1, tool_calls=[], input_tokens=1, output_tokens=1))

    assert "progress event of step 1 not sent: broker down" in caplog.text


def test_step_progress_carries_the_step_its_tools_and_tokens_and_a_line_for_flower() -> None:
    fields = step_progress(StepData(step=3, tool_calls=["grep_search"], input_tokens=1234, output_tokens=56), 2)

    assert fields == {
        "step": 3,
        "attempt": 2,
        "tools": ["grep_search"],
        "input_tokens": 1234,
        "output_tokens": 56,
        "result": "step 3: called grep_search (1,234 in / 56 out tokens, attempt 2)",
    }


# ── task-progress events from a live worker ──────────────────────────────────────────────────


@pytest.fixture
def settings(make_settings: Callable[..., Settings], tmp_path: Path) -> Settings:
    """A two-step script: a tool call, then the answer."""
    script = tmp_path / "script.json"
    call = {"functionCall": {"id": "c1", "name": "list_directory", "args": {"path": "."}}}
    steps = [{"content": {"role": "model", "parts": [call]}}, {"content": {"role": "model", "parts": [{"text": "ok"}]}}]
    script.write_text(json.dumps({"steps": steps}))
    return make_settings(script=script, heartbeat_file=tmp_path / "worker.heartbeat")


@pytest.fixture
def task_events(app: Celery, redis_client: redis.Redis) -> Iterator[list[dict[str, Any]]]:
    """Every `task-*` Celery event published while the test runs (a receiver in a thread)."""
    seen: list[dict[str, Any]] = []
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": seen.append})
        thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False), daemon=True)
        thread.start()
        # the fanout exchange is Redis pub/sub: events sent before the subscription are lost
        wait_until(lambda: redis_client.pubsub_numpat() + len(redis_client.pubsub_channels()) > 0, what="subscribe")
        yield seen
        receiver.should_stop = True
        thread.join(timeout=5)


def test_each_step_of_a_running_fork_is_a_task_progress_event(
    app: Celery,
    client: ForkClient,
    start_live_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    task_events: list[dict[str, Any]],
) -> None:
    start_live_worker(app)

    handle = client.launch(parent, {"description": "p", "prompt": "look around", "subagent_type": "fork"})
    assert handle.wait(timeout=30).status == Status.SUCCEEDED

    task_id = f"{handle.fork_id}.1"
    wait_until(
        lambda: any(e["type"] == "task-succeeded" and e["uuid"] == task_id for e in list(task_events)),
        what="the task-succeeded event",
    )
    mine = [e for e in task_events if e.get("uuid") == task_id]
    progress = [e for e in mine if e["type"] == "task-progress"]
    assert [(e["step"], e["tools"]) for e in progress] == [(1, ["list_directory"]), (2, [])]
    assert progress[0]["result"].startswith("step 1: called list_directory")
    # the delivery's own outcome comes last, after its progress
    assert [e["type"] for e in mine][-1] == "task-succeeded"
    assert mine[-1]["result"] == "'succeeded'"


def test_a_delivery_that_parks_its_fork_ends_in_a_custom_state_flower_shows(
    app: Celery,
    client: ForkClient,
    start_live_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    task_events: list[dict[str, Any]],
) -> None:
    # Given a fork whose parent is in `default` mode, so its first mutating call waits for a person
    start_live_worker(app)
    tools = [{"name": "list_directory", "parameters": {"type": "object"}}]
    mutating = {**parent, "tools": tools, "approval_mode": "default"}  # the call parks before it runs
    registry = runtime_of(app).tools
    registry.register(replace(registry.tools["list_directory"], mutating=True))  # make the scripted call wait

    # When its delivery parks it
    handle = client.launch(
        mutating, {"description": "p", "prompt": "look", "subagent_type": "fork"}, approval_policy="park"
    )
    task_id = f"{handle.fork_id}.1"
    wait_until(
        lambda: any(e.get("uuid") == task_id and e["type"] == "task-awaiting_approval" for e in list(task_events)),
        what="the task-awaiting_approval event",
    )

    # Then the delivery's last event is the custom one (Flower's state AWAITING_APPROVAL), not task-succeeded
    mine = [e for e in task_events if e.get("uuid") == task_id]
    assert [e["type"] for e in mine][-1] == "task-awaiting_approval"
    assert "task-succeeded" not in [e["type"] for e in mine]
    state = app.events.State()
    for event in mine:
        state.event(event)
    assert state.tasks[task_id].state == "AWAITING_APPROVAL"


@pytest.mark.parametrize(
    ("outcome", "event"),
    [
        ("'succeeded'", None),
        ("'failed'", "task-failed"),
        ("'released'", "task-released"),
        ("'awaiting_approval'", "task-awaiting_approval"),
        ("'duplicate:running'", "task-duplicate"),
        ("'refused:RecordIntegrityError'", "task-rejected"),
        (None, None),
    ],
)
def test_each_delivery_outcome_has_its_final_event(outcome: Any, event: str | None) -> None:
    assert final_event(outcome) == event

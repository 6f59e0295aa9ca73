"""One claimed run, watched: the loop's progress events feed the worker's metrics and a progress callback.

The child loop emits `model_call` (before a model call), `step` (after it: tool names and tokens)
and `tool` (a tool call answered) through its channel; the observer turns them into latencies,
counters and, per step, one call of `progress` (the `run_fork` task sends it to Flower as a
`task-progress` event). Observability never stops a fork: a failing callback is logged and dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from workers.records.events import Event, ModelCallEvent, StepData, StepEvent, ToolEvent
from workers.service.metrics import Metrics
from workers.service.outcome import FINISHED, Outcome

log = logging.getLogger("forkq.worker")

Progress = Callable[[dict[str, Any]], None]  # called once per step with `step_progress` fields


def step_progress(data: StepData, attempt: int) -> dict[str, Any]:
    """The fields of a `task-progress` event for a loop `step` event.

    `result` repeats them as one line: Flower shows only Celery's own task fields, and `result` is
    the one it shows while a task runs (its final value replaces it when the task ends).
    """
    tools = list(data.tool_calls)
    tokens_in, tokens_out = data.input_tokens, data.output_tokens
    summary = f"step {data.step}: " + (f"called {', '.join(tools)}" if tools else "answered")
    return {
        "step": data.step,
        "attempt": attempt,
        "tools": tools,
        "input_tokens": tokens_in,
        "output_tokens": tokens_out,
        "result": f"{summary} ({tokens_in:,} in / {tokens_out:,} out tokens, attempt {attempt})",
    }


@dataclass
class RunObserver:
    """Metrics and progress of one claimed run: `observe` each loop event, `ended` once, `close` always."""

    metrics: Metrics
    tools: Container[str]  # the worker's tool names: any other name is counted as `other`
    attempt: int
    progress: Progress | None = None
    clock: Callable[[], float] = time.monotonic
    _model_started: float | None = field(default=None, init=False)
    _step_started: float | None = field(default=None, init=False)
    _ended: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.metrics.attempts.observe(self.attempt)
        self.metrics.forks_running.inc()

    def observe(self, event: Event) -> None:
        """One loop event (`FencedChannel.emit` calls this as the loop emits it)."""
        now = self.clock()
        if isinstance(event, ModelCallEvent):
            self._end_step(now)
            self._model_started = self._step_started = now
        elif isinstance(event, StepEvent):
            if self._model_started is not None:
                self.metrics.model_call_seconds.observe(now - self._model_started)
                self._model_started = None
            self.metrics.tokens.labels(direction="input").inc(event.data.input_tokens)
            self.metrics.tokens.labels(direction="output").inc(event.data.output_tokens)
            self.metrics.cached_input_tokens.inc(event.data.cached_input_tokens)
            self._report(step_progress(event.data, self.attempt))
        elif isinstance(event, ToolEvent):
            self.metrics.tool_call(event.data.tool, ok=event.data.ok, known=self.tools)

    def ended(self, outcome: Outcome) -> Outcome:
        """Count how the run ended; returns `outcome`."""
        if outcome in FINISHED:  # a stopped run's last step did not end: it is not a step's length
            self._end_step(self.clock())
        self.metrics.run_ended(outcome)
        self._ended = True
        return outcome

    def close(self) -> None:
        """The run is over: it no longer counts as running (an exception ended it if `ended` was not called)."""
        if not self._ended:
            self.metrics.run_ended("error")
            self._ended = True
        self.metrics.forks_running.dec()

    def _end_step(self, now: float) -> None:
        if self._step_started is not None:
            self.metrics.step_seconds.observe(now - self._step_started)
            self._step_started = None

    def _report(self, fields: dict[str, Any]) -> None:
        if self.progress is None:
            return
        try:
            self.progress(fields)
        except Exception as exc:  # a monitoring event lost (broker hiccup) must not stop the fork
            log.warning("progress event of step %s not sent: %s", fields.get("step"), exc)

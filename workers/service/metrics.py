"""Prometheus metrics of one worker (or sweeper) process, in its own registry, and their HTTP server.

Every label takes a bounded set of values: statuses and outcomes are fixed words, and a tool name
that is not in the worker's registry is counted as `other` (a model can call any name it invents).
No fork ids in labels: they are unbounded; a fork's own progress is in its event stream.

With `FORKQ_METRICS_PORT` set, `forkq worker` and `forkq sweep` serve `/metrics` on that port. The
counters live in the serving process, so the worker's `threads` (default) and `solo` pools are
covered; a `prefork` pool runs forks in child processes whose counters the parent cannot see, and
its worker serves no fork metrics (it logs why at start).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from typing import Final, Literal
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from workers.service.outcome import CLAIMED_RUN, SKIPPED, Outcome
from workers.tools.registry import ABANDONED

log = logging.getLogger("forkq.metrics")

OTHER_TOOL: Final = "other"
# how a claimed run ended (`workers.service.outcome.CLAIMED_RUN`): a result written (succeeded, failed), stopped
# by someone else (cancelled), handed on (paused, awaiting_approval, released, lease_lost); `error`: an exception
# left the run (Redis down, a bug); `other`: an outcome this list does not know yet
RUN_STATUSES: Final = (*(outcome.value for outcome in CLAIMED_RUN), "error", "other")
SKIP_REASONS: Final = tuple(outcome.value for outcome in SKIPPED)
SWEEP_OUTCOMES: Final = ("revive", "requeue", "failed")
# model calls and steps take seconds (tens with long outputs or retries); attempts are few
LATENCY_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ATTEMPT_BUCKETS: Final = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0)
# a wait for admission: a handoff takes a tick (25 ms), a slot a call's length, a rate window up to a minute
WAIT_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
MODEL_LABELS: Final = 64  # distinct model labels of the admission metrics; later models count as `other`


class AbandonedToolCalls(Collector):
    """`forkq_tool_calls_abandoned`: handler threads of this process given up on and still running, by tool.

    The tool registry counts them (`workers.tools.registry.ABANDONED`, which it reads to refuse a stuck
    tool); this collector reads that count at each scrape.
    """

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The current counts (only registered tools are run, so the tool label is bounded)."""
        family = GaugeMetricFamily(
            "forkq_tool_calls_abandoned",
            "Tool calls abandoned at their deadline or a cancel whose threads still run, by tool.",
            labels=["tool"],
        )
        for tool, count in sorted(ABANDONED.snapshot().items()):
            family.add_metric([tool], count)
        yield family


class WorkspaceDisk(Collector):
    """`forkq_workspace_*`: the disk a worker process uses for snapshot workspaces, read at each scrape."""

    def __init__(self, totals: Callable[[], tuple[int, int, int, int]]) -> None:
        self.totals = totals  # (runs holding a folder, their trees' bytes, the cache's bytes, the cache's limit)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The current figures."""
        runs, run_bytes, cache_bytes, cache_limit = self.totals()
        yield GaugeMetricFamily("forkq_workspace_runs", "Runs of this process holding a workspace folder.", runs)
        yield GaugeMetricFamily(
            "forkq_workspace_run_bytes", "Bytes of the trees in this process's workspace folders.", run_bytes
        )
        yield GaugeMetricFamily("forkq_workspace_cache_bytes", "Bytes in this process's workspace cache.", cache_bytes)
        yield GaugeMetricFamily(
            "forkq_workspace_cache_limit_bytes", "The cache's bound (FORKQ_WORKSPACE_CACHE_MB).", cache_limit
        )


class Metrics:
    """forkq's metrics in one registry: a fresh one per runtime by default, so runtimes never collide."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:  # a process's own registry gets the usual process and Python metrics
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.registry = registry
        self.forks_finished = Counter(
            "forkq_forks_finished",
            "Claimed fork runs this process ended, by how they ended.",
            ["status"],
            registry=registry,
        )
        self.deliveries_skipped = Counter(
            "forkq_deliveries_skipped",
            "run_fork deliveries that claimed nothing: duplicate, handed_back (worker stopping), refused, rejected.",
            ["reason"],
            registry=registry,
        )
        self.attempts = Histogram(
            "forkq_claim_attempt",
            "Attempt number of each fork claim (the count is the number of claims).",
            buckets=ATTEMPT_BUCKETS,
            registry=registry,
        )
        self.revivals = Counter(
            "forkq_revivals",
            "Sweeper outcomes: revive (lease expired, re-enqueued), requeue (job re-sent), failed (attempts spent).",
            ["outcome"],
            registry=registry,
        )
        self.step_seconds = Histogram(
            "forkq_step_seconds",
            "One step of a fork: its model call and tool calls, until the next model call or the run's end.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._model_metrics(registry)
        self.lease_losses = Counter(
            "forkq_lease_losses", "Runs that stopped because their lease was lost (fenced out).", registry=registry
        )
        self.forks_running = Gauge("forkq_forks_running", "Forks this process runs now.", registry=registry)
        self.sandbox_enabled = Gauge(
            "forkq_sandbox_enabled",
            "1: snapshot forks' commands are sandboxed; 0: FORKQ_SANDBOX=off",
            registry=registry,
        )
        registry.register(AbandonedToolCalls())
        self._zero_labels()

    def watch_workspaces(self, totals: Callable[[], tuple[int, int, int, int]]) -> None:
        """Serve the workspace disk gauges from `totals` (runs, their bytes, the cache's bytes and bound)."""
        self.registry.register(WorkspaceDisk(totals))

    def _model_metrics(self, registry: CollectorRegistry) -> None:
        """The model calls', tokens' and tool calls' metrics."""
        self.model_call_seconds = Histogram(
            "forkq_model_call_seconds",
            "One model call, retries included.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "forkq_tokens", "Model tokens, by direction (input, output).", ["direction"], registry=registry
        )
        # its own counter, not a direction: these are part of the input tokens, and a sum over directions must hold
        self.cached_input_tokens = Counter(
            "forkq_cached_input_tokens",
            "Input tokens the provider read from its prompt cache (part of the input tokens; where it reports them).",
            registry=registry,
        )
        self._admission_metrics(registry)
        self.tool_calls = Counter(
            "forkq_tool_calls",
            "Tool calls answered, by tool (unknown names: other) and outcome (ok, error).",
            ["tool", "outcome"],
            registry=registry,
        )

    def _admission_metrics(self, registry: CollectorRegistry) -> None:
        """Model admission's metrics (FORKQ_MODEL_LIMITS), by model."""
        self._models: set[str] = set()
        self.model_waiting = Gauge(
            "forkq_model_waiting",
            "Model calls of this process waiting for admission, by model.",
            ["model"],
            registry=registry,
        )
        self.model_wait_seconds = Histogram(
            "forkq_model_wait_seconds",
            "Time a model call waited for admission (calls admitted at once count 0), by model.",
            ["model"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.model_cooldowns = Counter(
            "forkq_model_cooldowns",
            "429 or 503 answers with Retry-After that started a cooldown shared by every worker, by model.",
            ["model"],
            registry=registry,
        )

    def model_label(self, model: str) -> str:
        """`model` as a label: the first MODEL_LABELS models by name, later ones `other` (labels stay bounded)."""
        if model in self._models:
            return model
        if len(self._models) < MODEL_LABELS:
            self._models.add(model)
            return model
        return OTHER_TOOL

    def _zero_labels(self) -> None:
        """Export every fixed label value at 0, so rates and alerts work before the first event."""
        for status in RUN_STATUSES:
            self.forks_finished.labels(status=status)
        for reason in SKIP_REASONS:
            self.deliveries_skipped.labels(reason=reason)
        for outcome in SWEEP_OUTCOMES:
            self.revivals.labels(outcome=outcome)
        for direction in ("input", "output"):
            self.tokens.labels(direction=direction)

    def run_ended(self, status: Outcome | Literal["error"]) -> None:
        """Count one claimed run's end: an `Outcome` of `CLAIMED_RUN` or `error` (anything else counts as `other`)."""
        self.forks_finished.labels(status=status if status in RUN_STATUSES else "other").inc()
        if status == Outcome.LEASE_LOST:
            self.lease_losses.inc()

    def skipped(self, reason: Outcome) -> None:
        """Count a delivery that claimed nothing: an `Outcome` of `SKIPPED` (anything else counts as `refused`)."""
        self.deliveries_skipped.labels(reason=reason if reason in SKIP_REASONS else Outcome.REFUSED.value).inc()

    def swept(self, outcome: str) -> None:
        """Count a sweeper outcome that changed a fork (`alive` and finished forks are not revivals)."""
        if outcome in SWEEP_OUTCOMES:
            self.revivals.labels(outcome=outcome).inc()

    def tool_call(self, tool: str, *, ok: bool, known: Container[str]) -> None:
        """Count one answered tool call; `known`: the worker's tool names (others count as `other`)."""
        name = tool if tool in known else OTHER_TOOL
        self.tool_calls.labels(tool=name, outcome="ok" if ok else "error").inc()


@dataclass
class MetricsServer:
    """`/metrics` over HTTP on a port, in a daemon thread; `close` frees the port."""

    port: int
    server: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> MetricsServer:
    """Serve `registry` on `addr:port` (all interfaces by default: Prometheus scrapes from another host)."""
    server, thread = start_http_server(port, addr=addr, registry=registry)
    log.info("serving Prometheus metrics on %s:%d/metrics", addr, port)
    return MetricsServer(port, server, thread)

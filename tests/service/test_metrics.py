"""Metrics: bounded labels, `/metrics` over HTTP, and counters that move when a live worker runs forks."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.worker import WorkController
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from broker_config.settings import Settings
from workers.app import runtime_of, serve_runtime_metrics
from workers.client import ForkClient
from workers.errors import ConfigurationError
from workers.records.fork import Status
from workers.service.metrics import Metrics, serve_metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(port: int) -> Samples:
    """Every sample `/metrics` serves on `port`, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(key)[label] for (metric, key) in samples if metric == name and label in dict(key)}


# ── the Metrics object ───────────────────────────────────────────────────────────────────────


def test_every_fixed_label_value_is_exported_at_zero_before_anything_happens() -> None:
    registry = CollectorRegistry()
    Metrics(registry)

    assert registry.get_sample_value("forkq_forks_finished_total", {"status": "succeeded"}) == 0
    assert registry.get_sample_value("forkq_revivals_total", {"outcome": "revive"}) == 0
    assert registry.get_sample_value("forkq_tokens_total", {"direction": "output"}) == 0
    assert registry.get_sample_value("forkq_forks_running") == 0


def test_unknown_tool_names_and_statuses_collapse_into_bounded_labels() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)

    # When a model invents many tool names and the runner returns an outcome the metrics do not know
    for n in range(50):
        metrics.tool_call(f"hallucinated_{n}", ok=False, known={"read_file"})
    metrics.tool_call("read_file", ok=True, known={"read_file"})
    metrics.run_ended("something_new")
    metrics.skipped("weird")
    metrics.swept("alive")  # a live lease is not a revival

    # Then the label sets stay small
    assert registry.get_sample_value("forkq_tool_calls_total", {"tool": "other", "outcome": "error"}) == 50
    assert registry.get_sample_value("forkq_tool_calls_total", {"tool": "read_file", "outcome": "ok"}) == 1
    assert registry.get_sample_value("forkq_forks_finished_total", {"status": "other"}) == 1
    assert registry.get_sample_value("forkq_deliveries_skipped_total", {"reason": "refused"}) == 1
    assert (
        sum(registry.get_sample_value("forkq_revivals_total", {"outcome": o}) or 0 for o in ("revive", "requeue")) == 0
    )


def test_a_lost_lease_counts_as_a_run_end_and_a_lease_loss() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)

    metrics.run_ended("lease_lost")

    assert registry.get_sample_value("forkq_forks_finished_total", {"status": "lease_lost"}) == 1
    assert registry.get_sample_value("forkq_lease_losses_total") == 1


def test_two_runtimes_in_one_process_have_separate_registries(make_settings: Callable[..., Settings]) -> None:
    from workers.service.runner import WorkerRuntime

    first, second = WorkerRuntime(make_settings()), WorkerRuntime(make_settings())

    first.metrics.run_ended("succeeded")

    assert first.metrics.registry is not second.metrics.registry
    assert second.metrics.registry.get_sample_value("forkq_forks_finished_total", {"status": "succeeded"}) == 0


# ── /metrics over HTTP ──────────────────────────────────────────────────────────────────────


def test_metrics_are_served_over_http_and_the_port_is_freed_on_close() -> None:
    metrics = Metrics()  # its own registry, with the process collectors
    metrics.run_ended("succeeded")
    port = free_port()

    server = serve_metrics(metrics.registry, port, addr="127.0.0.1")
    try:
        samples = scrape(port)
    finally:
        server.close()

    assert value(samples, "forkq_forks_finished_total", status="succeeded") == 1
    assert ("process_cpu_seconds_total", ()) in samples  # a process's own registry has the process metrics
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_a_taken_metrics_port_is_a_configuration_error_naming_the_variable(
    make_settings: Callable[..., Settings],
) -> None:
    from workers.service.runner import WorkerRuntime

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match="FORKQ_METRICS_PORT"):
            serve_runtime_metrics(WorkerRuntime(make_settings()), port)


# ── a live worker ───────────────────────────────────────────────────────────────────────────


@pytest.fixture
def script(tmp_path: Path) -> Path:
    """Step 1 lists the directory and calls a tool nobody has; step 2 answers."""
    steps = [
        {
            "delay_s": 0.05,
            "content": {
                "role": "model",
                "parts": [
                    {"functionCall": {"id": "c1", "name": "list_directory", "args": {"path": "."}}},
                    {"functionCall": {"id": "c2", "name": "no_such_tool_for_metrics", "args": {}}},
                ],
            },
        },
        {"delay_s": 0.05, "content": {"role": "model", "parts": [{"text": "done"}]}},
    ]
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"steps": steps}))
    return path


@pytest.fixture
def settings(make_settings: Callable[..., Settings], script: Path, tmp_path: Path) -> Settings:
    """The worker serves its metrics on a free port and runs the scripted provider."""
    return make_settings(metrics_port=free_port(), script=script, heartbeat_file=tmp_path / "worker.heartbeat")


@pytest.fixture
def fork_parent(parent: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The example parent, working in a directory that exists."""
    return {**parent, "cwd": str(tmp_path)}


def test_a_live_worker_serves_metrics_that_move_with_its_forks(
    app: Celery, client: ForkClient, start_live_worker: Callable[..., WorkController], fork_parent: dict[str, Any]
) -> None:
    # Given a worker serving /metrics
    start_live_worker(app)
    port = runtime_of(app).settings.metrics_port
    assert port is not None
    before = scrape(port)

    # When three forks run to their end
    params = [{"description": "m", "prompt": f"go {n}", "subagent_type": "fork"} for n in range(3)]
    handles = [client.launch(fork_parent, p) for p in params]
    results = [handle.wait(timeout=30) for handle in handles]
    assert [r.status for r in results] == [Status.SUCCEEDED] * 3

    # Then the counters moved by what the forks did
    after = scrape(port)
    succeeded = ("forkq_forks_finished_total", {"status": "succeeded"})
    assert value(after, succeeded[0], **succeeded[1]) - value(before, succeeded[0], **succeeded[1]) == 3
    assert value(after, "forkq_claim_attempt_count") == 3
    assert value(after, "forkq_claim_attempt_bucket", le="1.0") == 3
    assert value(after, "forkq_model_call_seconds_count") == 6
    assert value(after, "forkq_step_seconds_count") == 6
    assert value(after, "forkq_tokens_total", direction="input") == sum(r.usage.input_tokens for r in results)
    assert value(after, "forkq_tokens_total", direction="output") == sum(r.usage.output_tokens for r in results)
    assert value(after, "forkq_tool_calls_total", tool="other", outcome="error") == 3
    assert sum(value(after, "forkq_tool_calls_total", tool="list_directory", outcome=o) for o in ("ok", "error")) == 3
    assert value(after, "forkq_forks_running") == 0

    # And no label carries a fork id, and tool labels are the worker's tools or `other`
    known = set(runtime_of(app).tools.tools) | {"other"}
    assert label_values(after, "forkq_tool_calls_total", "tool") <= known
    every_label_value = {v for (_, labels) in after for _, v in labels}
    assert not any(handle.fork_id in v for handle in handles for v in every_label_value)


def test_a_repeated_delivery_counts_as_a_skipped_duplicate(
    app: Celery, client: ForkClient, start_live_worker: Callable[..., WorkController], fork_parent: dict[str, Any]
) -> None:
    from tests.live import wait_until
    from workers.broker.queue import enqueue_fork

    # Given a fork that ran to its end
    start_live_worker(app)
    settings = runtime_of(app).settings
    port = settings.metrics_port
    assert port is not None
    handle = client.launch(fork_parent, {"description": "m", "prompt": "go", "subagent_type": "fork"})
    handle.wait(timeout=30)

    # When its job is delivered again
    enqueue_fork(app, settings.queue, handle.fork_id, handle.digest, attempt=1)

    # Then the delivery is counted as a duplicate, and the fork finished once
    wait_until(
        lambda: value(scrape(port), "forkq_deliveries_skipped_total", reason="duplicate") == 1,
        timeout=15,
        what="the duplicate delivery to be counted",
    )
    assert value(scrape(port), "forkq_forks_finished_total", status="succeeded") == 1


def test_a_stopped_worker_frees_its_metrics_port(app: Celery) -> None:
    from celery.contrib.testing.worker import start_worker

    port = runtime_of(app).settings.metrics_port
    assert port is not None
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False, loglevel="WARNING"):
        assert "forkq_forks_running" in {name for name, _ in scrape(port)}

    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_a_prefork_worker_serves_no_fork_metrics_and_says_why(
    make_settings: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    from celery.concurrency.prefork import TaskPool
    from celery.concurrency.thread import TaskPool as ThreadPool

    from workers.app import _serve_worker_metrics
    from workers.service.runner import WorkerRuntime

    runtime = WorkerRuntime(make_settings(metrics_port=free_port()))

    assert _serve_worker_metrics(runtime, TaskPool) is None
    assert "prefork pool runs forks in child processes" in caplog.text
    assert _serve_worker_metrics(WorkerRuntime(make_settings()), ThreadPool) is None  # FORKQ_METRICS_PORT unset


def test_the_sweeper_counts_each_revival_once(
    redis_client: Any, make_queued_fork: Callable[..., tuple[str, str]], fork_store: Any
) -> None:
    from tests.conftest import TEST_NAMESPACE
    from workers.base.keys import Keys
    from workers.service.sweeper import Sweeper
    from workers.store.lease import Claim, Leases

    # Given a running fork whose lease has expired (deleted: its worker is gone)
    leases = Leases(redis_client, Keys(TEST_NAMESPACE), ttl_ms=10_000, retention_s=3600)
    fork_id, digest = make_queued_fork()
    assert isinstance(leases.claim(fork_id, "gone-worker", digest), Claim)
    redis_client.delete(leases.keys.lease(fork_id))
    redis_client.zadd(leases.keys.running, {fork_id: 0})  # due now
    registry = CollectorRegistry()
    sweeper = Sweeper(leases, fork_store, lambda *job: None, max_attempts=3, interval_s=1, metrics=Metrics(registry))

    # When two passes run
    sweeper.sweep_once()
    sweeper.sweep_once()

    # Then the fork was revived once
    assert registry.get_sample_value("forkq_revivals_total", {"outcome": "revive"}) == 1

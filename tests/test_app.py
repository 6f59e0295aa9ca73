"""make_app: one independent Celery app per Settings, no import-time or process-global side effects."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

import workers.app as app_module
from broker_config.celery import RUN_FORK_TASK, SWEEP_TASK
from broker_config.settings import Settings
from tests.live import wait_until
from workers.app import make_app, runtime_of
from workers.client import ForkClient
from workers.records.fork import Status
from workers.store.lease import Claim

REPO_ROOT = Path(app_module.__file__).resolve().parents[1]
FORK = {"description": "d", "prompt": "Report back.", "subagent_type": "fork", "fork_turns": "1"}


@pytest.fixture
def fresh_default_app() -> Iterator[None]:
    """`workers.app.app` rebuilt from this test's environment, and forgotten afterwards."""
    app_module.default_app.cache_clear()
    yield
    app_module.default_app.cache_clear()


def test_make_app_registers_forkqs_tasks_and_attaches_the_runtime(app: Celery, settings: Settings) -> None:
    assert {RUN_FORK_TASK, SWEEP_TASK} <= set(app.tasks)
    assert runtime_of(app).settings is settings
    assert app.conf.task_default_queue == settings.queue
    assert app.main == "forkq"


def test_two_apps_in_one_process_each_run_their_own_forks(
    make_settings: Callable[..., Settings], parent: dict[str, Any]
) -> None:
    # Given two apps with their own namespaces and queues, built in one process (a demo, a test run)
    apps = [make_app(make_settings(namespace=name, queue=f"{name}-forks")) for name in ("blue", "green")]
    statuses = []

    # When each app launches a fork and runs it on its own worker (one after the other: Celery keeps
    # per-process worker state, so two in-process workers of different apps cannot run at once)
    for app in apps:
        with ForkClient(runtime_of(app).settings, app=app) as client:
            handle = client.launch(parent, FORK)
            with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"):
                statuses.append(handle.wait(timeout=10).status)
        app.close()

    # Then each app's run_fork ran its own fork, with its own settings
    assert statuses == [Status.SUCCEEDED, Status.SUCCEEDED]


def test_building_clients_leaves_no_process_global_signal_handlers_behind(settings: Settings) -> None:
    # a parent agent may build a ForkClient per request; each builds an app
    before = (len(signals.worker_init.receivers), len(signals.worker_shutting_down.receivers))
    for _ in range(3):
        with ForkClient(settings) as client:
            client.app.close()

    after = (len(signals.worker_init.receivers), len(signals.worker_shutting_down.receivers))
    assert after == before


def test_the_module_level_app_is_built_from_the_environment_on_first_access(
    monkeypatch: pytest.MonkeyPatch, fresh_default_app: None, redis_url: str
) -> None:
    monkeypatch.setenv("FORKQ_REDIS_URL", redis_url)
    monkeypatch.setenv("FORKQ_QUEUE", "from-env")

    first = app_module.app

    assert first.conf.task_default_queue == "from-env"
    assert app_module.celery is first
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = app_module.nope


def test_importing_forkq_builds_no_app_and_touches_no_redis() -> None:
    # FORKQ_REDIS_URL points nowhere: an import that connected or built an app would show here
    code = (
        "import celery._state as state, workers.app, workers.client, workers.cli, workers.service.tasks; "
        "print(len(list(state._get_active_apps())))"
    )
    env = {"FORKQ_REDIS_URL": "redis://127.0.0.1:1/0", "PATH": ""}
    argv = [sys.executable, "-c", code]
    done = subprocess.run(argv, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_a_worker_refuses_to_start_against_a_redis_that_may_evict_records(
    worker_process: Callable[..., Any], redis_client: redis.Redis
) -> None:
    # Given a Redis configured as a cache (allkeys-lru) rather than a database
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        # When a worker process starts against it
        worker = worker_process()
        code = worker.process.wait(timeout=10)
    finally:
        redis_client.config_set("maxmemory-policy", "noeviction")

    # Then it exits with a message saying what to fix
    assert code != 0
    assert "maxmemory-policy" in worker.log()
    assert "noeviction" in worker.log()


def test_the_beat_sweep_task_revives_a_fork_whose_worker_died(
    make_settings: Callable[..., Settings], parent: dict[str, Any], start_live_worker: Callable[[Celery], Any]
) -> None:
    # Given a fork claimed by a worker that died at once (its 300 ms lease is never renewed)
    settings = make_settings(lease_ttl_s=0.3, heartbeat_s=0.1)
    app = make_app(settings)
    assert app.conf.beat_schedule["forkq-sweep"] == {"task": SWEEP_TASK, "schedule": settings.sweep_s}
    with ForkClient(settings, app=app) as client:
        handle = client.launch(parent, FORK)
        leases = runtime_of(app).leases
        assert isinstance(leases.claim(handle.fork_id, "a-worker-that-dies"), Claim)

        def lapsed_ms() -> float:  # how long ago the lease ended (its index score), in Redis time
            seconds, micros = leases.client.time()
            return (
                seconds * 1000 + micros / 1000 - float(leases.client.zscore(leases.keys.running, handle.fork_id) or 0)
            )

        # past the lease's end and the sweeper's grace, which leaves a lapsed lease to its worker for a while
        wait_until(lambda: lapsed_ms() > leases.lapse_grace_ms, 5, "the lease to lapse past the sweeper's grace")
        # When Celery beat's sweep task runs on a worker
        start_live_worker(app)
        app.send_task(SWEEP_TASK, queue=settings.queue)
        result = handle.wait(timeout=15)

    # Then the fork was revived and ran to its end on that worker, on its second attempt
    assert result.status is Status.SUCCEEDED
    assert client.status(handle.fork_id).attempt == 2
    assert "revived" in [e.type for e in client.events(handle.fork_id)]
    app.close()


@pytest.mark.skipif(sys.platform != "linux", reason="prctl is Linux's")
def test_a_worker_process_hides_its_environment_from_same_uid_processes() -> None:
    # PR_GET_DUMPABLE (3) reads what hide_process_environment set, in a process of its own
    code = (
        "import ctypes; from workers.app import hide_process_environment; "
        "libc = ctypes.CDLL(None); before = libc.prctl(3, 0, 0, 0, 0); "
        "ok = hide_process_environment(); print(before, ok, libc.prctl(3, 0, 0, 0, 0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.split() == ["1", "True", "0"]


NO_PROVIDER = "no model provider is configured: set FORKQ_PROVIDER to one of scripted, openai, gemini"


def test_a_forkq_worker_with_no_provider_configured_refuses_to_start_naming_forkq_provider(
    worker_process: Callable[..., Any],
) -> None:
    # Given no FORKQ_PROVIDER and no FORKQ_PROVIDER_ROUTES (the scripted model is no longer a silent default)
    # When `forkq worker` starts
    worker = worker_process(FORKQ_PROVIDER=None)
    code = worker.process.wait(timeout=30)

    # Then it exits non-zero before Celery starts, saying which variable to set and to what
    assert code != 0, worker.log()
    assert NO_PROVIDER in worker.log()
    assert "celery@" not in worker.log()  # Celery's banner: the worker never came up


@pytest.mark.slow
def test_a_celery_worker_of_the_forkq_app_with_no_provider_configured_refuses_to_start(
    settings: Settings, tmp_path: Path
) -> None:
    # Given `celery -A workers.app worker` (not `forkq worker`) with no provider configured
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")},
        "FORKQ_REDIS_URL": settings.redis_url,
        "FORKQ_NAMESPACE": settings.namespace,
        "FORKQ_QUEUE": settings.queue,
        "FORKQ_HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
    }
    argv = [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-Q", settings.queue, "-P", "threads"]
    argv += ["-c", "1", "--without-mingle", "--without-gossip", "-l", "WARNING"]

    # When it starts, the app's worker step refuses before the worker serves anything
    process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = out.decode(errors="replace")

    # Then it exits non-zero, and the reason names FORKQ_PROVIDER and its choices
    assert process.returncode != 0, log[-3000:]
    assert NO_PROVIDER in log, log[-3000:]


def test_a_workers_redis_pool_fits_the_concurrency_celery_runs_it_with(
    settings: Settings, app: Celery, start_live_worker: Callable[..., Any]
) -> None:
    # Given FORKQ_WORKER_CONCURRENCY at its default (32), and a worker started with -c 150 (`celery worker -c`)
    assert settings.worker_concurrency == 32
    start_live_worker(app, concurrency=150)

    # Then the runtime's Redis pool has a connection for each of the 150 slots, and 16 more
    runtime = runtime_of(app)
    assert runtime.slots == 150
    assert runtime.redis.connection_pool.max_connections == 150 + 16


def test_a_threads_pool_worker_starts_a_thread_for_every_slot_before_it_consumes(
    app: Celery, start_live_worker: Callable[..., Any]
) -> None:
    # Given a worker started with 24 slots and nothing queued
    worker = start_live_worker(app, concurrency=24)

    # Then its pool already holds a thread per slot: no job waits for one to start
    assert len(worker.pool.executor._threads) == 24


def test_prestarting_threads_leaves_a_pool_without_an_executor_alone() -> None:
    assert app_module.prestart_threads(object()) == 0

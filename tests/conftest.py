"""Shared fixtures: a private redis-server per session, flushed per test, and a fresh one for fault tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.worker import WorkController

from broker_config.settings import Settings
from workers.app import make_app
from workers.base.keys import Keys
from workers.client import ForkClient
from workers.demo.redis_server import RedisServer, find_redis_server
from workers.errors import ConfigurationError
from workers.records.fork import BootstrapRecord
from workers.store.forks import ForkStore

# the tool tests' fixtures (work, live, finished), shared by tests/tools/ and tests/subagents/, and the HTTP API's
# (serve_api, api, scripted_worker), shared by tests/api/, tests/e2e/ and the CLI's tests
pytest_plugins = ["tests.tools_support", "tests.api_support"]


def missing_tool(name: str, message: str) -> NoReturn:
    """A program the test needs is missing: skip the test, or fail it when the CI variable is set (CI must
    provide everything, and a skipped test is no pass)."""
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide {name}: {message}")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_executable() -> str:
    """The redis-server binary; skips the test when there is none, or fails it when the CI variable is set."""
    try:
        return find_redis_server()
    except ConfigurationError as exc:
        missing_tool("redis-server", str(exc))


@pytest.fixture(scope="session")
def redis_server(redis_executable: str) -> Iterator[RedisServer]:
    """A private redis-server on a free TCP port (never 127.0.0.1:6379), shared by the session."""
    with RedisServer(executable=redis_executable) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session server's URL, with every database flushed before and after the test."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    yield redis_server.url
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A redis-py client on the flushed session server, closed after the test."""
    with redis.Redis.from_url(redis_url) as client:
        yield client


@pytest.fixture
def fresh_redis(request: pytest.FixtureRequest, redis_executable: str) -> Iterator[RedisServer]:
    """A separate redis-server for tests that kill, pause or restart it; RedisServer options via indirect params.

    `@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)` passes keyword
    arguments to RedisServer.
    """
    options: dict[str, Any] = {"executable": redis_executable, **getattr(request, "param", {})}
    with RedisServer(**options) as server:
        yield server


# ── forkq runtime fixtures: settings, app, client, live workers ──────────────────────────────

REPO_ROOT = Path(__file__).resolve().parents[1]
PARENT_PATH = REPO_ROOT / "workers" / "examples" / "parent.json"
TEST_NAMESPACE = "forkq-test"
TEST_QUEUE = "forks-test"


@pytest.fixture(autouse=True)
def _no_forkq_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never inherit FORKQ_* variables from the shell that runs them."""
    for name in list(os.environ):
        if name.startswith("FORKQ_"):
            monkeypatch.delenv(name)


@pytest.fixture
def make_settings(redis_url: str) -> Callable[..., Settings]:
    """Build `Settings` for the private Redis, test namespace and queue, the scripted provider, with overrides."""

    def build(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "redis_url": redis_url,
            "namespace": TEST_NAMESPACE,
            "queue": TEST_QUEUE,
            "provider": "scripted",  # named explicitly: a worker has no default provider
        }
        return Settings(**{**values, **overrides})

    return build


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    """Settings for the private Redis, a test namespace and a test queue."""
    return make_settings()


@pytest.fixture
def forkq_env(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> Settings:
    """The `settings` fixture exported as FORKQ_* variables (for the CLI, which reads the environment)."""
    monkeypatch.setenv("FORKQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("FORKQ_NAMESPACE", settings.namespace)
    monkeypatch.setenv("FORKQ_QUEUE", settings.queue)
    return settings


@pytest.fixture
def parent() -> dict[str, Any]:
    """The example parent snapshot shipped with the package, as parsed JSON."""
    data: dict[str, Any] = json.loads(PARENT_PATH.read_text(encoding="utf-8"))
    return data


@pytest.fixture
def app(settings: Settings) -> Iterator[Celery]:
    """forkq's Celery app for `settings`."""
    celery_app = make_app(settings)
    yield celery_app
    celery_app.close()


@pytest.fixture
def client(settings: Settings, app: Celery) -> Iterator[ForkClient]:
    """A ForkClient on the private Redis, sending jobs through `app`."""
    with ForkClient(settings, app=app) as fork_client:
        yield fork_client


@pytest.fixture
def start_live_worker() -> Iterator[Callable[[Celery], WorkController]]:
    """Start an in-process Celery worker (threads pool) for an app; every worker stops after the test.

    One app per test: Celery keeps worker state per process (`celery.app.trace`), so in-process
    workers of two different apps cannot run at the same time.
    """
    with contextlib.ExitStack() as stack:

        def start(celery_app: Celery, concurrency: int = 4) -> WorkController:
            # perform_ping_check=False: the ping check needs the `celery.ping` task and a result backend,
            # and forkq has neither. shutdown_timeout: start_worker raises if the worker thread has not
            # exited by then (default 10 s); 30 s leaves room for a fork still in a model call at teardown
            worker: WorkController = stack.enter_context(
                start_worker(
                    celery_app,
                    pool="threads",
                    concurrency=concurrency,
                    perform_ping_check=False,
                    loglevel="WARNING",
                    shutdown_timeout=30,
                )
            )
            return worker

        yield start


@pytest.fixture
def live_worker(start_live_worker: Callable[[Celery], WorkController], app: Celery) -> WorkController:
    """An in-process worker consuming the test queue with `app`."""
    return start_live_worker(app)


@dataclass
class WorkerProcess:
    """A `forkq worker` subprocess and its log file."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """What the worker wrote so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (Celery's warm shutdown), then SIGKILL if it does not exit within `timeout`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


@pytest.fixture
def worker_process(settings: Settings, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start `python -m workers.cli worker` subprocesses for `settings` (scripted provider; a variable given
    as None is left unset); each is stopped after the test."""
    started: list[WorkerProcess] = []

    def start(concurrency: int = 2, **env: str | None) -> WorkerProcess:
        log_path = tmp_path / f"worker-{len(started)}.log"
        variables = {
            "FORKQ_REDIS_URL": settings.redis_url,
            "FORKQ_NAMESPACE": settings.namespace,
            "FORKQ_QUEUE": settings.queue,
            "FORKQ_PROVIDER": "scripted",
            **env,
        }
        environment = {**os.environ, **{k: v for k, v in variables.items() if v is not None}}
        argv = [sys.executable, "-m", "workers.cli", "worker", "--concurrency", str(concurrency)]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [*argv, "--loglevel", "WARNING"],
                cwd=REPO_ROOT,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        worker = WorkerProcess(process, log_path)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


# ── revival fixtures: queued forks written straight to the store, for lease and sweeper tests ─


@pytest.fixture
def fork_store(redis_client: redis.Redis) -> ForkStore:
    """A ForkStore over the flushed private Redis, in the test namespace."""
    return ForkStore(redis_client, Keys(TEST_NAMESPACE), ttl_s=3600)


@pytest.fixture
def make_queued_fork(fork_store: ForkStore) -> Callable[..., tuple[str, str]]:
    """Write a minimal queued fork (record, state, `queued` event) without enqueueing a job; (fork id, digest)."""
    counter = iter(range(1_000_000))

    def make(fork_id: str | None = None) -> tuple[str, str]:
        fid = fork_id or f"f-unit-{next(counter):04d}-{os.getpid()}"
        return fid, put_queued_fork(fork_store, fid)

    return make


# ── the forkq command, in-process ─────────────────────────────────────────────────────────────


@pytest.fixture
def forkq_cli(forkq_env: Settings, capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `forkq ARGS...` in-process with the test's FORKQ_* environment: (exit code, stdout, stderr)."""
    from workers.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def forkq(forkq_cli: Callable[..., tuple[int, str, str]]) -> Callable[..., tuple[int, str, str]]:
    """`forkq_cli` by its short name (tests/e2e's own `forkq` starts a worker instead, so it uses `forkq_cli`)."""
    return forkq_cli


def put_queued_fork(store: ForkStore, fork_id: str) -> str:
    """Write a minimal queued fork `fork_id` through `store` (no job enqueued); its digest."""
    record = BootstrapRecord(
        fork_id=fork_id,
        parent_session="s-unit",
        kind="fork",
        seed_chunks=[],
        message_count=0,
        task_prompt="Begin.",
        directive="Do the task.",
        description="unit fork",
    )
    data, digest = record.encode()
    store.put_launch(record, data, digest)
    return digest

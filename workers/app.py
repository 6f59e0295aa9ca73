"""The Celery app: `make_app(settings)`; `workers.app.app` is built on first access for the CLI."""

from __future__ import annotations

import ctypes
import logging
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

from celery import Celery, bootsteps
from celery.exceptions import CPendingDeprecationWarning

from broker_config.settings import Settings
from workers.broker.connection import Rejected
from workers.broker.sender import sender_app
from workers.errors import ConfigurationError
from workers.providers.routing import provider_problems
from workers.service.heartbeat import Heartbeat
from workers.service.metrics import MetricsServer, serve_metrics
from workers.service.outcome import Outcome
from workers.service.runner import WorkerRuntime
from workers.service.tasks import enqueue_again, register_tasks
from workers.store.health import check_redis

log = logging.getLogger("forkq.worker")

# the start of the warning Celery logs at every broker reconnect while
# worker_cancel_long_running_tasks_on_connection_loss is off
CANCEL_ADVICE = r"\s*In Celery 5\.1 we introduced an optional breaking change"


def make_app(settings: Settings) -> Celery:
    """A Celery app configured for forkq, with its tasks registered and its worker hooks connected."""
    app = sender_app(settings)  # the sender's serializer, transport and configuration, then the worker's parts
    runtime = WorkerRuntime(settings)
    runtime.requeue = lambda fid, digest, attempt: enqueue_again(app, runtime, fid, digest, attempt)
    app.forkq_runtime = runtime  # type: ignore[attr-defined]
    register_tasks(app, runtime)
    app.steps["worker"].add(ForkqWorkerStep)
    app.steps["consumer"].add(ForkqConsumerStep)
    return app


class ForkqWorkerStep(bootsteps.StartStopStep):
    """The app's own worker step: refuse an unfit Redis or no provider at start; stop forks at a boundary on shutdown.

    A bootstep belongs to one app (unlike Celery's global signals), and it starts after the pool
    and stops before it, so forks are told to stop while the pool still waits for them. It also
    runs the worker's heartbeat file (on the worker's timer) and its `/metrics` server.
    """

    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.runtime = runtime_of(parent.app)
        # the pool's real size (`celery worker -c` bypasses FORKQ_WORKER_CONCURRENCY): the Redis pool fits it
        slots = max(int(parent.concurrency or 0), int(getattr(parent, "max_concurrency", None) or 0))
        self.runtime.slots = slots or None
        settings = self.runtime.settings
        self.heartbeat = Heartbeat(settings.heartbeat_file, settings.heartbeat_s, str(parent.hostname))
        self.metrics_server: MetricsServer | None = None

    def start(self, parent: Any) -> None:
        health = check_redis(self.runtime.settings)
        for warning in health.warnings:
            log.warning("%s", warning)
        problems = provider_problems(self.runtime.settings) + health.problems
        # `forkq worker` refused to start already where commands cannot be sandboxed with FORKQ_SANDBOX=on
        self.runtime.metrics.sandbox_enabled.set(self.runtime.settings.sandbox == "on")
        if problems:
            raise ConfigurationError("worker refuses to start: " + "; ".join(problems))
        self.metrics_server = _serve_worker_metrics(self.runtime, parent.pool_cls)
        prestart_threads(parent.pool)
        self.heartbeat.start(parent.timer)
        self.runtime.presence.start()  # from now on a sweeper notices at once when this process is gone
        hide_process_environment()
        # forks keep running through a broker connection loss on purpose (broker_config/celery.py); Celery
        # would advise otherwise in a warning at every reconnect
        warnings.filterwarnings("ignore", CANCEL_ADVICE, CPendingDeprecationWarning)

    def stop(self, parent: Any) -> None:
        # forks stop at their next step boundary, are released and re-enqueued for another worker
        self.runtime.stopping.set()
        self.terminate(parent)

    shutdown = stop

    def terminate(self, parent: Any) -> None:
        """Cold shutdown (and an in-process test worker's end): stop the heartbeat and the presence, free the
        metrics port."""
        self.heartbeat.stop()
        if "presence" in vars(self.runtime):  # started (a cached property of the runtime)
            self.runtime.presence.stop()
            del self.runtime.presence
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None


class ForkqConsumerStep(bootsteps.StartStopStep):
    """The consumer's step: the channels of its broker connection hand the items they refuse to forkq's
    dead letters, and check the items on forkq's queue as forkq jobs.

    It starts after Celery's task consumer and before the event loop consumes anything, and again
    after every reconnect (the consumer restarts its steps on a new connection).
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, parent: Any) -> None:
        runtime = runtime_of(parent.app)
        transport = parent.connection.transport
        guard = getattr(transport, "guard", None)
        if guard is None:  # not forkq's transport (another broker): kombu and Celery as they are
            log.warning("broker transport %s does not check queue items", type(transport).__name__)
            return
        guard(lambda item: dead_letter_item(runtime, item), [runtime.settings.queue])


def dead_letter_item(runtime: WorkerRuntime, item: Rejected) -> None:
    """Keep a queue item the channel refused in forkq's dead letters, with its bytes and the reason."""
    reason = f"queue item refused before delivery, nothing ran: {item.reason}"
    runtime.store.dead_letter(item.task_id, reason, item=item)
    runtime.metrics.skipped(Outcome.REJECTED)


def prestart_threads(pool: Any) -> int:
    """Start every thread of a threads pool now, before the worker consumes; how many the pool holds (0: no
    threads pool).

    The pool's executor starts a thread per job until it has one per slot, and the worker's event loop,
    which hands it the jobs, then waits for each new thread to run: under the GIL, behind the forks
    already running. At C = 1,000 forks queued, that held the claims to about 200 a second (8 s from the
    first fork's start to the last); started here, while nothing else runs, 1,000 threads take about 0.1 s.
    """
    executor = getattr(pool, "executor", None)
    if not isinstance(executor, ThreadPoolExecutor):
        return 0
    for _ in range(executor._max_workers - len(executor._threads)):
        executor._adjust_thread_count()  # starts one thread: none is idle yet
    return len(executor._threads)


def _serve_worker_metrics(runtime: WorkerRuntime, pool_cls: Any) -> MetricsServer | None:
    """Serve the runtime's metrics on FORKQ_METRICS_PORT, unless unset or the pool is prefork."""
    port = runtime.settings.metrics_port
    if port is None:
        return None
    if "prefork" in getattr(pool_cls, "__module__", ""):
        # forks run in pool children, whose counters this process cannot read: serving zeros would lie
        log.warning(
            "FORKQ_METRICS_PORT=%d ignored: a prefork pool runs forks in child processes; "
            "use the threads or solo pool for fork metrics",
            port,
        )
        return None
    return serve_runtime_metrics(runtime, port)


def serve_runtime_metrics(runtime: WorkerRuntime, port: int) -> MetricsServer:
    """Serve the runtime's metrics on `port`, or explain why the port cannot be used.

    Raises:
        ConfigurationError: the port is taken or not allowed.
    """
    try:
        return serve_metrics(runtime.metrics.registry, port)
    except OSError as exc:
        raise ConfigurationError(
            f"FORKQ_METRICS_PORT={port}: cannot serve /metrics there ({exc}); pick a free port or unset it",
            field="FORKQ_METRICS_PORT",
            cause=exc,
        ) from exc


PR_SET_DUMPABLE = 4


def hide_process_environment() -> bool:
    """Make this worker process non-dumpable, so a tool's shell command (same uid) cannot read the worker's
    credentials from /proc/<pid>/environ or attach to it; its own environment is an allowlist already.

    Linux only; True when it took effect.
    """
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0


def runtime_of(app: Celery) -> WorkerRuntime:
    """The forkq runtime `make_app` attached to `app`."""
    runtime: WorkerRuntime = app.forkq_runtime  # type: ignore[attr-defined]
    return runtime


@cache
def default_app() -> Celery:
    """The app from the environment's settings, for `celery -A workers.app` and `forkq worker`."""
    return make_app(Settings())


def __getattr__(name: str) -> Any:
    # `celery -A workers.app` looks up `workers.app.app`; build it then, not at import time
    if name in ("app", "celery"):
        return default_app()
    raise AttributeError(f"module 'workers.app' has no attribute {name!r}")

"""The Celery app: `make_app(settings)`; `workers.app.app` is built on first access for the CLI."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from celery import Celery, signals

from broker_config.celery import celery_config
from broker_config.settings import Settings
from workers.errors import ConfigurationError
from workers.health import check_redis
from workers.runner import WorkerRuntime
from workers.tasks import enqueue_fork, register_tasks

log = logging.getLogger("forkq.worker")


def make_app(settings: Settings) -> Celery:
    """A Celery app configured for forkq, with its tasks registered and its worker hooks connected."""
    app = Celery("forkq", set_as_current=False)
    app.conf.update(celery_config(settings))
    runtime = WorkerRuntime(settings)
    runtime.requeue = lambda fid, digest, attempt: enqueue_fork(app, settings.queue, fid, digest, attempt=attempt)
    app.forkq_runtime = runtime  # type: ignore[attr-defined]
    register_tasks(app, runtime)
    _connect_worker_hooks(app, runtime)
    return app


def _connect_worker_hooks(app: Celery, runtime: WorkerRuntime) -> None:
    def refuse_unfit_redis(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        health = check_redis(runtime.settings)
        for warning in health.warnings:
            log.warning("%s", warning)
        if health.problems:
            raise ConfigurationError("worker refuses to start: " + "; ".join(health.problems))

    def stop_at_next_step(sender: Any = None, **_: Any) -> None:
        # forks stop at their next step boundary, are released and re-enqueued for another worker
        runtime.stopping.set()

    signals.worker_init.connect(refuse_unfit_redis, weak=False)
    signals.worker_shutting_down.connect(stop_at_next_step, weak=False)


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

"""The Celery app: `make_app(settings)`; `workers.app.app` is built on first access for the CLI."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from celery import Celery, bootsteps

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
    app.steps["worker"].add(ForkqWorkerStep)
    return app


class ForkqWorkerStep(bootsteps.StartStopStep):
    """The app's own worker step: refuse an unfit Redis at start; stop forks at a boundary on shutdown.

    A bootstep belongs to one app (unlike Celery's global signals), and it starts after the pool
    and stops before it, so forks are told to stop while the pool still waits for them.
    """

    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.runtime = runtime_of(parent.app)

    def start(self, parent: Any) -> None:
        health = check_redis(self.runtime.settings)
        for warning in health.warnings:
            log.warning("%s", warning)
        if health.problems:
            raise ConfigurationError("worker refuses to start: " + "; ".join(health.problems))

    def stop(self, parent: Any) -> None:
        # forks stop at their next step boundary, are released and re-enqueued for another worker
        self.runtime.stopping.set()

    shutdown = stop


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

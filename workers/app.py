"""The Celery app: `make_app(settings)`; `workers.app.app` is built on first access for the CLI."""

from __future__ import annotations

from functools import cache
from typing import Any

from celery import Celery

from broker_config.celery import celery_config
from broker_config.settings import Settings
from workers.runner import WorkerRuntime
from workers.tasks import register_tasks


def make_app(settings: Settings) -> Celery:
    """A Celery app configured for forkq, with `run_fork` registered."""
    app = Celery("forkq", set_as_current=False)
    app.conf.update(celery_config(settings))
    runtime = WorkerRuntime(settings)
    app.forkq_runtime = runtime  # type: ignore[attr-defined]
    register_tasks(app, runtime)
    return app


@cache
def default_app() -> Celery:
    """The app from the environment's settings, for `celery -A workers.app` and `forkq worker`."""
    return make_app(Settings())


def __getattr__(name: str) -> Any:
    # `celery -A workers.app` looks up `workers.app.app`; build it then, not at import time
    if name in ("app", "celery"):
        return default_app()
    raise AttributeError(f"module 'workers.app' has no attribute {name!r}")

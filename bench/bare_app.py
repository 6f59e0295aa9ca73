"""The baseline of bench/dispatch.py: a bare Celery app with forkq's broker settings and one no-op task.

Run by the benchmark as `celery -A bench.bare_app worker -Q bench-bare ...`. The configuration is
`broker_config.celery.celery_config(Settings())` (msgpack, acks_late, prefetch 1, events on), so the
only difference from a forkq worker is the task body: `bench.noop` LPUSHes to the key it is given,
which the caller BLPOPs (latency) or counts with EXISTS (throughput).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import redis
from celery import Celery

from broker_config.celery import celery_config
from broker_config.settings import Settings

BARE_QUEUE = "bench-bare"
NOOP_TASK = "bench.noop"


@dataclass
class _Runtime:
    """Per-process Redis client, built on first use like forkq's `WorkerRuntime`."""

    url: str

    @cached_property
    def redis(self) -> redis.Redis:
        """One client (one connection pool) per worker process."""
        return redis.Redis.from_url(self.url, health_check_interval=30)


def make_bare_app(settings: Settings) -> Celery:
    """A Celery app with forkq's configuration, routed to `BARE_QUEUE`, with the no-op task."""
    app = Celery("bench-bare", set_as_current=False)
    app.conf.update(
        {
            **celery_config(settings),
            "task_default_queue": BARE_QUEUE,
            "task_routes": {NOOP_TASK: {"queue": BARE_QUEUE}},
        }
    )
    runtime = _Runtime(settings.redis_url)

    @app.task(name=NOOP_TASK, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
    def noop(done_key: str) -> None:
        """Do nothing but tell the caller it ran."""
        runtime.redis.lpush(done_key, b"1")

    return app


@cache
def default_app() -> Celery:
    """The app from the environment's settings, for `celery -A bench.bare_app`."""
    return make_bare_app(Settings())


def __getattr__(name: str) -> Any:
    # `celery -A bench.bare_app` looks up `bench.bare_app.app`; build it then, not at import time
    if name in ("app", "celery"):
        return default_app()
    raise AttributeError(f"module 'bench.bare_app' has no attribute {name!r}")

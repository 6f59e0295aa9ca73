"""The baseline of bench/dispatch.py: a bare Celery app with forkq's broker settings and one no-op task.

Run by the benchmark as `celery -A bench.bare_app worker -Q bench-bare ...`. The configuration is
`broker_config.celery.celery_config(Settings())` (msgpack, acks_late, prefetch 1, events on), so the
only difference from a forkq worker is the task body: `bench.noop` LPUSHes to the key it is given,
which the caller BLPOPs (latency) or counts with EXISTS (throughput).

`bench.bare_app:conn_app` is the same app with forkq's broker connection (`broker_config.connection`,
one Redis client per channel instead of one per publish): the second baseline of the throughput
figure, which shows how much of forkq's ratio that connection accounts for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import redis
from celery import Celery

from broker_config.celery import celery_config
from broker_config.connection import ForkqAMQP
from broker_config.settings import Settings

BARE_QUEUE = "bench-bare"
CONN_QUEUE = "bench-bare-conn"
NOOP_TASK = "bench.noop"


@dataclass
class _Runtime:
    """Per-process Redis client, built on first use like forkq's `WorkerRuntime`."""

    url: str

    @cached_property
    def redis(self) -> redis.Redis:
        """One client (one connection pool) per worker process."""
        return redis.Redis.from_url(self.url, health_check_interval=30)


def make_bare_app(settings: Settings, *, forkq_connection: bool = False) -> Celery:
    """A Celery app with forkq's configuration and the no-op task, routed to `BARE_QUEUE` (stock kombu
    connection) or, with `forkq_connection`, to `CONN_QUEUE` (forkq's `ForkqAMQP`)."""
    queue = CONN_QUEUE if forkq_connection else BARE_QUEUE
    app = Celery("bench-bare", set_as_current=False, amqp=ForkqAMQP if forkq_connection else None)
    app.conf.update(
        {
            **celery_config(settings),
            "task_default_queue": queue,
            "task_routes": {NOOP_TASK: {"queue": queue}},
        }
    )
    runtime = _Runtime(settings.redis_url)

    @app.task(name=NOOP_TASK, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
    def noop(done_key: str) -> None:
        """Do nothing but tell the caller it ran."""
        runtime.redis.lpush(done_key, b"1")

    return app


@cache
def default_app(forkq_connection: bool = False) -> Celery:
    """The app from the environment's settings, for `celery -A bench.bare_app` (`:conn_app` with forkq's connection)."""
    return make_bare_app(Settings(), forkq_connection=forkq_connection)


def __getattr__(name: str) -> Any:
    # `celery -A bench.bare_app[:conn_app]` looks up the app; build it then, not at import time
    if name in ("app", "celery"):
        return default_app()
    if name == "conn_app":
        return default_app(forkq_connection=True)
    raise AttributeError(f"module 'bench.bare_app' has no attribute {name!r}")

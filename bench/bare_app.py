"""The baselines of bench/dispatch.py and bench/concurrency.py: a bare Celery app with forkq's broker settings.

Run by the benchmark as `celery -A bench.bare_app worker -Q bench-bare ...`. The configuration is
`broker_config.celery.celery_config(Settings())` (msgpack, acks_late, prefetch 1, events on), so the
only difference from a forkq worker is the task body: `bench.noop` LPUSHes to the key it is given,
which the caller BLPOPs (latency) or counts with EXISTS (throughput). `bench.slow` is a fork's shape with
nothing of forkq: S sleeps of L seconds (the model calls), a directory listing and one Redis GET between them
(the tool call and a write), its start and end times RPUSHed to Redis lists (bench/concurrency.py's baseline).
Its worker starts every thread of its pool first, as forkq's does (`workers.app.prestart_threads`), so the
baseline has the same pool tuning and differs from a forkq worker only in what a task does.

`bench.bare_app:conn_app` is the same app with forkq's broker connection (`workers.broker.connection`,
one Redis client per channel instead of one per publish): the second baseline of the throughput
figure, which shows how much of forkq's ratio that connection accounts for.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any, ClassVar

import redis
from celery import Celery, bootsteps

from broker_config.celery import celery_config
from broker_config.settings import Settings
from workers.app import prestart_threads
from workers.broker.connection import ForkqAMQP

BARE_QUEUE = "bench-bare"
CONN_QUEUE = "bench-bare-conn"
NOOP_TASK = "bench.noop"
SLOW_TASK = "bench.slow"
# lists: the Unix ms of each task's start, and "start end" (Unix ms) of each task that ended
SLOW_STARTS, SLOW_ENDS = "bench:slow:started", "bench:slow:finished"


class _PrestartThreads(bootsteps.StartStopStep):
    """The worker step that starts every thread of a threads pool before the worker consumes, as forkq's does."""

    requires: ClassVar[set[str]] = {"celery.worker.components:Pool"}

    def start(self, parent: Any) -> None:
        prestart_threads(parent.pool)


POOL_MAX = 1_016  # forkq's worker pool at 1,000 slots (slots + 16); opened lazily, as many as are used at once


@dataclass
class _Runtime:
    """Per-process Redis client, built on first use like forkq's `WorkerRuntime`."""

    url: str

    @cached_property
    def redis(self) -> redis.Redis:
        """One client (one connection pool) per worker process; a command that finds every connection in use
        waits for one, as forkq's worker pool does (redis-py's default pool fails it: at C = 5,000 every task
        that found 100 in use ended in `MaxConnectionsError`)."""
        pool = redis.BlockingConnectionPool.from_url(
            self.url, max_connections=POOL_MAX, timeout=30, health_check_interval=30
        )
        return redis.Redis(connection_pool=pool)


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

    @app.task(name=SLOW_TASK, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
    def slow(steps: int, delay_s: float, cwd: str) -> None:
        """A fork's shape without forkq: `steps` waits of `delay_s`, a listing and a Redis GET between them."""
        started = int(time.time() * 1000)
        runtime.redis.rpush(SLOW_STARTS, started)
        for step in range(steps):
            time.sleep(delay_s)
            if step < steps - 1:
                sorted(os.listdir(cwd))
                runtime.redis.get(SLOW_STARTS + ":tool")
        runtime.redis.rpush(SLOW_ENDS, f"{started} {int(time.time() * 1000)}")

    app.steps["worker"].add(_PrestartThreads)
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

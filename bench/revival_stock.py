"""The stock-Celery baseline of bench/revival.py: SIGKILL the node running a long task, time its restart.

A bare Celery app (acks_late, task_reject_on_worker_lost, broker visibility_timeout shortened to 60 s,
everything else Celery's default) with one long task that appends its start (pid, node) to a stream.
Worker nodes run this file: `python bench/revival_stock.py NAME BROKER_URL` (threads pool, concurrency 2).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/revival_stock.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import redis  # noqa: E402
from celery import Celery  # noqa: E402

from bench.procs import READY_TIMEOUT_S, Fleet, Proc, next_entry, redis_ms  # noqa: E402

STOCK_QUEUE, STOCK_TASK = "bench-stock", "bench.stock_long"
STOCK_VISIBILITY_S = 60
STOCK_RESTART_TIMEOUT_S = 300.0
STOCK_KILL_AFTER_S = 2.0


@cache
def _stock_redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def stock_events_key(run_id: str) -> str:
    """The stream a stock task appends to each time it starts."""
    return f"bench:stock:{run_id}:starts"


def stock_stop_key(run_id: str) -> str:
    """The key that tells a running stock task to return."""
    return f"bench:stock:{run_id}:stop"


def make_stock_app(broker_url: str) -> Celery:
    """A bare Celery app: acks_late + reject_on_worker_lost, visibility timeout 60 s, all else default."""
    app = Celery("bench-stock", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_transport_options={"visibility_timeout": STOCK_VISIBILITY_S},
        task_default_queue=STOCK_QUEUE,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name=STOCK_TASK, bind=True)
    def stock_long(self: celery.Task[Any, Any], run_id: str) -> None:
        """Record the start (pid, node), then run until told to stop (10 min at most)."""
        r = _stock_redis(broker_url)
        r.xadd(stock_events_key(run_id), {"pid": os.getpid(), "node": str(self.request.hostname)})
        for _ in range(6000):
            if r.exists(stock_stop_key(run_id)):
                return
            time.sleep(0.1)

    return app


@dataclass
class Stock:
    """The stock-Celery side: its app, broker client, workers, and the measured restarts."""

    app: Celery
    r: redis.Redis
    group: Fleet
    env: dict[str, str]
    broker_url: str
    workers: list[Proc]
    restarts_s: list[float | None] = field(default_factory=list)
    error: BaseException | None = None
    count: int = 0

    def start_worker(self) -> Proc:
        """A stock worker node (threads pool, concurrency 2): this file run as a script."""
        self.count += 1
        name = f"stock{self.count}"
        argv = [sys.executable, str(Path(__file__).resolve()), name, self.broker_url]
        return self.group.start(name, argv, self.env)

    def trial(self) -> tuple[float, float, str] | None:
        """Send a long task, SIGKILL its node, time (Redis TIME) until it starts again elsewhere.

        Returns kill → restart (s), first start → restart (s) and the restarting node, or None on timeout.
        """
        run_id = uuid.uuid4().hex
        key = stock_events_key(run_id)
        self.app.send_task(STOCK_TASK, args=[run_id])
        first = next_entry(self.r, key, "0-0", READY_TIMEOUT_S)
        if first is None:
            raise RuntimeError(f"stock task {run_id} did not start within {READY_TIMEOUT_S:.0f} s")
        first_id, fields = first
        victim = self.group.by_pid(int(fields[b"pid"]))
        if victim is None or victim not in self.workers:
            raise RuntimeError(f"stock task {run_id} started on an unknown process {fields}")
        time.sleep(STOCK_KILL_AFTER_S)
        kill_ms = redis_ms(self.r)
        victim.kill()
        self.workers.remove(victim)
        self.workers.append(self.start_worker())
        again = next_entry(self.r, key, first_id, STOCK_RESTART_TIMEOUT_S)
        self.r.set(stock_stop_key(run_id), 1)
        if again is None:
            return None
        again_ms = int(again[0].split(b"-")[0])
        first_ms = int(first_id.split(b"-")[0])
        return (again_ms - kill_ms) / 1000, (again_ms - first_ms) / 1000, again[1][b"node"].decode()

    def run(self, trials: int) -> None:
        """`trials` trials; an exception is kept for the main thread."""
        try:
            for i in range(trials):
                took = self.trial()
                self.restarts_s.append(None if took is None else took[0])
                shown = (
                    f"on {took[2]} after {took[0]:6.2f} s ({took[1]:.1f} s after its first start)"
                    if took is not None
                    else f"not within {STOCK_RESTART_TIMEOUT_S:.0f} s"
                )
                print(f"  stock Celery {i + 1}/{trials}: killed the task's node; restarted {shown}", flush=True)
        except BaseException as exc:  # re-raised by the main thread
            self.error = exc


def main() -> None:
    """Run one stock worker node: `python bench/revival_stock.py NAME BROKER_URL`."""
    name, broker = sys.argv[1:3]
    app = make_stock_app(broker)
    app.worker_main(["worker", "-Q", STOCK_QUEUE, "-P", "threads", "-c", "2", "-n", f"{name}@%h", "-l", "WARNING"])


if __name__ == "__main__":
    main()

"""The baseline of bench/concurrency.py: the same C × S × L workload as bare Celery tasks, on one worker.

`bench.slow` (bench/bare_app.py) sleeps S times L seconds with a directory listing and a Redis GET between the
sleeps, so the baseline measures what Celery itself costs a worker process that holds C such tasks at once:
taking C messages off the queue, starting them and acknowledging them. Same broker configuration, same threads
pool started first, one slot per task; nothing of forkq's records, leases, journal or events.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.bare_app import SLOW_ENDS, SLOW_STARTS, SLOW_TASK, make_bare_app
from bench.procs import ROOT, fleet
from broker_config.settings import Settings
from workers.demo.redis_server import RedisServer

BARE_QUEUE = "bench-slow"
POLL_S = 0.5


@dataclass
class BareRun:
    """The figures of one baseline run."""

    c: int
    steps: int
    model_s: float
    finished: int = 0
    makespan_s: float = float("nan")
    start_spread_s: float = float("nan")
    fork_s: list[float] = field(default_factory=list)
    rss_peak_mb: float = float("nan")
    note: str = ""

    @property
    def efficiency(self) -> float:
        """Ideal makespan over the measured one."""
        return self.steps * self.model_s / self.makespan_s if self.makespan_s > 0 else float("nan")

    def line(self) -> str:
        """One line for the report."""
        durations = sorted(self.fork_s) or [float("nan")]
        return (
            f"bare Celery C={self.c:,}: {self.finished}/{self.c} done, makespan {self.makespan_s:.1f} s, "
            f"efficiency {self.efficiency:.3f}, first → last start {self.start_spread_s:.2f} s, one task's run "
            f"p50 {statistics.median(durations):.2f} s, max {durations[-1]:.2f} s, peak RSS {self.rss_peak_mb:.0f} MB"
            + (f"; NOTE: {self.note}" if self.note else "")
        )


def _hwm_mb(pid: int) -> float:
    """A process's peak RSS (VmHWM), in MB; NaN once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_bare(c: int, steps: int, model_s: float, *, cwd: Path, logdir: Path, timeout_s: float) -> BareRun:
    """C `bench.slow` tasks queued, then one bare-Celery worker with C threads; waited for and measured."""
    run = BareRun(c, steps, model_s)
    logdir.mkdir(parents=True, exist_ok=True)
    with RedisServer(extra_args=["--maxclients", str(max(10_000, 2 * c + 1_000))]) as server, fleet(logdir) as group:
        app = make_bare_app(Settings(redis_url=server.url))
        r = redis.Redis.from_url(server.url)
        for _ in range(c):
            app.send_task(SLOW_TASK, (steps, model_s, str(cwd)), queue=BARE_QUEUE)
        argv = [sys.executable, "-m", "celery", "-A", "bench.bare_app", "worker", "-Q", BARE_QUEUE, "-P", "threads"]
        argv += ["-c", str(c), "-n", "bare@%h", "-l", "WARNING", "--without-gossip", "--without-mingle"]
        argv += ["--without-heartbeat"]
        env = {"PYTHONPATH": str(ROOT), "FORKQ_REDIS_URL": server.url, "PATH": "/usr/bin:/bin"}
        worker = group.start("bare-worker", argv, env)
        deadline = time.monotonic() + timeout_s
        while r.llen(SLOW_ENDS) < c and time.monotonic() < deadline and worker.process.poll() is None:
            run.rss_peak_mb = _hwm_mb(worker.process.pid)
            time.sleep(POLL_S)
        run.rss_peak_mb = _hwm_mb(worker.process.pid)
        starts = sorted(int(x) for x in r.lrange(SLOW_STARTS, 0, -1))
        runs = [tuple(map(int, x.split())) for x in r.lrange(SLOW_ENDS, 0, -1)]
        ends = sorted(end for _, end in runs)
        run.finished = len(ends)
        if run.finished < c:
            run.note = f"{c - run.finished} tasks unfinished after {timeout_s:.0f} s"
        if starts and ends:
            run.makespan_s = (ends[-1] - starts[0]) / 1000
            run.start_spread_s = (starts[-1] - starts[0]) / 1000
            run.fork_s = [(end - start) / 1000 for start, end in runs]
        group.stop_all()
        r.close()
    return run

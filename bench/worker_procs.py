"""Celery worker subprocesses for the benchmarks: start, wait until they answer, CPU time, stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import celery

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0


@dataclass
class Worker:
    """One Celery worker subprocess and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def cpu_ns(self) -> int:
        """CPU time of all the process's threads so far (ns, from /proc/PID/task/*/schedstat)."""
        total = 0
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
                continue
        return total

    def stop(self) -> None:
        """SIGTERM (warm shutdown), then SIGKILL after 10 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


def worker_env(redis_url: str, script: Path) -> dict[str, str]:
    """This environment without its FORKQ_* variables, plus the repo on PYTHONPATH, the Redis URL and the script."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "FORKQ_REDIS_URL": redis_url, "FORKQ_SCRIPT": str(script)}


@contextmanager
def workers(
    app_module: str, queue: str, names: Sequence[str], env: dict[str, str], logdir: Path, *, concurrency: int
) -> Iterator[list[Worker]]:
    """Start one `celery -A app_module worker` per name (threads pool); stop them all on exit."""
    started: list[Worker] = []
    try:
        for name in names:
            log = logdir / f"{name}.log"
            argv = [sys.executable, "-m", "celery", "-A", app_module, "worker", "-Q", queue, "-P", "threads"]
            argv += ["-c", str(concurrency), "-n", f"{name}@%h", "-l", "WARNING"]
            argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            started.append(Worker(name, proc, log))
        yield started
    finally:
        for worker in started:
            worker.stop()


def wait_ready(app: celery.Celery, group: Sequence[Worker]) -> None:
    """Poll the workers with a control ping until every one answers."""
    wanted = {f"{w.name}@{socket.gethostname()}" for w in group}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for worker in group:
            if worker.process.poll() is not None:
                tail = worker.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"worker {worker.name} exited with {worker.process.returncode}:\n{tail}")
        replies = app.control.ping(destination=sorted(wanted), timeout=0.5)
        if wanted <= {name for reply in replies for name in reply}:
            return
    raise RuntimeError(f"workers {sorted(wanted)} did not answer a ping within {READY_TIMEOUT_S:.0f} s")

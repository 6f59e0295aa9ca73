"""Subprocesses of the benchmarks: start them with a log file, measure their CPU, SIGKILL one, stop them all."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis
from celery import Celery

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0


@dataclass
class Proc:
    """A subprocess this benchmark started, with its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL and reap."""
        self.process.kill()
        self.process.wait()

    def cpu_ns(self) -> int:
        """CPU time of all the process's threads so far (ns, from /proc/PID/task/*/schedstat)."""
        total = 0
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
                continue
        return total

    def tail(self, chars: int = 2000) -> str:
        """The end of the log."""
        return self.log.read_text(errors="replace")[-chars:]


@dataclass
class Fleet:
    """Every subprocess of the run; `stop_all` ends them (SIGTERM, then SIGKILL after 10 s)."""

    logdir: Path
    procs: list[Proc] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> Proc:
        """Start one subprocess, output to `<logdir>/<name>.log`."""
        log = self.logdir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                list(argv), cwd=ROOT, env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        started = Proc(name, proc, log)
        with self.lock:
            self.procs.append(started)
        return started

    def by_pid(self, pid: int) -> Proc | None:
        """The process with this pid, if we started it."""
        with self.lock:
            return next((p for p in self.procs if p.pid == pid), None)

    def stop_all(self) -> None:
        """SIGTERM everything still running, wait up to 10 s, SIGKILL what is left."""
        with self.lock:
            alive = [p for p in self.procs if p.process.poll() is None]
        for proc in alive:
            proc.process.terminate()
        deadline = time.monotonic() + 10
        for proc in alive:
            try:
                proc.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


@contextmanager
def fleet(logdir: Path) -> Iterator[Fleet]:
    """A Fleet whose processes are stopped however the block ends."""
    group = Fleet(logdir)
    try:
        yield group
    finally:
        group.stop_all()


def worker_env(redis_url: str, script: Path) -> dict[str, str]:
    """This environment without its FORKQ_* variables, plus the repo on PYTHONPATH, the Redis URL and the
    scripted provider with its script."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    scripted = {"FORKQ_PROVIDER": "scripted", "FORKQ_SCRIPT": str(script)}
    return {**env, "PYTHONPATH": path, "FORKQ_REDIS_URL": redis_url, **scripted}


@contextmanager
def workers(
    app_module: str, queue: str, names: Sequence[str], env: dict[str, str], logdir: Path, *, concurrency: int
) -> Iterator[list[Proc]]:
    """Start one `celery -A app_module worker` per name (threads pool); stop them all on exit."""
    with fleet(logdir) as group:
        started = []
        for name in names:
            argv = [sys.executable, "-m", "celery", "-A", app_module, "worker", "-Q", queue, "-P", "threads"]
            argv += ["-c", str(concurrency), "-n", f"{name}@%h", "-l", "WARNING"]
            argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
            started.append(group.start(name, argv, env))
        yield started


def wait_ready(app: Celery, procs: Sequence[Proc]) -> None:
    """Poll the workers with a control ping until every one answers."""
    wanted = {f"{p.name}@{platform.node()}" for p in procs}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.process.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.tail()}")
        replies = app.control.ping(destination=sorted(wanted), timeout=0.5) or []
        if wanted <= {name for reply in replies for name in reply}:
            return
    raise RuntimeError(f"workers {sorted(wanted)} did not answer a ping within {READY_TIMEOUT_S:.0f} s")


def redis_ms(r: redis.Redis) -> float:
    """Redis TIME in Unix milliseconds (with the microseconds)."""
    seconds, micros = r.time()
    return seconds * 1000 + micros / 1000


Entry = tuple[bytes, dict[bytes, bytes]]  # a stream entry: id, fields


def next_entry(r: redis.Redis, key: str, after: bytes | str, timeout: float) -> Entry | None:
    """The stream's first entry after `after`, waiting up to `timeout` s (1 s blocks: under the socket timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = cast(list[Any], r.xread({key: after}, block=1000, count=1))
        if reply:
            entry_id, fields = reply[0][1][0]
            return entry_id, fields
    return None

"""Benchmark: how many slow forks one worker process runs at once, per Celery pool, against the ideal makespan.

Run: `python bench/concurrency.py [--c 100,1000,5000] [--steps 6] [--model-s 5] [--pools threads,gevent]
[--quick]`. For each pool and each C: a private redis-server (TCP, maxclients raised, slowlog at 10 ms),
C forks of `workers/examples/parent.json` (approval_mode `yolo`, cwd a temp dir) queued *before* the
worker starts, so launching is not measured, then one worker process with C slots and one `forkq sweep`
(which would revive a fork whose lease was lost). Each fork makes S scripted model calls of L seconds
each, a `list_directory` call after each but the last, then answers. The script waits (bounded) until
every fork has a result, then reads every fork's event stream and prints one row per pool × C:

- efficiency: the ideal makespan S × L over the measured one, the first `started` event to the last
  `finished` one (Redis clock);
- succeeded / failed / unfinished forks; lease losses (the worker's `forkq_lease_losses` counter, else its
  "lease lost" log lines) and `revived` events;
- worker peak RSS (VmHWM) and threads; worker CPU per model step and in cores, over the same window;
- Redis commands per model step (INFO commandstats, commands inside Lua scripts included, the benchmark's
  own EXISTS/INFO polls left out) and Redis CPU per step.

Baseline, in the same run (unless `--no-baseline`): the same C × S × L workload as bare Celery tasks on one
worker with the same pool tuning (bench/concurrency_bare.py), the ceiling Celery itself sets, printed with
forkq's efficiency as a share of it.

Pools: `threads` runs `forkq worker --pool threads --concurrency C`; `gevent` runs `celery -A workers.app
worker -P gevent -c C` (forkq's CLI offers threads, prefork and solo only), and needs gevent installed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/concurrency.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import redis  # noqa: E402

from bench.concurrency_bare import BareRun, run_bare  # noqa: E402
from bench.procs import Fleet, Proc, fleet, worker_env  # noqa: E402
from broker_config.settings import Settings  # noqa: E402
from workers.client import ForkClient, new_fork_id  # noqa: E402
from workers.demo.redis_server import RedisServer, _free_tcp_port  # noqa: E402
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot  # noqa: E402
from workers.records.events import StreamEvent  # noqa: E402

EXAMPLE_PARENT = ROOT / "workers" / "examples" / "parent.json"
PARAMS = {"description": "concurrency bench fork", "prompt": "List the project files.", "subagent_type": "fork"}
QUEUE = "forks"  # forkq's default queue
POOLS = ("threads", "gevent")
SAMPLE_S = 0.25  # worker /proc and Redis INFO sampling interval
POLL_S = 1.0  # how often the benchmark counts finished forks
EXISTS_BATCH = 1000
SLOWLOG_US = 10_000  # Redis commands slower than 10 ms are kept in its slowlog
TARGET_C = 1000
TARGET_EFFICIENCY = 0.9
TARGET_RSS_BYTES = 1 << 30
OWN_COMMANDS = ("cmdstat_exists", "cmdstat_info")  # the benchmark's own polls during the run
LEASE_LOST_LOG = "lease lost or fork no longer running"
# worker log lines worth counting: why leases were lost (a late heartbeat, Redis timeouts) and errors
LOG_SIGNS = (LEASE_LOST_LOG, "lease heartbeat failed", "lapsed while Redis was unreachable", "Timeout", "Traceback")


@dataclass(frozen=True)
class Plan:
    """What to run: fork counts, steps per fork, seconds per model call, pools, slots, bounds."""

    counts: tuple[int, ...]
    steps: int
    model_s: float
    pools: tuple[str, ...]
    concurrency: int | None  # None: one slot per fork (C)
    timeout_s: float | None  # None: derived from the plan
    sweeper: bool
    baseline: bool = True

    @property
    def ideal_s(self) -> float:
        """The makespan with no overhead at all: S model calls of L seconds, one after the other."""
        return self.steps * self.model_s

    def wait_s(self, c: int) -> float:
        """How long to wait for C forks once the worker is started."""
        if self.timeout_s is not None:
            return self.timeout_s
        return 120 + 10 * self.ideal_s + c * 0.02


# ── the worker process: /proc samples ─────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Sample:
    """One look at the worker (wall clock in Unix ms, comparable with Redis TIME on this host)."""

    at_ms: float
    cpu_ns: int
    rss_kb: int
    hwm_kb: int
    threads: int
    clients: int


CLOCK_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def process_cpu_ns(pid: int) -> int:
    """User + system CPU of the whole process so far, ended threads included (/proc/PID/stat, clock ticks).

    Not `Proc.cpu_ns`: that sums the live threads only (a tool call's thread takes its CPU with it when it
    ends), and reading 5,000 schedstat files four times a second would load the machine being measured."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_NS  # utime, stime: fields 14 and 15 of the line


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (kB) and Threads from /proc/PID/status."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM", "Threads"):
            values[name] = int(rest.split()[0])
    return values


@dataclass
class Sampler:
    """A thread sampling the worker's CPU, memory and threads and Redis's connected clients every SAMPLE_S."""

    proc: Proc
    r: redis.Redis
    samples: list[Sample] = field(default_factory=list)
    info_calls: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin sampling."""
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End sampling (one last sample first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()

    def sample(self) -> None:
        """Take one sample, unless the worker has exited."""
        try:
            status = proc_status(self.proc.pid)
            cpu = process_cpu_ns(self.proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            return
        at = time.time() * 1000  # at the CPU reading: a slow INFO below must not shift it
        self.info_calls += 1
        clients = int(self.r.info("clients")["connected_clients"])
        self.samples.append(Sample(at, cpu, status["VmRSS"], status["VmHWM"], status["Threads"], clients))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            if self.proc.process.poll() is not None:
                return
            self.sample()

    def cpu_at(self, at_ms: float) -> float:
        """The worker's CPU (ns) at `at_ms`, interpolated between the samples around it."""
        points = self.samples
        if not points:
            return 0.0
        if at_ms <= points[0].at_ms:
            return float(points[0].cpu_ns)
        for before, after in itertools.pairwise(points):
            if before.at_ms <= at_ms <= after.at_ms:
                span = after.at_ms - before.at_ms or 1.0
                return before.cpu_ns + (after.cpu_ns - before.cpu_ns) * (at_ms - before.at_ms) / span
        return float(points[-1].cpu_ns)

    def peak_cores(self, start_ms: float, end_ms: float, window_ms: float = 1000.0) -> float:
        """The worker's highest CPU use (cores) over any `window_ms` between `start_ms` and `end_ms`."""
        peak, at = 0.0, start_ms
        while at + window_ms <= end_ms:
            peak = max(peak, (self.cpu_at(at + window_ms) - self.cpu_at(at)) / (window_ms * 1e6))
            at += window_ms / 4
        return peak


# ── Redis counters ────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class RedisCounters:
    """Commands by name (INFO commandstats, script-inner commands included) and CPU seconds so far."""

    calls: dict[str, int]
    cpu_s: float
    # replies Redis wrote to its clients (INFO stats `total_writes_processed`): one per round trip, a pipeline's
    # replies going out in one write
    writes: int = 0

    @classmethod
    def read(cls, r: redis.Redis) -> RedisCounters:
        """Read them now (INFO commandstats, cpu and stats: each a `cmdstat_info`, left out)."""
        stats = r.info("commandstats")
        cpu = r.info("cpu")
        writes = int(r.info("stats").get("total_writes_processed", 0))
        calls = {k: int(v["calls"]) for k, v in stats.items()}
        return cls(calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), writes)

    def round_trips(self, before: RedisCounters) -> int:
        """Round trips of every client since `before` (the benchmark's own reads included)."""
        return self.writes - before.writes

    def minus(self, before: RedisCounters) -> tuple[Counter[str], float]:
        """Commands by name since `before` (the benchmark's own polls left out), and Redis CPU s since then."""
        names = set(self.calls) - set(OWN_COMMANDS)
        delta = Counter({n.removeprefix("cmdstat_"): self.calls.get(n, 0) - before.calls.get(n, 0) for n in names})
        return +delta, self.cpu_s - before.cpu_s


def slowlog(r: redis.Redis) -> list[tuple[float, str]]:
    """The slowlog's entries: (ms, command name), slowest first."""
    entries = r.slowlog_get(1024)
    found = []
    for entry in entries:
        command = entry.get("command", b"")
        name = (command.decode(errors="replace") if isinstance(command, bytes) else str(command)).split(" ")[0]
        found.append((int(entry["duration"]) / 1000, name.lower()))
    return sorted(found, reverse=True)


# ── one run: C forks, one worker ──────────────────────────────────────────────────────────────


@dataclass
class Row:
    """The figures of one pool × C."""

    pool: str
    c: int
    slots: int
    steps: int
    model_s: float
    launch_s: float = 0.0
    succeeded: int = 0
    failed: int = 0
    unfinished: int = 0
    lease_losses: int = 0
    lease_source: str = ""
    revived: int = 0
    makespan_s: float = float("nan")
    start_spread_s: float = float("nan")
    fork_s: list[float] = field(default_factory=list)
    rss_peak_mb: float = float("nan")
    threads_peak: int = 0
    clients_peak: int = 0
    cpu_s: float = float("nan")
    peak_cores: float = float("nan")
    wall_s: float = float("nan")
    redis_calls: Counter[str] = field(default_factory=Counter)
    redis_cpu_s: float = float("nan")
    slow: list[tuple[float, str]] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    note: str = ""
    log_signs: Counter[str] = field(default_factory=Counter)
    first_started_ms: int | None = None
    last_finished_ms: int | None = None

    @property
    def model_steps(self) -> int:
        """Model calls of the run: C × S."""
        return self.c * self.steps

    @property
    def redis_cmds(self) -> int:
        """Redis commands of the run, those inside Lua scripts included."""
        return sum(self.redis_calls.values())

    @property
    def efficiency(self) -> float:
        """Ideal makespan over the measured one."""
        return self.steps * self.model_s / self.makespan_s if self.makespan_s > 0 else float("nan")

    @property
    def cpu_cores(self) -> float:
        """The worker's mean CPU use over the makespan, in cores."""
        return self.cpu_s / self.makespan_s if self.makespan_s > 0 else float("nan")

    def target(self) -> str:
        """For C = 1,000: ok, or MISS and what missed; otherwise empty."""
        if self.c != TARGET_C:
            return ""
        misses = []
        if not self.efficiency >= TARGET_EFFICIENCY:
            misses.append("eff")
        if self.failed or self.unfinished:
            misses.append("failures")
        if self.lease_losses:
            misses.append("leases")
        if not self.rss_peak_mb * (1 << 20) <= TARGET_RSS_BYTES:
            misses.append("RSS")
        return "ok" if not misses else "MISS " + ",".join(misses)


def fork_script(steps: int, model_s: float) -> dict[str, Any]:
    """S model calls of L s: each but the last asks for `list_directory`, the last answers."""
    calls = [
        {
            "delay_s": model_s,
            "content": {
                "role": "model",
                "parts": [
                    {"text": f"Looking at the tree, step {k + 1}."},
                    {"functionCall": {"id": f"ls-{k + 1}", "name": "list_directory", "args": {"path": "."}}},
                ],
            },
        }
        for k in range(steps - 1)
    ]
    answer = {"delay_s": model_s, "content": {"role": "model", "parts": [{"text": "The project holds a README."}]}}
    return {"steps": [*calls, answer]}


def worker_argv(pool: str, slots: int) -> list[str]:
    """The worker command of a pool: forkq's CLI for the pools it offers, Celery's otherwise."""
    if pool in ("threads", "prefork", "solo"):
        argv = [sys.executable, "-m", "workers.cli", "worker", "--pool", pool, "--concurrency", str(slots)]
        return [*argv, "--hostname", "conc@%h", "--loglevel", "WARNING"]
    argv = [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-Q", QUEUE, "-P", pool, "-c", str(slots)]
    return [*argv, "-n", "conc@%h", "-l", "WARNING", "--without-mingle", "--without-gossip"]


def launch_all(client: ForkClient, parent: ParentSnapshot, c: int) -> tuple[list[str], float]:
    """Queue C forks (no worker runs yet); their ids and the seconds it took."""
    start = time.monotonic()
    fids = [new_fork_id() for _ in range(c)]
    for fid in fids:
        client.launch(parent, PARAMS, fork_id=fid)
    return fids, time.monotonic() - start


def count_done(r: redis.Redis, keys: Sequence[str]) -> tuple[int, int]:
    """(result keys that exist, EXISTS calls made)."""
    done = calls = 0
    for i in range(0, len(keys), EXISTS_BATCH):
        done += int(r.exists(*keys[i : i + EXISTS_BATCH]))
        calls += 1
    return done, calls


def wait_done(r: redis.Redis, keys: Sequence[str], worker: Proc, timeout: float) -> str:
    """Poll until every result key exists; '' when they do, else why the wait ended."""
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    while True:
        done, _ = count_done(r, keys)
        if done == len(keys):
            return ""
        if worker.process.poll() is not None:
            return f"worker exited with {worker.process.returncode} ({done}/{len(keys)} done)"
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s ({done}/{len(keys)} done)"
        if time.monotonic() - last_report > 30:
            print(f"  … {done}/{len(keys)} forks done", flush=True)
            last_report = time.monotonic()
        time.sleep(POLL_S)


def scrape(port: int) -> str:
    """The worker's /metrics text, or '' when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())
    except OSError:
        return ""


def metric(text: str, name: str) -> float | None:
    """A sample's value from Prometheus text (`name` with its labels, as written)."""
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def read_outcomes(client: ForkClient, fids: Sequence[str], row: Row) -> None:
    """Statuses, errors and event times of every fork: efficiency, spread, per-fork durations, revivals."""
    started: list[int] = []
    finished: list[int] = []
    for fid in fids:
        state = client.store.state(fid)
        status = state.status.value
        if status == "succeeded":
            row.succeeded += 1
        elif status in ("failed", "cancelled"):
            row.failed += 1
            row.errors[(state.error or status)[:120]] += 1
        else:
            row.unfinished += 1
            row.errors[f"still {status}"] += 1
        events: list[StreamEvent] = []
        after = "0-0"
        while batch := client.store.events(fid, after=after, count=1000):
            events += batch
            after = batch[-1].id
        starts = [e.at_ms for e in events if e.type == "started"]
        ends = [e.at_ms for e in events if e.type == "finished"]
        row.revived += sum(e.type == "revived" for e in events)
        if starts:
            started.append(min(starts))
        if ends:
            finished.append(max(ends))
            if starts:
                row.fork_s.append((max(ends) - min(starts)) / 1000)
    if started and finished:
        row.makespan_s = (max(finished) - min(started)) / 1000
        row.start_spread_s = (max(started) - min(started)) / 1000
        row.first_started_ms, row.last_finished_ms = min(started), max(finished)


def run_one(plan: Plan, pool: str, c: int, parent: ParentSnapshot, tmp: Path) -> Row:
    """C forks queued, one worker of `pool` started, waited for, measured, stopped."""
    slots = plan.concurrency or c
    row = Row(pool, c, slots, plan.steps, plan.model_s)
    logdir = tmp / f"{pool}-{c}"
    logdir.mkdir()
    script = logdir / "script.json"
    script.write_text(json.dumps(fork_script(plan.steps, plan.model_s)))
    maxclients = max(10_000, 2 * c + 1_000)
    extra = ["--maxclients", str(maxclients), "--slowlog-log-slower-than", str(SLOWLOG_US), "--slowlog-max-len", "1024"]
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer(extra_args=extra))
        r = stack.enter_context(redis.Redis.from_url(server.url))
        client = stack.enter_context(ForkClient(Settings(redis_url=server.url, queue=QUEUE), redis_client=r))
        fids, row.launch_s = launch_all(client, parent, c)
        print(f"{pool} C={c}: {c} forks queued in {row.launch_s:.1f} s; starting the worker", flush=True)
        port = _free_tcp_port()
        env = worker_env(server.url, script)
        env |= {"FORKQ_WORKER_CONCURRENCY": str(slots), "FORKQ_HEARTBEAT_FILE": str(logdir / "heartbeat")}
        group: Fleet = stack.enter_context(fleet(logdir))
        if plan.sweeper:
            group.start("sweeper", [sys.executable, "-m", "workers.cli", "sweep"], env)
        before = RedisCounters.read(r)
        r.slowlog_reset()
        started = time.time()
        worker = group.start("worker", worker_argv(pool, slots), {**env, "FORKQ_METRICS_PORT": str(port)})
        sampler = Sampler(worker, redis.Redis.from_url(server.url))
        sampler.start()
        keys = [client.store.keys.result(fid) for fid in fids]
        row.note = wait_done(r, keys, worker, plan.wait_s(c))
        row.wall_s = time.time() - started
        after = RedisCounters.read(r)
        sampler.stop()
        metrics = scrape(port) if worker.process.poll() is None else ""
        row.slow = slowlog(r)
        group.stop_all()
        row.redis_calls, row.redis_cpu_s = after.minus(before)
        read_outcomes(client, fids, row)
        if sampler.samples:
            row.rss_peak_mb = max(s.hwm_kb for s in sampler.samples) / 1024
            row.threads_peak = max(s.threads for s in sampler.samples)
            row.clients_peak = max(s.clients for s in sampler.samples)
        if row.first_started_ms is not None and row.last_finished_ms is not None:
            row.cpu_s = (sampler.cpu_at(row.last_finished_ms) - sampler.cpu_at(row.first_started_ms)) / 1e9
            row.peak_cores = sampler.peak_cores(row.first_started_ms, row.last_finished_ms)
        lost = metric(metrics, "forkq_lease_losses_total")
        log = worker.log.read_text(errors="replace")
        row.log_signs = +Counter({sign: log.count(sign) for sign in LOG_SIGNS})
        log_lost = row.log_signs[LEASE_LOST_LOG]
        row.lease_losses, row.lease_source = (int(lost), "metric") if lost is not None else (log_lost, "log")
        if row.note:
            print(f"  {row.note}; worker log ends:\n{worker.tail(1500)}", flush=True)
    return row


# ── report ────────────────────────────────────────────────────────────────────────────────────


def print_table(rows: Sequence[Row]) -> None:
    """One line per pool × C, then the details that locate the time."""
    head = (
        "pool",
        "C",
        "slots",
        "ok/fail/unf",
        "lease lost",
        "revived",
        "makespan s",
        "eff",
        "RSS MB",
        "threads",
        "CPU ms/step",
        "cores",
        "Redis cmd/step",
        "Redis CPU ms/step",
        "C=1000 target",
    )
    print("\n" + " | ".join(head))
    for x in rows:
        steps = x.model_steps
        cells = (
            x.pool,
            f"{x.c:,}",
            f"{x.slots:,}",
            f"{x.succeeded}/{x.failed}/{x.unfinished}",
            f"{x.lease_losses}",
            f"{x.revived}",
            f"{x.makespan_s:.1f}",
            f"{x.efficiency:.3f}",
            f"{x.rss_peak_mb:.0f}",
            f"{x.threads_peak:,}",
            f"{x.cpu_s * 1e3 / steps:.2f}",
            f"{x.cpu_cores:.2f}",
            f"{x.redis_cmds / steps:.1f}",
            f"{x.redis_cpu_s * 1e3 / steps:.3f}",
            x.target() or "—",
        )
        print(" | ".join(cells))


def print_details(rows: Sequence[Row]) -> None:
    """Per run: launch time, claim spread, per-fork durations and overhead, Redis, slowlog, errors."""
    for x in rows:
        ideal = x.steps * x.model_s
        print(f"\n{x.pool} C={x.c:,} (slots {x.slots:,}, S={x.steps}, L={x.model_s:g} s, ideal {ideal:g} s):")
        print(f"  queued in {x.launch_s:.1f} s before the worker started; worker start → all done {x.wall_s:.1f} s")
        if x.fork_s:
            durations = sorted(x.fork_s)
            p50, p99 = statistics.median(durations), durations[min(len(durations) - 1, int(len(durations) * 0.99))]
            overhead = (p50 - x.steps * x.model_s) / x.steps
            print(
                f"  first → last 'started' {x.start_spread_s:.1f} s; one fork's run (its started → finished) "
                f"p50 {p50:.2f} s, p99 {p99:.2f} s, max {durations[-1]:.2f} s; overhead per step at p50 "
                f"{overhead * 1e3:.0f} ms"
            )
        print(
            f"  worker CPU over the makespan {x.cpu_s:.1f} s ({x.cpu_cores:.2f} cores, busiest second "
            f"{x.peak_cores:.2f}); "
            f"peak RSS {x.rss_peak_mb:.0f} MB, threads {x.threads_peak:,}; Redis clients peak {x.clients_peak:,}"
        )
        top = ", ".join(f"{name} {n / x.model_steps:.1f}" for name, n in x.redis_calls.most_common(8))
        print(f"  Redis: {x.redis_cmds:,} commands, {x.redis_cpu_s:.1f} s CPU; per step: {top}")
        signs = ", ".join(f"{n} × {sign!r}" for sign, n in x.log_signs.most_common()) or "none of " + repr(LOG_SIGNS)
        print(f"  lease losses from the worker's {x.lease_source or '(none read)'}; worker log: {signs}")
        if x.slow:
            names = Counter(name for _, name in x.slow)
            print(
                f"  Redis slowlog (> {SLOWLOG_US / 1000:g} ms): {len(x.slow)} entries, slowest {x.slow[0][0]:.1f} ms "
                f"({x.slow[0][1]}); by command {dict(names.most_common(4))}"
            )
        for error, count in x.errors.most_common(3):
            print(f"  {count} × {error}")
        if x.note:
            print(f"  NOTE: {x.note}")


# ── main ──────────────────────────────────────────────────────────────────────────────────────


def run(plan: Plan) -> tuple[list[Row], list[BareRun]]:
    """Every pool × C, each on its own Redis and worker; then the bare-Celery baseline of each C."""
    parent = parse_parent_snapshot(json.loads(EXAMPLE_PARENT.read_text()))
    rows = []
    with tempfile.TemporaryDirectory(prefix="forkq-conc-") as tmpdir:
        tmp = Path(tmpdir)
        cwd = tmp / "project"
        cwd.mkdir()
        (cwd / "README.md").write_text("forkq concurrency bench\n")
        (cwd / "src").mkdir()
        parent = parent.model_copy(update={"approval_mode": "yolo", "cwd": str(cwd)})
        for pool in plan.pools:
            for c in plan.counts:
                try:
                    rows.append(run_one(plan, pool, c, parent, tmp))
                except Exception as exc:  # one configuration failing to start must not lose the others
                    print(f"{pool} C={c}: {type(exc).__name__}: {exc}", flush=True)
                    rows.append(Row(pool, c, plan.concurrency or c, plan.steps, plan.model_s, note=repr(exc)[:300]))
                print_table(rows[-1:])
        bare = []
        for c in plan.counts if plan.baseline else ():
            logdir = tmp / f"bare-{c}"
            bare.append(run_bare(c, plan.steps, plan.model_s, cwd=cwd, logdir=logdir, timeout_s=plan.wait_s(c)))
            print(bare[-1].line(), flush=True)
    return rows, bare


def print_baseline(rows: Sequence[Row], bare: Sequence[BareRun]) -> None:
    """The bare-Celery runs, and each forkq row's efficiency as a share of the bare one at the same C."""
    if not bare:
        return
    print("\nbaseline: the same workload as bare Celery tasks, one worker, the same pool tuning")
    for b in bare:
        print("  " + b.line())
        for x in (x for x in rows if x.c == b.c):
            print(
                f"  {x.pool} C={x.c:,}: efficiency {x.efficiency:.3f} = {x.efficiency / b.efficiency:.2f}× bare "
                "Celery's; "
                f"first → last start {x.start_spread_s:.2f} s against {b.start_spread_s:.2f} s"
            )


def counts(text: str) -> tuple[int, ...]:
    """`100,1000,5000` (underscores or a 'k' allowed: `1k`)."""
    return tuple(int(float(p.strip().lower().replace("_", "").replace("k", "e3"))) for p in text.split(",") if p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--c", type=counts, default=(100, 1000, 5000), help="fork counts (default 100,1000,5000)")
    parser.add_argument("--steps", type=int, default=6, help="model calls per fork, S (default 6)")
    parser.add_argument("--model-s", type=float, default=5.0, help="seconds per model call, L (default 5)")
    parser.add_argument("--pools", default="threads", help=f"comma-separated, of {', '.join(POOLS)} (default threads)")
    parser.add_argument("--concurrency", type=int, default=None, help="worker slots (default: C, one per fork)")
    parser.add_argument("--timeout", type=float, default=None, help="max s to wait per run (default 120 + 10·S·L)")
    parser.add_argument("--no-sweeper", action="store_true", help="run no `forkq sweep` beside the worker")
    parser.add_argument("--no-baseline", action="store_true", help="skip the bare-Celery run of each C")
    parser.add_argument("--quick", action="store_true", help="C=100, S=2, L=1 s: a smoke run (about half a minute)")
    args = parser.parse_args()
    pools = tuple(p.strip() for p in args.pools.split(",") if p.strip())
    unknown = set(pools) - set(POOLS)
    if unknown:
        parser.error(f"unknown pool(s) {sorted(unknown)}; choose from {', '.join(POOLS)}")
    if args.quick:
        args.c, args.steps, args.model_s = (100,), 2, 1.0
    bounds = (args.concurrency, args.timeout, not args.no_sweeper, not args.no_baseline)
    plan = Plan(args.c, args.steps, args.model_s, pools, *bounds)
    started = time.monotonic()
    print(
        f"forkq concurrency: {os.cpu_count()} CPUs, Python {platform.python_version()}, Celery {celery.__version__}; "
        f"C={','.join(map(str, plan.counts))}, S={plan.steps}, L={plan.model_s:g} s, pools {','.join(pools)}",
        flush=True,
    )
    rows, bare = run(plan)
    print("\n" + "=" * 100)
    print_table(rows)
    print_details(rows)
    print_baseline(rows, bare)
    print("\nload average (1, 5, 15 min) at the end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(f"total {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

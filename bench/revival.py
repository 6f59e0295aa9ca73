"""Benchmark: SIGKILL or SIGSTOP a worker mid-fork, time until the fork's next step on another worker, vs stock Celery.

Run: `python bench/revival.py [--kills 20] [--stops 20] [--quick]`. Starts a private redis-server (AOF on,
so it can be restarted without losing data), two forkq trial workers, one control worker (its own queue,
never killed), `forkq sweep`, and two stock-Celery workers. forkq runs with its default timings
(FORKQ_LEASE_TTL_S=15, FORKQ_HEARTBEAT_S=5, FORKQ_SWEEP_S=2, FORKQ_PRESENCE_CHECK_S=0.25,
FORKQ_PRESENCE_GRACE_S=1); `--quick` shortens the lease timings (and says so).

Each trial launches a fork whose scripted steps each call the `bench_effect` tool (one side effect per run,
a line keyed by the call's idempotency key in a file) and signals the worker that claimed it (pid from the
`started` event's owner) 0.5–3.5 s in, then starts a replacement worker:

- SIGKILL trials: Redis TIME at the kill → the first `step`/`tool` event of the revived run (stream id).
  The worker's closed connection revives the fork (target: p99 ≤ 2 s); the revival says `via`.
- SIGSTOP trials: a stopped worker keeps its connection, so the fork must be revived only once its lease
  expires (`via: lease`, not before the lease deadline read just after the stop). Once the fork has ended
  on another worker, SIGCONT: the stopped worker's run must end `lease_lost` with no write (events,
  journal, state and side effects unchanged); then it is SIGKILLed.

Ten control forks, each with a 30 s model call (two leases: only heartbeats keep it), run all along on the
control worker, through a Redis restart (SIGTERM, down for about a second, restarted from its AOF; done
between trials) and a 1 s network blip (every connection of the control worker killed with CLIENT KILL
every 50 ms for a second): any `revived` event on them is a false revival. Stock Celery runs in the same
run, in a thread (bench/revival_stock.py): a bare app (acks_late, task_reject_on_worker_lost,
visibility_timeout 60 s) with a long task; SIGKILL its worker node; Redis TIME at the kill → the task's
next start elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/revival.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import psutil  # noqa: E402
import redis  # noqa: E402

from bench.procs import READY_TIMEOUT_S, Fleet, Proc, fleet, redis_ms, wait_ready  # noqa: E402
from bench.revival_stock import (  # noqa: E402
    STOCK_KILL_AFTER_S,
    STOCK_RESTART_TIMEOUT_S,
    STOCK_VISIBILITY_S,
    Stock,
    make_stock_app,
)
from broker_config.settings import Settings  # noqa: E402
from workers.client import ForkClient  # noqa: E402
from workers.demo.redis_server import RedisServer  # noqa: E402
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot  # noqa: E402
from workers.records.events import StreamEvent  # noqa: E402
from workers.records.fork import Status  # noqa: E402
from workers.store.forks import ForkStore  # noqa: E402
from workers.store.lease import Leases  # noqa: E402
from workers.tools.registry import Tool, ToolContext  # noqa: E402

EXAMPLE_PARENT = ROOT / "workers" / "examples" / "parent.json"
PARAMS = {"description": "revival bench fork", "prompt": "Apply the planned edits.", "subagent_type": "fork"}
TRIAL_QUEUE, CONTROL_QUEUE = "forks", "bench-control"
EFFECTS_ENV = "BENCH_REVIVAL_EFFECTS"  # the file bench_effect appends to (read by the tool, in the workers)
STEP_EVENTS = ("step", "tool")
KILL_TARGET_S = 2.0  # SIGKILL → next step on another worker, p99
PRESENCE_CHECK_S = Settings.model_fields["presence_check_s"].default
PRESENCE_GRACE_S = Settings.model_fields["presence_grace_s"].default
LEASE_TOLERANCE_MS = 20  # a `revived` event this much before the lease deadline still counts as after it
REDIS_DOWN_S = 1.0  # how long the Redis restart keeps the server away
BLIP_S, BLIP_EVERY_S = 1.0, 0.05  # the network blip: CLIENT KILL of the control worker's connections
FENCE_TIMEOUT_S = 30.0  # how long a resumed worker gets to end its stale run


@dataclass(frozen=True)
class Plan:
    """Timings and sizes of one run: forkq's defaults, or `--quick`."""

    kills: int
    stops: int
    lease_ttl_s: float
    heartbeat_s: float
    sweep_s: float
    steps: int  # scripted steps of a trial fork, each a model call (model_s) and one tool call (tool_s)
    model_s: float
    tool_s: float
    kill_window_s: tuple[float, float]  # when to signal, after the fork's `started` event
    stock_trials: int
    controls: int  # control forks kept running at once
    quick: bool

    @property
    def control_model_s(self) -> float:
        """The control forks' long model call: two leases, kept only by heartbeats."""
        return 2 * self.lease_ttl_s


def make_plan(kills: int | None, stops: int | None, quick: bool) -> Plan:
    """forkq's default timings, or shortened ones (and few trials) with `quick`."""
    if quick:
        return Plan(kills or 5, stops or 3, 3.0, 1.0, 0.5, 6, 0.2, 0.2, (0.3, 1.5), 1, 10, True)
    return Plan(kills or 20, stops or 20, 15.0, 5.0, 2.0, 6, 0.4, 0.4, (0.5, 3.5), 3, 10, False)


# ── the side-effect tool (loaded by the workers through a `forkq.tools` entry point) ──────────


def _record_effect(args: Mapping[str, Any], ctx: ToolContext) -> str:
    # one write(2) with O_APPEND: whole lines, even from several worker processes at once
    fd = os.open(os.environ[EFFECTS_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{ctx.idempotency_key}\t{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    time.sleep(float(args.get("sleep_s") or 0))  # after the effect: a kill here is the risky case
    return f"effect recorded under {ctx.idempotency_key}"


def effect_tool() -> Tool:
    """`bench_effect`: not idempotent, so an interrupted call must be answered, never run again."""
    schema = {"type": "object", "properties": {"sleep_s": {"type": "number"}}}
    return Tool("bench_effect", "Record one side effect.", schema, _record_effect, mutating=True)


def write_tool_plugin(directory: Path) -> None:
    """A `<name>.dist-info` declaring `bench_effect` in `forkq.tools`, for the workers' PYTHONPATH."""
    info = directory / "forkq_bench_revival-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: forkq-bench-revival\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[forkq.tools]\nbench_effect = bench.revival:effect_tool\n")


def _step(model_s: float, k: int, tool_s: float | None) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"text": f"step {k}"}]
    if tool_s is not None:
        parts.append({"functionCall": {"id": f"effect-{k}", "name": "bench_effect", "args": {"sleep_s": tool_s}}})
    return {"delay_s": model_s, "content": {"role": "model", "parts": parts}}


def trial_script(plan: Plan) -> dict[str, Any]:
    """`steps` model calls with one tool call each, then a final answer."""
    steps = [_step(plan.model_s, k, plan.tool_s) for k in range(plan.steps)]
    return {"steps": [*steps, _step(plan.model_s, plan.steps, None)]}


def control_script(plan: Plan) -> dict[str, Any]:
    """A model call of two leases (only heartbeats keep it), then four short steps: about three leases in all."""
    short = plan.lease_ttl_s / 4
    steps = [_step(plan.control_model_s, 0, 0.1), *(_step(short, k, 0.1) for k in range(1, 5))]
    return {"steps": [*steps, _step(0.1, 5, None)]}


def bench_parent() -> ParentSnapshot:
    """The example parent in `yolo` (its mode carries over, so the counted side effects run without approval),
    declaring `bench_effect` too: a fork runs only the tools its parent declared."""
    raw = json.loads(EXAMPLE_PARENT.read_text())
    effect = effect_tool()
    declared = {"name": effect.name, "description": effect.description, "parameters": dict(effect.parameters)}
    return parse_parent_snapshot({**raw, "approval_mode": "yolo", "tools": [*raw["tools"], declared]})


def base_env(redis_url: str, plan: Plan, tool_dir: Path, effects: Path) -> dict[str, str]:
    """The environment of every subprocess: no inherited FORKQ_*, the plan's timings, the tool plugin, the
    scripted provider."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}
    path = os.pathsep.join(p for p in (str(ROOT), str(tool_dir), env.get("PYTHONPATH", "")) if p)
    return {
        **env,
        "PYTHONPATH": path,
        EFFECTS_ENV: str(effects),
        "FORKQ_REDIS_URL": redis_url,
        "FORKQ_PROVIDER": "scripted",
        "FORKQ_LEASE_TTL_S": str(plan.lease_ttl_s),
        "FORKQ_HEARTBEAT_S": str(plan.heartbeat_s),
        "FORKQ_SWEEP_S": str(plan.sweep_s),
    }


def owner_pid(event: StreamEvent) -> int:
    """The pid in a `started` event's owner token `host:pid:thread:random`."""
    return int(str(event.wire_data()["owner"]).rsplit(":", 3)[1])


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile, linear between order statistics (never beyond the max)."""
    data = sorted(values)
    pos = (len(data) - 1) * p / 100
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def task_returns(proc: Proc, task_id: str) -> list[str]:
    """What Celery logged (INFO) as the return value of each run of `task_id` in this worker."""
    pattern = rf"run_fork\[{re.escape(task_id)}\] succeeded in [0-9.e-]+s: '([^']*)'"
    return re.findall(pattern, proc.log.read_text(errors="replace"))


# ── forkq: the fleet, the control forks, the disruptions ──────────────────────────────────────


@dataclass
class Forkq:
    """The forkq side: clients, the fleet, the trial workers alive, the control forks, the disruptions."""

    plan: Plan
    server: RedisServer
    r: redis.Redis
    store: ForkStore
    leases: Leases
    trials_client: ForkClient
    control_client: ForkClient
    parent: ParentSnapshot
    group: Fleet
    effects: Path
    worker_env: dict[str, str] = field(default_factory=dict)
    trial_workers: list[Proc] = field(default_factory=list)
    control: Proc | None = None
    controls: list[str] = field(default_factory=list)
    worker_count: int = 0
    restarts: list[float] = field(default_factory=list)  # each Redis restart: seconds until the workers answered
    blips: list[int] = field(default_factory=list)  # each blip: connections killed

    def start_worker(self, env: Mapping[str, str], prefix: str = "w") -> Proc:
        """A `forkq worker` subprocess (threads pool, default concurrency; INFO logs its tasks' return values)."""
        self.worker_count += 1
        name = f"{prefix}{self.worker_count}"
        argv = [sys.executable, "-m", "workers.cli", "worker", "--hostname", f"{name}@%h", "--loglevel", "INFO"]
        return self.group.start(name, argv, env)

    def top_up_controls(self) -> int:
        """Keep `plan.controls` control forks running on the control worker; how many were running."""
        live = [f for f in self.controls if not self.store.state(f).status.terminal]
        for _ in range(self.plan.controls - len(live)):
            self.controls.append(self.control_client.launch(self.parent, PARAMS).fork_id)
        return len(live)

    def in_long_call(self) -> int:
        """Control forks now in their long model call (step 1 started, no step recorded yet)."""
        busy = 0
        for fid in self.controls:
            kinds = {e.type for e in self.store.events(fid)}
            busy += "model_call" in kinds and "step" not in kinds and "finished" not in kinds
        return busy

    def restart_redis(self) -> None:
        """SIGTERM redis-server (it writes its AOF out and exits), keep it down for REDIS_DOWN_S, start it
        again from its files, and wait until every worker answers a ping again."""
        self.top_up_controls()
        time.sleep(1.0)  # the new control forks get claimed first
        running, long_call = self.top_up_controls(), self.in_long_call()
        began = time.monotonic()
        pid = self.server.pid
        if pid is None:
            raise RuntimeError("redis-server is not running")
        os.kill(pid, signal.SIGTERM)
        while self.server.pid is not None:
            if time.monotonic() - began > 30:
                raise RuntimeError("redis-server did not exit within 30 s of SIGTERM")
            time.sleep(0.01)
        time.sleep(max(0.0, began + REDIS_DOWN_S - time.monotonic()))
        self.server.restart()
        down = time.monotonic() - began
        for _ in range(50):  # the bench's own pooled connections were dropped too
            with contextlib.suppress(redis.ConnectionError):
                self.r.ping()
                break
            time.sleep(0.1)
        assert self.control is not None
        for attempt in range(10):  # the app's pooled broker connection was dropped too: its first use fails
            try:
                wait_ready(self.trials_client.app, [*self.trial_workers, self.control])
                break
            except redis.ConnectionError:
                if attempt == 9:
                    raise
                time.sleep(0.1)
        answered = time.monotonic() - began
        self.restarts.append(answered)
        print(
            f"  Redis restart {len(self.restarts)}: down {down:.2f} s (SIGTERM → PING answered); every worker "
            f"answered a ping {answered:.2f} s after the SIGTERM; {running} control forks running, {long_call} "
            f"in their {self.plan.control_model_s:.0f} s model call",
            flush=True,
        )

    def blip(self) -> None:
        """Kill every connection of the control worker to Redis, every BLIP_EVERY_S for BLIP_S."""
        assert self.control is not None
        running, long_call = self.top_up_controls(), self.in_long_call()
        process = psutil.Process(self.control.pid)
        killer = redis.Redis.from_url(self.server.url)
        ports = {c.laddr.port for c in process.net_connections(kind="tcp") if c.raddr}
        killed = 0
        deadline = time.monotonic() + BLIP_S
        while time.monotonic() < deadline:
            for entry in killer.client_list(_type="normal"):
                if int(entry["addr"].rsplit(":", 1)[1]) in ports:
                    with contextlib.suppress(redis.ResponseError):  # gone meanwhile
                        killed += killer.client_kill_filter(_id=entry["id"], skipme=True)
            ports |= {c.laddr.port for c in process.net_connections(kind="tcp") if c.raddr}
            time.sleep(BLIP_EVERY_S)
        killer.close()
        self.blips.append(killed)
        print(
            f"  network blip {len(self.blips)}: {killed} connections of {self.control.name} killed over "
            f"{BLIP_S:.0f} s; {running} control forks running, {long_call} in their "
            f"{self.plan.control_model_s:.0f} s model call",
            flush=True,
        )

    def claim_worker(self, fid: str) -> tuple[StreamEvent, Proc]:
        """The fork's `started` event and the trial worker that claimed it."""
        started = wait_event(self.store, fid, "0-0", ["started"], READY_TIMEOUT_S)
        worker = self.group.by_pid(owner_pid(started))
        if worker is None or worker not in self.trial_workers:
            raise RuntimeError(f"fork {fid} was claimed by {started.wire_data()['owner']}, not by a trial worker")
        return started, worker

    def at_signal_point(self, fid: str, started: StreamEvent) -> bool:
        """Sleep until a random point of the kill window; whether the fork still runs under that claim."""
        wait_s = started.at_ms / 1000 + random.uniform(*self.plan.kill_window_s) - redis_ms(self.r) / 1000
        time.sleep(max(0.0, wait_s))
        state = self.store.state(fid)
        return state.status == Status.RUNNING and state.owner == started.wire_data()["owner"]

    def replace(self, worker: Proc) -> None:
        """Take `worker` out of the trial workers and start another: two trial workers stay available."""
        self.trial_workers.remove(worker)
        self.trial_workers.append(self.start_worker(self.worker_env))

    def effects_of(self, pid: int) -> int:
        """bench_effect lines written by this process."""
        lines = self.effects.read_text().splitlines() if self.effects.exists() else []
        return sum(line.rsplit("\t", 1)[-1] == str(pid) for line in lines)


def wait_event(store: ForkStore, fork_id: str, after: str, kinds: Sequence[str], timeout: float) -> StreamEvent:
    """The fork's first event of one of `kinds` after stream id `after`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in store.events(fork_id, after=after, block_ms=200):
            after = event.id
            if event.type in kinds:
                return event
    raise RuntimeError(f"fork {fork_id}: no {'/'.join(kinds)} event within {timeout:.0f} s")


def phase_at(events: Sequence[StreamEvent], at_ms: float) -> str:
    """What the signalled worker was doing: the last progress event before the signal says."""
    last = [e for e in events if e.at_ms <= at_ms and e.type in ("started", "model_call", *STEP_EVENTS)][-1]
    if last.type == "model_call":
        return "in model call"
    if last.type == "step" and last.wire_data().get("tool_calls"):
        return "in tool call"
    return "between steps"


def digest_mismatches(events: Sequence[StreamEvent]) -> int:
    """Model calls whose replayed request digest differs from the first request of that step."""
    first: dict[int, str] = {}
    bad = 0
    for event in events:
        if event.type == "model_call":
            digest = first.setdefault(int(event.wire_data()["step"]), str(event.wire_data()["request_digest"]))
            bad += digest != event.wire_data()["request_digest"]
    return bad


@dataclass(frozen=True)
class Trial:
    """One SIGKILL or SIGSTOP: when, what the fork was doing, and what the revived run did."""

    fork_id: str
    signalled: str
    signal_ms: float
    into_fork_s: float
    phase: str
    revived_ms: int  # the `revived` event
    via: str  # how it was revived: `connection` or `lease`
    claimed_ms: int  # the revived run's `started` event
    next_ms: int
    next_kind: str
    resumed_on: str
    revived: int
    interrupted: int
    digest_mismatches: int
    status: str

    @property
    def recovery_s(self) -> float:
        """Signal → the revived run's first step or tool event."""
        return (self.next_ms - self.signal_ms) / 1000

    @property
    def revived_s(self) -> float:
        """Signal → the `revived` event."""
        return (self.revived_ms - self.signal_ms) / 1000


@dataclass(frozen=True)
class StopTrial:
    """A SIGSTOP trial: the trial, the lease deadline at the stop, and what the resumed worker did."""

    trial: Trial
    deadline_ms: int  # the fork's lease deadline (Redis ms) read just after the SIGSTOP
    stale_returns: list[str]  # what the stopped worker's run of the fork returned once resumed
    stale_writes: list[str]  # what changed after the SIGCONT: events, journal, state, side effects

    @property
    def after_lease(self) -> bool:
        """Revived through its lease, not before the lease deadline."""
        return self.trial.via == "lease" and self.trial.revived_ms >= self.deadline_ms - LEASE_TOLERANCE_MS

    @property
    def fenced(self) -> bool:
        """The resumed worker's run ended `lease_lost` and wrote nothing."""
        return self.stale_returns == ["lease_lost"] and not self.stale_writes


def analyse(fq: Forkq, fork_id: str, signalled: Proc, signal_ms: float, started: StreamEvent) -> Trial:
    """Read the finished fork's events and measure the trial."""
    events = fq.store.events(fork_id)
    revival = next(e for e in events if e.type == "started" and e.id > started.id)
    revived = [e for e in events if e.type == "revived"]
    nxt = next(e for e in events if e.type in STEP_EVENTS and e.id > revival.id)
    new = fq.group.by_pid(owner_pid(revival))
    if new is None or new is signalled or revival.at_ms < signal_ms or not revived:
        raise RuntimeError(f"fork {fork_id}: revival {revival} is not on another worker after the signal")
    after = [e for e in events if e.id > revival.id]
    return Trial(
        fork_id=fork_id,
        signalled=signalled.name,
        signal_ms=signal_ms,
        into_fork_s=(signal_ms - started.at_ms) / 1000,
        phase=phase_at(events, signal_ms),
        revived_ms=revived[0].at_ms,
        via=str(revived[0].wire_data().get("via")),
        claimed_ms=revival.at_ms,
        next_ms=nxt.at_ms,
        next_kind=nxt.type,
        resumed_on=new.name,
        revived=len(revived),
        interrupted=sum(e.type == "tool" and not e.wire_data().get("ok") for e in after),
        digest_mismatches=digest_mismatches(events),
        status=fq.store.state(fork_id).status.value,
    )


# ── SIGKILL trials ────────────────────────────────────────────────────────────────────────────


def run_kill(fq: Forkq) -> Trial | None:
    """Launch, kill the claiming worker mid-fork, replace it, wait for the end; None if the kill missed."""
    fid = fq.trials_client.launch(fq.parent, PARAMS).fork_id
    started, worker = fq.claim_worker(fid)
    if not fq.at_signal_point(fid, started):
        fq.trials_client.wait(fid, timeout=60)
        return None
    kill_ms = redis_ms(fq.r)
    worker.kill()
    fq.replace(worker)
    fq.trials_client.wait(fid, timeout=fq.plan.lease_ttl_s + fq.plan.sweep_s + 60)
    return analyse(fq, fid, worker, kill_ms, started)


def run_kills(fq: Forkq, between: Callable[[int], None]) -> list[Trial]:
    """`plan.kills` trials, one after another (retrying a kill that landed after the fork ended);
    `between(done)` runs before each."""
    trials: list[Trial] = []
    while len(trials) < fq.plan.kills:
        between(len(trials))
        fq.top_up_controls()
        trial = run_kill(fq)
        if trial is None:
            print("  kill missed (the fork had already ended); trial repeated", flush=True)
            continue
        trials.append(trial)
        print(
            f"  SIGKILL {len(trials):>2}/{fq.plan.kills}: {trial.signalled:<4} {trial.into_fork_s:4.1f} s into the "
            f"fork, {trial.phase:<13}; revived via {trial.via:<10} after {trial.revived_s:5.2f} s; next "
            f"{trial.next_kind:<4} on {trial.resumed_on:<4} after {trial.recovery_s:5.2f} s",
            flush=True,
        )
    return trials


# ── SIGSTOP trials ────────────────────────────────────────────────────────────────────────────


def run_stop(fq: Forkq) -> StopTrial | None:
    """Launch, SIGSTOP the claiming worker mid-fork, replace it, wait for the fork to end elsewhere; then
    SIGCONT the stopped worker, check it was fenced off, and SIGKILL it. None if the stop missed."""
    plan = fq.plan
    fid = fq.trials_client.launch(fq.parent, PARAMS).fork_id
    started, worker = fq.claim_worker(fid)
    if not fq.at_signal_point(fid, started):
        fq.trials_client.wait(fid, timeout=60)
        return None
    stop_ms = redis_ms(fq.r)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        deadline = fq.r.zscore(fq.store.keys.running, fid)
        if deadline is None:
            raise RuntimeError(f"fork {fid}: no lease deadline in the running index just after the stop")
        fq.replace(worker)
        fq.trials_client.wait(fid, timeout=plan.lease_ttl_s + plan.sweep_s + 60)
        before = (fq.store.events(fid, count=100_000), fq.leases.journal(fid), fq.store.state(fid))
        effects = fq.effects_of(worker.pid)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    task_id = f"{fid}.{started.wire_data()['attempt']}"
    ends = time.monotonic() + FENCE_TIMEOUT_S
    while not task_returns(worker, task_id) and time.monotonic() < ends:
        time.sleep(0.05)
    time.sleep(0.2)  # anything it would still write
    after = (fq.store.events(fid, count=100_000), fq.leases.journal(fid), fq.store.state(fid))
    writes = [what for what, b, a in zip(("events", "journal", "state"), before, after, strict=True) if b != a]
    if fq.effects_of(worker.pid) != effects:
        writes.append("side effects")
    returns = task_returns(worker, task_id)
    worker.kill()
    return StopTrial(analyse(fq, fid, worker, stop_ms, started), int(deadline), returns, writes)


def run_stops(fq: Forkq, between: Callable[[int], None]) -> list[StopTrial]:
    """`plan.stops` trials, one after another; `between(done)` runs before each."""
    trials: list[StopTrial] = []
    while len(trials) < fq.plan.stops:
        between(len(trials))
        fq.top_up_controls()
        stop = run_stop(fq)
        if stop is None:
            print("  stop missed (the fork had already ended); trial repeated", flush=True)
            continue
        trials.append(stop)
        t = stop.trial
        fenced = "fenced" if stop.fenced else f"NOT fenced ({stop.stale_returns}, wrote {stop.stale_writes})"
        print(
            f"  SIGSTOP {len(trials):>2}/{fq.plan.stops}: {t.signalled:<4} {t.into_fork_s:4.1f} s into the fork, "
            f"{t.phase:<13}; lease deadline +{(stop.deadline_ms - t.signal_ms) / 1000:5.2f} s, revived via "
            f"{t.via:<10} +{t.revived_s:5.2f} s; next {t.next_kind:<4} on {t.resumed_on:<4} +{t.recovery_s:5.2f} s; "
            f"{fenced}",
            flush=True,
        )
    return trials


# ── totals ────────────────────────────────────────────────────────────────────────────────────


def false_revivals(fq: Forkq, trials: Sequence[Trial]) -> int:
    """`revived` events on control forks + revivals beyond one per signalled trial fork."""
    control = sum(e.type == "revived" for fid in fq.controls for e in fq.store.events(fid))
    return control + sum(max(0, t.revived - 1) for t in trials)


def duplicated_effects(effects: Path) -> tuple[int, int]:
    """(effect lines beyond the first per idempotency key, effect lines in all)."""
    lines = effects.read_text().splitlines() if effects.exists() else []
    counts = Counter(line.split("\t", 1)[0] for line in lines)
    return sum(n - 1 for n in counts.values()), len(lines)


def stop_controls(fq: Forkq) -> list[str]:
    """Cancel the control forks still running; their final statuses."""
    for fid in fq.controls:
        fq.control_client.cancel(fid)
    return [fq.control_client.wait(fid, timeout=30).status.value for fid in fq.controls]


# ── report ────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Outcome:
    """Everything the report prints."""

    plan: Plan
    kills: list[Trial]
    stops: list[StopTrial]
    stock_s: list[float | None]
    duplicates: int
    effects: int
    false_revivals: int
    controls: int
    control_statuses: list[str]
    restarts: list[float]
    blips: list[int]


def _cell(values: Sequence[float], p: float | None) -> str:
    if not values:
        return "—"
    return f"{(max(values) if p is None else pct(values, p)):.2f}"


def _ok(passed: bool) -> str:
    return "ok" if passed else "MISS"


def print_table(o: Outcome, header: str) -> None:
    """The headline table with the target checks."""
    kill_s = [t.recovery_s for t in o.kills]
    stop_s = [s.trial.recovery_s for s in o.stops]
    stock_s = [s for s in o.stock_s if s is not None]
    p99_ok = bool(kill_s) and pct(kill_s, 99) <= KILL_TARGET_S
    print(f"\n{header}")
    print(f"\n{'figure':<58} {'forkq':>9} {'stock Celery':>13}  target")

    def row(label: str, forkq: object, stock: object = "—", target: str = "") -> None:
        print(f"{label:<58} {forkq!s:>9} {stock!s:>13}  {target}".rstrip())

    for label, p in (("p50", 50), ("p99", 99), ("max", None)):
        target = f"≤ {KILL_TARGET_S:.1f} s {_ok(p99_ok)}" if label == "p99" else ""
        row(f"SIGKILL → work resumes on another worker, {label} (s)", _cell(kill_s, p), _cell(stock_s, p), target)
    vias = Counter(t.via for t in o.kills)
    row("SIGKILLs measured", len(kill_s), len(o.stock_s))
    row("  revived via connection / via lease", f"{vias['connection']}/{vias['lease']}")
    for label, p in (("p50", 50), ("p99", 99), ("max", None)):
        row(f"SIGSTOP → work resumes on another worker, {label} (s)", _cell(stop_s, p))
    after = sum(s.after_lease for s in o.stops)
    fenced = sum(s.fenced for s in o.stops)
    all_stops = bool(o.stops)
    row(
        "SIGSTOP revived via lease, not before its deadline",
        f"{after}/{len(o.stops)}",
        "—",
        _ok(all_stops and after == len(o.stops)),
    )
    row(
        "SIGSTOPped worker fenced off when resumed",
        f"{fenced}/{len(o.stops)}",
        "—",
        _ok(all_stops and fenced == len(o.stops)),
    )
    row("duplicated side effects", o.duplicates, "—", f"0 {_ok(o.duplicates == 0)}")
    false_ok = o.false_revivals == 0 and bool(o.restarts) and bool(o.blips)
    label = f"false revivals ({len(o.restarts)} Redis restart, {len(o.blips)} blip, {o.controls} control forks)"
    row(label, o.false_revivals, "—", f"0 {_ok(false_ok)}")


def _counts(values: Sequence[str]) -> str:
    return ", ".join(f"{k} ×{n}" for k, n in sorted(Counter(values).items()))


def _split(trials: Sequence[Trial], ms: Callable[[Trial], float]) -> str:
    values = [ms(t) / 1000 for t in trials]
    return f"{_cell(values, 50)} / {_cell(values, None)}"


def print_details(o: Outcome) -> None:
    """What the figures measured, and the checks behind them."""
    plan, kills, stops = o.plan, o.kills, o.stops
    stop_trials = [s.trial for s in stops]
    missing = sum(s is None for s in o.stock_s)
    after_deadline = [(s.trial.revived_ms - s.deadline_ms) / 1000 for s in stops]
    lines = [
        "",
        f"trial fork: {plan.steps} steps, each a {plan.model_s:.1f} s model call + one {plan.tool_s:.1f} s "
        f"bench_effect call; signalled {plan.kill_window_s[0]}–{plan.kill_window_s[1]} s after `started`",
        "SIGKILL: Redis TIME just before the SIGKILL → stream id of the revived run's first step/tool event.",
        f"  killed: {_counts([t.phase for t in kills])}; next recorded event: {_counts([t.next_kind for t in kills])}",
        f"  revived via {_counts([t.via for t in kills])}",
        f"  split, p50 / max (s): kill → `revived` {_split(kills, lambda t: t.revived_ms - t.signal_ms)}; "
        f"→ revived run's `started` {_split(kills, lambda t: t.claimed_ms - t.revived_ms)}; "
        f"→ its first step/tool {_split(kills, lambda t: t.next_ms - t.claimed_ms)}",
        f"  p99 over {len(kills)} kills, linear between order statistics (≤ max)",
        "SIGSTOP: Redis TIME just before the SIGSTOP → the revived run's first step/tool event; the lease deadline",
        "  is the fork's score in the running index read just after the stop (its last renewal + the lease TTL).",
        f"  stopped: {_counts([t.phase for t in stop_trials])}; revived via {_counts([t.via for t in stop_trials])}",
        f"  stop → lease deadline: {_cell([(s.deadline_ms - s.trial.signal_ms) / 1000 for s in stops], 50)} s "
        f"p50; lease deadline → `revived`: min {min(after_deadline, default=0):.2f} s, max "
        f"{max(after_deadline, default=0):.2f} s (tolerance {LEASE_TOLERANCE_MS} ms before it)",
        f"  stop → `revived`: min {min((t.revived_s for t in stop_trials), default=0):.2f} s, "
        f"max {max((t.revived_s for t in stop_trials), default=0):.2f} s",
        "  fenced: after the fork ended elsewhere, SIGCONT; the resumed worker's run returned "
        f"{_counts([', '.join(s.stale_returns) or 'nothing' for s in stops])}; trials where it changed the "
        f"fork's events, journal, state or side effects: {sum(bool(s.stale_writes) for s in stops)}",
        f"all trials: interrupted tool calls answered with an error, not re-run: "
        f"{sum(t.interrupted for t in [*kills, *stop_trials])}; revived exactly once: "
        f"{sum(t.revived == 1 for t in [*kills, *stop_trials])}/{len(kills) + len(stops)}; succeeded: "
        f"{sum(t.status == 'succeeded' for t in [*kills, *stop_trials])}/{len(kills) + len(stops)}; replayed "
        f"model requests with another digest: {sum(t.digest_mismatches for t in [*kills, *stop_trials])}",
        f"side effects: {o.effects} bench_effect lines (trial + control forks); duplicates = lines beyond one per key",
        f"false revivals: `revived` events on the control forks ({plan.controls} at a time, {o.controls} in all, on a "
        f"never-killed worker, each with one {plan.control_model_s:.0f} s model call = 2 leases)",
        f"  + revivals beyond one per signalled trial fork; control forks ended {_counts(o.control_statuses)}",
        f"  Redis restarts between trials: {len(o.restarts)} (SIGTERM, down ~{REDIS_DOWN_S:.0f} s, restarted from "
        f"its AOF; every worker answered again after {', '.join(f'{s:.1f}' for s in o.restarts)} s)",
        f"  network blips: {len(o.blips)} (CLIENT KILL of the control worker's connections every "
        f"{BLIP_EVERY_S * 1000:.0f} ms for {BLIP_S:.0f} s: {', '.join(map(str, o.blips))} connections killed)",
        f"stock Celery: acks_late + task_reject_on_worker_lost, visibility_timeout {STOCK_VISIBILITY_S} s, threads",
        f"  pool; node SIGKILLed {STOCK_KILL_AFTER_S:.0f} s into the task; Redis TIME at the kill → the task's next "
        "start (stream id), on another node"
        + (f"; {missing} not restarted within {STOCK_RESTART_TIMEOUT_S:.0f} s" if missing else ""),
    ]
    print("\n".join(lines))


# ── main ──────────────────────────────────────────────────────────────────────────────────────


def start_fleet(fq: Forkq, env: dict[str, str], tmp: Path, plan: Plan) -> Proc:
    """Two trial workers, the control worker and the sweeper; returns the sweeper."""
    (tmp / "trial.json").write_text(json.dumps(trial_script(plan)))
    (tmp / "control.json").write_text(json.dumps(control_script(plan)))
    fq.worker_env = {**env, "FORKQ_SCRIPT": str(tmp / "trial.json")}
    fq.trial_workers = [fq.start_worker(fq.worker_env), fq.start_worker(fq.worker_env)]
    control_env = {**env, "FORKQ_SCRIPT": str(tmp / "control.json"), "FORKQ_QUEUE": CONTROL_QUEUE}
    fq.control = fq.start_worker(control_env, prefix="control")
    return fq.group.start("sweeper", [sys.executable, "-m", "workers.cli", "sweep"], env)


def run(plan: Plan) -> None:
    """Start Redis and every process, run both sides, print the report, stop everything."""
    began = time.monotonic()
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer(appendonly=True))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="forkq-revival-")))
        group = stack.enter_context(fleet(tmp))
        write_tool_plugin(tmp / "plugin")
        effects = tmp / "effects.tsv"
        env = base_env(server.url, plan, tmp / "plugin", effects)
        r = stack.enter_context(redis.Redis.from_url(server.url))
        settings = Settings(redis_url=server.url, queue=TRIAL_QUEUE)
        parent = bench_parent()
        trials_client = ForkClient(settings, redis_client=r)
        control_client = ForkClient(Settings(redis_url=server.url, queue=CONTROL_QUEUE), redis_client=r)
        store = trials_client.store
        leases = Leases(r, store.keys, ttl_ms=int(plan.lease_ttl_s * 1000), retention_s=3600)
        fq = Forkq(plan, server, r, store, leases, trials_client, control_client, parent, group, effects)
        sweeper = start_fleet(fq, env, tmp, plan)
        broker = server.url.rsplit("/", 1)[0] + "/1"  # own db: kombu's unacked keys are per db
        stock_app = make_stock_app(broker)
        stock = Stock(stock_app, stack.enter_context(redis.Redis.from_url(broker)), group, env, broker, [])
        stock.workers = [stock.start_worker(), stock.start_worker()]
        assert fq.control is not None
        wait_ready(trials_client.app, [*fq.trial_workers, fq.control])
        wait_ready(stock_app, stock.workers)
        print(
            f"redis-server {server.url} (AOF); 2 trial workers, 1 control worker, sweeper, 2 stock Celery workers "
            f"ready after {time.monotonic() - began:.1f} s",
            flush=True,
        )
        side = threading.Thread(target=stock.run, args=(plan.stock_trials,), name="stock-celery", daemon=True)
        side.start()

        def between_kills(done: int) -> None:  # the blip: it does not touch the stock side
            if done == plan.kills // 2 and not fq.blips:
                fq.blip()

        def between_stops(done: int) -> None:  # the restart: once the stock side is done with Redis
            if done >= plan.stops // 2 and not fq.restarts and not side.is_alive():
                fq.restart_redis()

        kills = run_kills(fq, between_kills)
        if not fq.blips:
            fq.blip()
        stops = run_stops(fq, between_stops)
        side.join(timeout=plan.stock_trials * (STOCK_RESTART_TIMEOUT_S + 30))
        if stock.error is not None:
            raise stock.error
        if not fq.restarts:  # the stock side outlasted the trials: restart now, then give a false revival time
            fq.restart_redis()
            time.sleep(plan.lease_ttl_s + 2 * plan.sweep_s)
        statuses = stop_controls(fq)
        trials = [*kills, *(s.trial for s in stops)]
        false = false_revivals(fq, trials)
        dead = [p.name for p in (fq.control, sweeper) if p.process.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} died during the run; see the logs in {tmp}")
        duplicates, lines = duplicated_effects(effects)
        outcome = Outcome(
            plan,
            kills,
            stops,
            stock.restarts_s,
            duplicates,
            lines,
            false,
            len(fq.controls),
            statuses,
            fq.restarts,
            fq.blips,
        )
        print_table(outcome, header(plan, r))
        print_details(outcome)
    print(f"\ntotal {time.monotonic() - began:.0f} s")


def header(plan: Plan, r: redis.Redis) -> str:
    """The machine and the timings, with a warning when they are not forkq's defaults."""
    server = r.info("server")["redis_version"]
    timings = (
        f"FORKQ_LEASE_TTL_S={plan.lease_ttl_s:g}, FORKQ_HEARTBEAT_S={plan.heartbeat_s:g}, "
        f"FORKQ_SWEEP_S={plan.sweep_s:g}, FORKQ_PRESENCE_CHECK_S={PRESENCE_CHECK_S:g}, "
        f"FORKQ_PRESENCE_GRACE_S={PRESENCE_GRACE_S:g}"
    )
    note = (
        "\n  --quick: SHORTENED lease timings, not forkq's defaults (15/5/2)" if plan.quick else " (forkq's defaults)"
    )
    return (
        f"forkq revival: {os.cpu_count()} CPUs, Python {platform.python_version()}, redis-server {server}, "
        f"Celery {celery.__version__}\n{timings}{note}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, help="SIGKILL trials (20; 5 with --quick)")
    parser.add_argument("--stops", type=int, help="SIGSTOP trials (20; 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="shortened timings, few trials, one stock trial")
    args = parser.parse_args()
    run(make_plan(args.kills, args.stops, args.quick))


if __name__ == "__main__":
    main()

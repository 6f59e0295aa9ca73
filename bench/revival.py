"""Benchmark: SIGKILL a worker mid-fork, time until the fork's next step on another worker, vs stock Celery.

Run: `python bench/revival.py [--kills 20] [--quick]`. Starts a private redis-server, two forkq trial
workers, one control worker (its own queue, never killed), `forkq sweep`, and two stock-Celery workers.
forkq runs with its default timings (FORKQ_LEASE_TTL_S=15, FORKQ_HEARTBEAT_S=5, FORKQ_SWEEP_S=2);
`--quick` shortens them (and says so). Each trial launches a fork whose scripted steps each call the
`bench_effect` tool (one side effect per run, a line keyed by the call's idempotency key in a file),
SIGKILLs the worker that claimed it (pid from the `started` event's owner) 0.5–3.5 s in, starts a
replacement worker, and measures Redis TIME at the kill → the first `step`/`tool` event of the revived
run (stream id). Control forks, with a model call longer than the lease, run alongside on the control
worker: any `revived` event on them is a false revival. Stock Celery runs in the same run, in a thread
(bench/revival_stock.py): a bare app (acks_late, task_reject_on_worker_lost, visibility_timeout 60 s)
with a long task; SIGKILL its worker node; Redis TIME at the kill → the task's next start elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/revival.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
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
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot  # noqa: E402
from workers.records.fork import Status  # noqa: E402
from workers.store.forks import ForkEvent, ForkStore  # noqa: E402
from workers.store.redis_server import RedisServer  # noqa: E402
from workers.tools.registry import Tool, ToolContext  # noqa: E402

EXAMPLE_PARENT = ROOT / "workers" / "examples" / "parent.json"
PARAMS = {"description": "revival bench fork", "prompt": "Apply the planned edits.", "subagent_type": "fork"}
TRIAL_QUEUE, CONTROL_QUEUE = "forks", "bench-control"
EFFECTS_ENV = "BENCH_REVIVAL_EFFECTS"  # the file bench_effect appends to (read by the tool, in the workers)
STEP_EVENTS = ("step", "tool")


@dataclass(frozen=True)
class Plan:
    """Timings and sizes of one run: forkq's defaults, or `--quick`."""

    kills: int
    lease_ttl_s: float
    heartbeat_s: float
    sweep_s: float
    steps: int  # scripted steps of a trial fork, each a model call (model_s) and one tool call (tool_s)
    model_s: float
    tool_s: float
    kill_window_s: tuple[float, float]  # when to kill, after the fork's `started` event
    stock_trials: int
    controls: int
    quick: bool

    @property
    def target_s(self) -> float:
        """The p99 target: lease TTL + sweep interval + 3 s."""
        return self.lease_ttl_s + self.sweep_s + 3.0


def make_plan(kills: int, quick: bool) -> Plan:
    """forkq's default timings, or shortened ones with `quick`."""
    if quick:
        return Plan(kills, 3.0, 1.0, 0.5, 6, 0.2, 0.2, (0.3, 1.5), 1, 2, True)
    return Plan(kills, 15.0, 5.0, 2.0, 6, 0.4, 0.4, (0.5, 3.5), 3, 2, False)


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
    """A model call of 1.5 leases (only heartbeats keep it), then short steps: about four leases in all."""
    short = plan.lease_ttl_s / 4
    steps = [_step(1.5 * plan.lease_ttl_s, 0, 0.1), *(_step(short, k, 0.1) for k in range(1, 11))]
    return {"steps": [*steps, _step(0.1, 11, None)]}


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


def owner_pid(event: ForkEvent) -> int:
    """The pid in a `started` event's owner token `host:pid:thread:random`."""
    return int(str(event.data["owner"]).rsplit(":", 3)[1])


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile, linear between order statistics (never beyond the max)."""
    data = sorted(values)
    pos = (len(data) - 1) * p / 100
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


# ── forkq trials ──────────────────────────────────────────────────────────────────────────────


@dataclass
class Forkq:
    """The forkq side: clients, the fleet, the trial workers alive, the control forks."""

    plan: Plan
    r: redis.Redis
    store: ForkStore
    trials_client: ForkClient
    control_client: ForkClient
    parent: ParentSnapshot
    group: Fleet
    worker_env: dict[str, str]
    trial_workers: list[Proc]
    controls: list[str] = field(default_factory=list)
    worker_count: int = 0

    def start_worker(self, env: Mapping[str, str], prefix: str = "w") -> Proc:
        """A `forkq worker` subprocess (threads pool, default concurrency)."""
        self.worker_count += 1
        name = f"{prefix}{self.worker_count}"
        argv = [sys.executable, "-m", "workers.cli", "worker", "--hostname", f"{name}@%h", "--loglevel", "WARNING"]
        return self.group.start(name, argv, env)

    def top_up_controls(self) -> None:
        """Keep `plan.controls` control forks running on the control worker."""
        live = [f for f in self.controls if not self.store.state(f).status.terminal]
        for _ in range(self.plan.controls - len(live)):
            self.controls.append(self.control_client.launch(self.parent, PARAMS).fork_id)


def wait_event(store: ForkStore, fork_id: str, after: str, kinds: Sequence[str], timeout: float) -> ForkEvent:
    """The fork's first event of one of `kinds` after stream id `after`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in store.events(fork_id, after=after, block_ms=200):
            after = event.id
            if event.type in kinds:
                return event
    raise RuntimeError(f"fork {fork_id}: no {'/'.join(kinds)} event within {timeout:.0f} s")


@dataclass(frozen=True)
class Trial:
    """One kill: when, what the fork was doing, and what the revived run did."""

    fork_id: str
    killed: str
    kill_ms: float
    into_fork_s: float
    phase: str
    next_ms: int
    next_kind: str
    resumed_on: str
    revived: int
    interrupted: int
    digest_mismatches: int
    status: str

    @property
    def recovery_s(self) -> float:
        """Kill → the revived run's first step or tool event."""
        return (self.next_ms - self.kill_ms) / 1000


def phase_at(events: Sequence[ForkEvent], kill_ms: float) -> str:
    """What the killed worker was doing: the last progress event before the kill says."""
    last = [e for e in events if e.at_ms <= kill_ms and e.type in ("started", "model_call", *STEP_EVENTS)][-1]
    if last.type == "model_call":
        return "in model call"
    if last.type == "step" and last.data.get("tool_calls"):
        return "in tool call"
    return "between steps"


def digest_mismatches(events: Sequence[ForkEvent]) -> int:
    """Model calls whose replayed request digest differs from the first request of that step."""
    first: dict[int, str] = {}
    bad = 0
    for event in events:
        if event.type == "model_call":
            digest = first.setdefault(int(event.data["step"]), str(event.data["request_digest"]))
            bad += digest != event.data["request_digest"]
    return bad


def analyse(fq: Forkq, fork_id: str, killed: Proc, kill_ms: float, started: ForkEvent) -> Trial:
    """Read the finished fork's events and measure the trial."""
    events = fq.store.events(fork_id)
    revival = next(e for e in events if e.type == "started" and e.id > started.id)
    nxt = next(e for e in events if e.type in STEP_EVENTS and e.id > revival.id)
    new = fq.group.by_pid(owner_pid(revival))
    if new is None or new is killed or revival.at_ms < kill_ms:
        raise RuntimeError(f"fork {fork_id}: revival {revival} is not on another worker after the kill")
    after = [e for e in events if e.id > revival.id]
    return Trial(
        fork_id=fork_id,
        killed=killed.name,
        kill_ms=kill_ms,
        into_fork_s=(kill_ms - started.at_ms) / 1000,
        phase=phase_at(events, kill_ms),
        next_ms=nxt.at_ms,
        next_kind=nxt.type,
        resumed_on=new.name,
        revived=sum(e.type == "revived" for e in events),
        interrupted=sum(e.type == "tool" and not e.data.get("ok") for e in after),
        digest_mismatches=digest_mismatches(events),
        status=fq.store.state(fork_id).status.value,
    )


def run_trial(fq: Forkq) -> Trial | None:
    """Launch, kill the claiming worker mid-fork, replace it, wait for the end; None if the kill missed."""
    plan = fq.plan
    fid = fq.trials_client.launch(fq.parent, PARAMS).fork_id
    started = wait_event(fq.store, fid, "0-0", ["started"], READY_TIMEOUT_S)
    worker = fq.group.by_pid(owner_pid(started))
    if worker is None or worker not in fq.trial_workers:
        raise RuntimeError(f"fork {fid} was claimed by {started.data['owner']}, not by a trial worker")
    time.sleep(max(0.0, started.at_ms / 1000 + random.uniform(*plan.kill_window_s) - redis_ms(fq.r) / 1000))
    state = fq.store.state(fid)
    if state.status != Status.RUNNING or state.owner != started.data["owner"]:
        fq.trials_client.wait(fid, timeout=60)
        return None
    kill_ms = redis_ms(fq.r)
    worker.kill()
    fq.trial_workers.remove(worker)
    fq.trial_workers.append(fq.start_worker(fq.worker_env))  # two trial workers stay available
    fq.trials_client.wait(fid, timeout=plan.lease_ttl_s + plan.sweep_s + 60)
    return analyse(fq, fid, worker, kill_ms, started)


def run_trials(fq: Forkq) -> list[Trial]:
    """`plan.kills` trials, one after another (retrying a kill that landed after the fork ended)."""
    trials: list[Trial] = []
    while len(trials) < fq.plan.kills:
        fq.top_up_controls()
        trial = run_trial(fq)
        if trial is None:
            print("  kill missed (the fork had already ended); trial repeated", flush=True)
            continue
        trials.append(trial)
        print(
            f"  forkq {len(trials):>2}/{fq.plan.kills}: killed {trial.killed:<4} {trial.into_fork_s:4.1f} s into the "
            f"fork, {trial.phase:<13}; next {trial.next_kind:<4} on {trial.resumed_on:<4} after "
            f"{trial.recovery_s:6.2f} s",
            flush=True,
        )
    return trials


def false_revivals(fq: Forkq, trials: Sequence[Trial]) -> tuple[int, int]:
    """(revived events on control forks + revivals beyond one per killed trial fork, control forks seen)."""
    control = sum(e.type == "revived" for fid in fq.controls for e in fq.store.events(fid))
    return control + sum(max(0, t.revived - 1) for t in trials), len(fq.controls)


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
    trials: list[Trial]
    stock_s: list[float | None]
    duplicates: int
    effects: int
    false_revivals: int
    controls: int
    control_statuses: list[str]


def _cell(values: Sequence[float], p: float | None) -> str:
    if not values:
        return "—"
    return f"{(max(values) if p is None else pct(values, p)):.2f}"


def print_table(o: Outcome, header: str) -> None:
    """The headline table with the target checks."""
    plan = o.plan
    fork_s = [t.recovery_s for t in o.trials]
    stock_s = [s for s in o.stock_s if s is not None]
    p99_ok = pct(fork_s, 99) <= plan.target_s
    print(f"\n{header}")
    print(f"\n{'figure':<46} {'forkq':>9} {'stock Celery':>13}  target")
    for label, p, target in (("p50", 50, ""), ("p99", 99, f"≤ {plan.target_s:.1f} s"), ("max", None, "")):
        check = f"{target} {'ok' if p99_ok else 'MISS'}" if target else ""
        print(f"{'kill → work resumes on another worker, ' + label + ' (s)':<46} ", end="")
        print(f"{_cell(fork_s, p):>9} {_cell(stock_s, p):>13}  {check}")
    print(f"{'SIGKILLs measured':<46} {len(fork_s):>9} {len(o.stock_s):>13}")
    print(f"{'duplicated side effects':<46} {o.duplicates:>9} {'—':>13}  0 {'ok' if o.duplicates == 0 else 'MISS'}")
    ok = "ok" if o.false_revivals == 0 else "MISS"
    print(f"{'false revivals of live workers':<46} {o.false_revivals:>9} {'—':>13}  0 {ok}")


def _counts(values: Sequence[str]) -> str:
    return ", ".join(f"{k} ×{n}" for k, n in sorted(Counter(values).items()))


def print_details(o: Outcome) -> None:
    """What the figures measured, and the checks behind them."""
    plan, trials = o.plan, o.trials
    missing = sum(s is None for s in o.stock_s)
    lines = [
        "",
        "forkq: Redis TIME just before the SIGKILL → stream id of the revived run's first step/tool event.",
        f"  trial fork: {plan.steps} steps, each a {plan.model_s:.1f} s model call + one {plan.tool_s:.1f} s "
        f"bench_effect call; killed {plan.kill_window_s[0]}–{plan.kill_window_s[1]} s after `started`",
        f"  killed: {_counts([t.phase for t in trials])}; next recorded event: "
        f"{_counts([t.next_kind for t in trials])}",
        f"  interrupted tool calls answered with an error, not re-run: {sum(t.interrupted for t in trials)}; "
        f"revived exactly once: {sum(t.revived == 1 for t in trials)}/{len(trials)}; "
        f"succeeded: {sum(t.status == 'succeeded' for t in trials)}/{len(trials)}",
        f"  replayed model requests with another digest than the original: {sum(t.digest_mismatches for t in trials)}",
        f"  p99 over {len(trials)} kills, linear between order statistics (≤ max)",
        f"side effects: {o.effects} bench_effect lines (trial + control forks); duplicates = lines beyond one per key",
        f"false revivals: `revived` events on {o.controls} control forks (never-killed worker, each with one "
        f"{1.5 * plan.lease_ttl_s:.1f} s model call = 1.5 leases)",
        f"  + revivals beyond one per killed trial fork; control forks ended {_counts(o.control_statuses)}",
        f"stock Celery: acks_late + task_reject_on_worker_lost, visibility_timeout {STOCK_VISIBILITY_S} s, threads",
        f"  pool; node SIGKILLed {STOCK_KILL_AFTER_S:.0f} s into the task; Redis TIME at the kill → the task's next "
        "start (stream id), on another node"
        + (f"; {missing} not restarted within {STOCK_RESTART_TIMEOUT_S:.0f} s" if missing else ""),
    ]
    print("\n".join(lines))


# ── main ──────────────────────────────────────────────────────────────────────────────────────


def start_fleet(fq: Forkq, env: dict[str, str], tmp: Path, plan: Plan) -> tuple[Proc, Proc]:
    """Two trial workers, the control worker and the sweeper; returns the last two (never killed)."""
    (tmp / "trial.json").write_text(json.dumps(trial_script(plan)))
    (tmp / "control.json").write_text(json.dumps(control_script(plan)))
    fq.worker_env = {**env, "FORKQ_SCRIPT": str(tmp / "trial.json")}
    fq.trial_workers = [fq.start_worker(fq.worker_env), fq.start_worker(fq.worker_env)]
    control_env = {**env, "FORKQ_SCRIPT": str(tmp / "control.json"), "FORKQ_QUEUE": CONTROL_QUEUE}
    control = fq.start_worker(control_env, prefix="control")
    sweeper = fq.group.start("sweeper", [sys.executable, "-m", "workers.cli", "sweep"], env)
    return control, sweeper


def run(plan: Plan) -> None:
    """Start Redis and every process, run both sides, print the report, stop everything."""
    began = time.monotonic()
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="forkq-revival-")))
        group = stack.enter_context(fleet(tmp))
        write_tool_plugin(tmp / "plugin")
        effects = tmp / "effects.tsv"
        env = base_env(server.url, plan, tmp / "plugin", effects)
        r = stack.enter_context(redis.Redis.from_url(server.url))
        settings = Settings(redis_url=server.url, queue=TRIAL_QUEUE)
        # yolo: the parent's mode carries over, so the counted side effects run without approval
        parent = parse_parent_snapshot({**json.loads(EXAMPLE_PARENT.read_text()), "approval_mode": "yolo"})
        trials_client = ForkClient(settings, redis_client=r)
        control_client = ForkClient(Settings(redis_url=server.url, queue=CONTROL_QUEUE), redis_client=r)
        fq = Forkq(plan, r, trials_client.store, trials_client, control_client, parent, group, {}, [])
        control, sweeper = start_fleet(fq, env, tmp, plan)
        broker = server.url.rsplit("/", 1)[0] + "/1"  # own db: kombu's unacked keys are per db
        stock_app = make_stock_app(broker)
        stock = Stock(stock_app, stack.enter_context(redis.Redis.from_url(broker)), group, env, broker, [])
        stock.workers = [stock.start_worker(), stock.start_worker()]
        wait_ready(trials_client.app, [*fq.trial_workers, control])
        wait_ready(stock_app, stock.workers)
        print(
            f"redis-server {server.url}; 2 trial workers, 1 control worker, sweeper, 2 stock Celery workers ready "
            f"after {time.monotonic() - began:.1f} s",
            flush=True,
        )
        side = threading.Thread(target=stock.run, args=(plan.stock_trials,), name="stock-celery", daemon=True)
        side.start()
        trials = run_trials(fq)
        side.join(timeout=plan.stock_trials * (STOCK_RESTART_TIMEOUT_S + 30))
        if stock.error is not None:
            raise stock.error
        statuses = stop_controls(fq)
        false, controls = false_revivals(fq, trials)
        dead = [p.name for p in (control, sweeper) if p.process.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} died during the run; see the logs in {tmp}")
        duplicates, lines = duplicated_effects(effects)
        outcome = Outcome(plan, trials, stock.restarts_s, duplicates, lines, false, controls, statuses)
        print_table(outcome, header(plan, r))
        print_details(outcome)
    print(f"\ntotal {time.monotonic() - began:.0f} s")


def header(plan: Plan, r: redis.Redis) -> str:
    """The machine and the timings, with a warning when they are not forkq's defaults."""
    server = r.info("server")["redis_version"]
    timings = (
        f"FORKQ_LEASE_TTL_S={plan.lease_ttl_s:g}, FORKQ_HEARTBEAT_S={plan.heartbeat_s:g}, "
        f"FORKQ_SWEEP_S={plan.sweep_s:g}"
    )
    note = "  --quick: SHORTENED timings, not forkq's defaults (15/5/2)" if plan.quick else "  (forkq's defaults)"
    return (
        f"forkq revival: {os.cpu_count()} CPUs, Python {platform.python_version()}, redis-server {server}, "
        f"Celery {celery.__version__}\n{timings}{note}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="forkq trials (SIGKILLs), at least 20 by default")
    parser.add_argument("--quick", action="store_true", help="shortened timings, one stock trial (under 3 minutes)")
    args = parser.parse_args()
    run(make_plan(args.kills, args.quick))


if __name__ == "__main__":
    main()

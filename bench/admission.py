"""Benchmark: forks sharing one model endpoint of K slots, with model admission (FORKQ_MODEL_LIMITS) and without.

Run: `python bench/admission.py [--quick] [--parts storm,fairness,cost]`. Every case gets a private
redis-server, an OpenAI-compatible stub (bench/openai_stub.py: at most K requests at once, `429` with
`Retry-After` beyond that, a fixed latency L, three model calls per fork: two `list_directory` calls, then
the answer), two forkq workers (`forkq worker --pool threads`, enough threads for half the forks each)
and one `forkq sweep`, with the `openai` provider pointed at the stub. The parts, each with and without
limits in the same run:

1. storm: N forks (1,000) queued, then the workers started. Requests, the share answered 429, the makespan
   (first `started` → last `finished` event, Redis clock) against the ideal N × 3 × L / K, failures. With
   limits: `{"concurrency": K}` for the stub's model. Targets with limits: 429s ≤ 0.1%, makespan ≤ 1.15×.
2. fairness: workers running, session A launches 500 forks, B launches 10 five seconds after A began.
   B's median time to finish (its launch → its `finished`) against what its fair share predicts: with two
   sessions active B may hold min(n_B, K / 2) slots, so its forks finish in 3 × L × ⌈n_B / that⌉. Target
   with fair share: ≤ 1.5×. The same without fair share (no setting turns it off: every fork of A and B
   gets a parent session of its own, so the fair queue takes turns per fork, not per session), and
   without limits. Where the time went: each group's median launch → started → first model call, the
   time inside its model calls (admission wait + the call) and the forks that had a call queued.
3. cost: N forks on an endpoint with room for all (no 429, no wait), limits set far above the demand against
   none: what admission adds per model call in Redis round trips (INFO stats `total_writes_processed`: one
   reply write per round trip, a pipeline's in one), in Redis commands (INFO commandstats deltas, commands
   inside Lua scripts included, by name) and in worker CPU (both workers,
   first `started` → last `finished`). Every case also prints the stub's busy share of K and its Redis
   commands per model call.

Which tree is measured: the one this script is in. "With limits" needs `FORKQ_MODEL_LIMITS`
(`Settings.model_limits`); a tree without it runs only the cases without limits and says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/admission.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import redis  # noqa: E402

from bench import openai_stub  # noqa: E402
from bench.concurrency import EXAMPLE_PARENT, RedisCounters, Sampler  # noqa: E402
from bench.procs import Fleet, Proc, fleet, wait_ready, worker_env  # noqa: E402
from broker_config.settings import Settings  # noqa: E402
from workers.app import make_app  # noqa: E402
from workers.client import ForkClient, new_fork_id  # noqa: E402
from workers.demo.redis_server import RedisServer, _free_tcp_port  # noqa: E402
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot  # noqa: E402
from workers.records.events import StreamEvent  # noqa: E402

MODEL = "bench-stub"  # the forks' model: the parent's, routed to the openai provider
CALLS = 3  # model calls per fork, as the stub scripts them
PARAMS = {"description": "admission bench fork", "prompt": "List the project files.", "subagent_type": "fork"}
QUEUE = "forks"
WORKERS = ("adm1", "adm2")
PER_FORK = "(each fork its own session)"
POLL_S = 0.5
TARGET_THROTTLED = 0.001
TARGET_MAKESPAN = 1.15
TARGET_FAIRNESS = 1.5


# ── what to run ───────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Group:
    """Forks launched together from one parent session, `delay_s` after the case's first launch."""

    name: str
    forks: int
    delay_s: float = 0.0
    session: str = ""  # the parent session; PER_FORK: a session of its own for every fork


@dataclass(frozen=True)
class Case:
    """One configuration: forks, the stub's K and L, and the admission settings of the workers."""

    part: str
    label: str
    groups: tuple[Group, ...]
    k: int
    latency_s: float
    limits: dict[str, dict[str, int]] | None = None  # FORKQ_MODEL_LIMITS, None: not set
    env: tuple[tuple[str, str], ...] = ()  # more FORKQ_* settings of the workers
    queued: bool = True  # every fork queued before the workers start (else launched while they run)

    @property
    def forks(self) -> int:
        """Forks of every group."""
        return sum(g.forks for g in self.groups)

    @property
    def ideal_s(self) -> float:
        """The makespan with K always busy: every call × L / K (never less than one fork's 3 × L)."""
        return max(self.forks * CALLS * self.latency_s / self.k, CALLS * self.latency_s)


@dataclass(frozen=True)
class Plan:
    """Sizes of the three parts (the full run, or `--quick`)."""

    storm_forks: int = 1000
    storm_k: int = 50
    latency_s: float = 1.0
    a_forks: int = 500
    b_forks: int = 10
    b_delay_s: float = 5.0
    fair_k: int = 50
    cost_forks: int = 1000
    cost_latency_s: float = 2.0
    retry_after_s: int = 1


FULL = Plan()
QUICK = Plan(
    storm_forks=200,
    storm_k=20,
    latency_s=0.5,
    a_forks=60,
    b_forks=5,
    b_delay_s=2.0,
    fair_k=10,
    cost_forks=200,
    cost_latency_s=1.0,
)


def limits_supported() -> bool:
    """Whether this tree reads FORKQ_MODEL_LIMITS."""
    return "model_limits" in Settings.model_fields


def cases(plan: Plan, parts: Sequence[str]) -> list[Case]:
    """Every case of the chosen parts, with limits and without."""
    limited = limits_supported()
    out: list[Case] = []
    if "storm" in parts:
        storm = (Group("storm", plan.storm_forks, session="storm"),)
        cap = {MODEL: {"concurrency": plan.storm_k}}
        if limited:
            out.append(Case("storm", "limits", storm, plan.storm_k, plan.latency_s, cap))
        out.append(Case("storm", "no limits", storm, plan.storm_k, plan.latency_s))
    if "fairness" in parts:
        a, b = Group("A", plan.a_forks, session="session-A"), Group("B", plan.b_forks, plan.b_delay_s, "session-B")
        cap = {MODEL: {"concurrency": plan.fair_k}}
        fair = Case("fairness", "fair share", (a, b), plan.fair_k, plan.latency_s, cap, queued=False)
        if limited:
            out.append(fair)
            # no setting turns fair share off: with a session of its own, every fork gets one turn, as in FIFO
            solo = (replace(a, session=PER_FORK), replace(b, session=PER_FORK))
            out.append(replace(fair, label="limits, a session per fork", groups=solo))
        out.append(replace(fair, label="no limits", limits=None))
    if "cost" in parts:
        many = plan.cost_forks * 10  # room for every request at once: no 429, no wait
        group = (Group("cost", plan.cost_forks, session="cost"),)
        if limited:
            out.append(Case("cost", "limits", group, many, plan.cost_latency_s, {MODEL: {"concurrency": many}}))
        out.append(Case("cost", "no limits", group, many, plan.cost_latency_s))
    return out


# ── one case ──────────────────────────────────────────────────────────────────────────────────


@dataclass
class Fork:
    """One fork's group, times (Unix ms) and end."""

    fork_id: str
    group: str
    launched_ms: float
    started_ms: float | None = None
    finished_ms: float | None = None
    status: str = ""
    error: str = ""
    first_call_ms: float | None = None  # its first `model_call` event
    in_calls_s: float = 0.0  # `model_call` → its `step`, summed: admission wait + the call
    waits: int = 0  # `model_wait` events: calls that were queued


@dataclass
class Outcome:
    """What one case measured."""

    case: Case
    forks: list[Fork] = field(default_factory=list)
    stub: dict[str, Any] = field(default_factory=dict)
    redis_calls: Counter[str] = field(default_factory=Counter)
    redis_round_trips: int = 0
    redis_cpu_s: float = float("nan")
    worker_cpu_s: float = float("nan")
    b_offset_s: float = float("nan")
    note: str = ""

    @property
    def served(self) -> int:
        """Model calls answered 200."""
        return int(self.stub.get("served", 0))

    @property
    def requests(self) -> int:
        """Chat completion requests the stub received."""
        return int(self.stub.get("requests", 0))

    @property
    def throttled(self) -> int:
        """Requests answered 429."""
        return int(self.stub.get("throttled", 0))

    @property
    def throttled_share(self) -> float:
        """429s over requests."""
        return self.throttled / self.requests if self.requests else float("nan")

    def window_ms(self, group: str | None = None) -> tuple[float, float] | None:
        """First `started` → last `finished` (of one group, or of all)."""
        chosen = [f for f in self.forks if group is None or f.group == group]
        starts = [f.started_ms for f in chosen if f.started_ms is not None]
        ends = [f.finished_ms for f in chosen if f.finished_ms is not None]
        return (min(starts), max(ends)) if starts and ends else None

    @property
    def makespan_s(self) -> float:
        """First `started` → last `finished`, seconds."""
        window = self.window_ms()
        return (window[1] - window[0]) / 1000 if window else float("nan")

    def count(self, status: str) -> int:
        """Forks that ended with this status."""
        return sum(f.status == status for f in self.forks)

    @property
    def failed(self) -> int:
        """Forks that did not succeed (failed, cancelled, or not finished)."""
        return len(self.forks) - self.count("succeeded")

    def finish_s(self, group: str) -> list[float]:
        """A group's launch → finished, seconds, of each finished fork."""
        return sorted((f.finished_ms - f.launched_ms) / 1000 for f in self.forks if f.group == group and f.finished_ms)


def case_env(case: Case, redis_url: str, stub_port: int, slots: int) -> dict[str, str]:
    """The workers' environment: the openai provider at the stub, threads enough, the case's admission settings."""
    env = worker_env(redis_url, Path(os.devnull))
    del env["FORKQ_SCRIPT"]
    env |= {
        "FORKQ_PROVIDER": "openai",
        "FORKQ_OPENAI_BASE_URL": f"http://127.0.0.1:{stub_port}/v1",
        "FORKQ_OPENAI_API_KEY": "EMPTY",
        "FORKQ_WORKER_CONCURRENCY": str(slots),
        **dict(case.env),
    }
    if case.limits is not None:
        env["FORKQ_MODEL_LIMITS"] = json.dumps(case.limits)
    return env


def worker_argv(name: str, slots: int) -> list[str]:
    """One forkq worker, threads pool."""
    argv = [sys.executable, "-m", "workers.cli", "worker", "--pool", "threads", "--concurrency", str(slots)]
    return [*argv, "--hostname", f"{name}@%h", "--loglevel", "WARNING"]


class Launcher:
    """Launches a group's forks: one parent snapshot per session (siblings share its seed)."""

    def __init__(self, client: ForkClient, parent: ParentSnapshot) -> None:
        self.client = client
        self.parent = parent
        self.parents: dict[str, ParentSnapshot] = {}

    def snapshot(self, session: str) -> ParentSnapshot:
        """The parent of a session (a new one, with a new session id, for PER_FORK)."""
        if session == PER_FORK:
            return self.parent.model_copy(update={"session_id": f"solo-{new_fork_id()}"})
        if session not in self.parents:
            self.parents[session] = self.parent.model_copy(update={"session_id": session})
        return self.parents[session]

    def launch(self, group: Group) -> list[Fork]:
        """Launch every fork of a group; each with its launch time."""
        forks = []
        for _ in range(group.forks):
            fid = new_fork_id()
            at = time.time() * 1000
            self.client.launch(self.snapshot(group.session), PARAMS, fork_id=fid)
            forks.append(Fork(fid, group.name, at))
        return forks


def launch_groups(redis_url: str, parent: ParentSnapshot, groups: Sequence[Group]) -> tuple[list[Fork], float]:
    """Each group from its own thread and client, `delay_s` after the first began (whether or not the groups
    before it are all launched yet); the forks, and when the last delayed group began (s)."""
    began = time.monotonic()
    offsets: list[float] = []

    def launch(group: Group) -> list[Fork]:
        wait = began + group.delay_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # the scenario's pause between the sessions, not a synchronization
        if group.delay_s:
            offsets.append(time.monotonic() - began)
        with ForkClient(Settings(redis_url=redis_url, queue=QUEUE)) as client:
            forks = Launcher(client, parent).launch(group)
        print(f"  {group.name}: {group.forks} forks launched by {time.monotonic() - began:.1f} s", flush=True)
        return forks

    with ThreadPoolExecutor(len(groups)) as pool:
        launched = list(pool.map(launch, groups))
    return [f for forks in launched for f in forks], max(offsets, default=float("nan"))


def wait_all(
    client: ForkClient, r: redis.Redis, forks: Sequence[Fork], workers: Sequence[Proc], timeout_s: float
) -> str:
    """Until every fork has a result; '' when all do, else why the wait ended."""
    keys = [client.store.keys.result(f.fork_id) for f in forks]
    deadline, report = time.monotonic() + timeout_s, time.monotonic() + 30
    while True:
        done = sum(int(r.exists(*keys[i : i + 1000])) for i in range(0, len(keys), 1000))
        if done == len(keys):
            return ""
        dead = [w.name for w in workers if w.process.poll() is not None]
        if dead:
            return f"worker {dead} exited ({done}/{len(keys)} done)"
        if time.monotonic() > deadline:
            return f"timed out after {timeout_s:.0f} s ({done}/{len(keys)} done)"
        if time.monotonic() > report:
            print(f"  … {done}/{len(keys)} forks done", flush=True)
            report = time.monotonic() + 30
        time.sleep(POLL_S)


def read_forks(client: ForkClient, forks: Sequence[Fork]) -> None:
    """Each fork's status, error, first `started` and last `finished` (event times, Redis clock)."""
    for fork in forks:
        state = client.store.state(fork.fork_id)
        fork.status = state.status.value
        fork.error = (state.error or "")[:160]
        events: list[StreamEvent] = []
        after = "0-0"
        while batch := client.store.events(fork.fork_id, after=after, count=1000):
            events += batch
            after = batch[-1].id
        starts = [e.at_ms for e in events if e.type == "started"]
        ends = [e.at_ms for e in events if e.type == "finished"]
        fork.started_ms = min(starts) if starts else None
        fork.finished_ms = max(ends) if ends else None
        call_at: float | None = None
        for event in events:
            if event.type == "model_call":
                call_at = event.at_ms
                fork.first_call_ms = fork.first_call_ms or event.at_ms
            elif event.type == "step" and call_at is not None:
                fork.in_calls_s += (event.at_ms - call_at) / 1000
                call_at = None
            fork.waits += event.type == "model_wait"


@contextmanager
def servers(case: Case, plan: Plan, logdir: Path) -> Iterator[tuple[RedisServer, int, Fleet]]:
    """A private Redis, the stub on a free port, and the fleet that will hold the workers."""
    extra = ["--maxclients", str(max(10_000, 4 * case.forks + 1_000))]
    with RedisServer(extra_args=extra) as server, fleet(logdir) as group:
        port = _free_tcp_port()
        argv = openai_stub.command(
            port, k=case.k, latency_s=case.latency_s, calls=CALLS, retry_after_s=plan.retry_after_s
        )
        stub = group.start("stub", argv, worker_env(server.url, Path(os.devnull)))

        def exited(proc: Proc = stub) -> str | None:
            code = proc.process.poll()
            return None if code is None else f"exit {code}:\n{proc.tail()}"

        openai_stub.wait_answering(port, exited)
        yield server, port, group


def run_case(case: Case, plan: Plan, parent: ParentSnapshot, tmp: Path) -> Outcome:
    """Redis, stub, two workers, the sweeper; the forks launched, waited for, read; everything stopped."""
    out = Outcome(case)
    logdir = tmp / f"{case.part}-{case.label.replace(' ', '-').replace(',', '')}"
    logdir.mkdir()
    slots = math.ceil(case.forks / len(WORKERS)) + 16
    with ExitStack() as stack:
        server, port, group = stack.enter_context(servers(case, plan, logdir))
        r = stack.enter_context(redis.Redis.from_url(server.url))
        client = stack.enter_context(ForkClient(Settings(redis_url=server.url, queue=QUEUE), redis_client=r))
        env = case_env(case, server.url, port, slots)
        if case.queued:
            out.forks, _ = launch_groups(server.url, parent, case.groups)
        group.start("sweeper", [sys.executable, "-m", "workers.cli", "sweep"], env)
        before = RedisCounters.read(r)
        workers = [group.start(name, worker_argv(name, slots), env) for name in WORKERS]
        samplers = [Sampler(w, redis.Redis.from_url(server.url)) for w in workers]
        for sampler in samplers:
            sampler.start()
        if not case.queued:
            wait_ready(make_app(Settings(redis_url=server.url, queue=QUEUE)), workers)
            out.forks, out.b_offset_s = launch_groups(server.url, parent, case.groups)
        out.note = wait_all(client, r, out.forks, workers, 180 + 10 * case.ideal_s)
        after = RedisCounters.read(r)
        for sampler in samplers:
            sampler.stop()
        out.stub = openai_stub.stats(port)
        out.redis_calls, out.redis_cpu_s = after.minus(before)
        out.redis_round_trips = after.round_trips(before)
        group.stop_all()
        read_forks(client, out.forks)
        window = out.window_ms()
        if window is not None:
            out.worker_cpu_s = sum(s.cpu_at(window[1]) - s.cpu_at(window[0]) for s in samplers) / 1e9
        if out.note:
            print(f"  NOTE {out.note}; {workers[0].name} log ends:\n{workers[0].tail(1500)}", flush=True)
    return out


# ── report ────────────────────────────────────────────────────────────────────────────────────


def ok(passed: bool) -> str:
    """The target's verdict."""
    return "ok" if passed else "MISS"


def print_storm(rows: Sequence[Outcome]) -> None:
    """The storm's table."""
    print("\nstorm: forks, K, L; requests, 429s; makespan against the ideal (calls × L / K); failures")
    head = ("case", "forks", "K", "L s", "requests", "200", "429", "429 share", "stub max at once", "makespan s")
    print(" | ".join((*head, "ideal s", "× ideal", "failed", "target (429 ≤ 0.1%, ≤ 1.15×)")))
    for o in rows:
        c = o.case
        ratio = o.makespan_s / c.ideal_s
        verdict = "—"
        if c.limits is not None:
            passed = o.throttled_share <= TARGET_THROTTLED and ratio <= TARGET_MAKESPAN and not o.failed
            verdict = ok(passed)
        cells = (c.label, f"{c.forks:,}", str(c.k), f"{c.latency_s:g}", f"{o.requests:,}", f"{o.served:,}")
        cells += (f"{o.throttled:,}", f"{o.throttled_share:.2%}", str(o.stub.get("max_in_flight", "")))
        cells += (f"{o.makespan_s:.1f}", f"{c.ideal_s:.1f}", f"{ratio:.3f}", f"{o.failed:,}", verdict)
        print(" | ".join(cells))


def predicted_s(case: Case, group: Group) -> float:
    """A group's time to finish under fair share: its forks hold min(n, K / sessions) slots at once."""
    sessions = len(case.groups)
    share = max(1, min(group.forks, case.k // sessions))
    return CALLS * case.latency_s * math.ceil(group.forks / share)


def print_fairness(rows: Sequence[Outcome]) -> None:
    """The fairness table."""
    print("\nfairness: A's forks launched, B's some seconds later; B's launch → finished against its fair share")
    head = ("case", "A forks", "B forks", "B at s", "K", "L s", "B p50 s", "B max s", "fair share s")
    print(" | ".join((*head, "B p50 × fair", "A makespan s", "429", "failed", "target (≤ 1.5×)")))
    for o in rows:
        c = o.case
        a, b = c.groups
        times = o.finish_s(b.name)
        p50 = statistics.median(times) if times else float("nan")
        fair = predicted_s(c, b)
        window = o.window_ms(a.name)
        a_span = (window[1] - window[0]) / 1000 if window else float("nan")
        verdict = ok(p50 / fair <= TARGET_FAIRNESS) if c.label == "fair share" else "—"
        cells = (c.label, f"{a.forks}", f"{b.forks}", f"{o.b_offset_s:.1f}", str(c.k), f"{c.latency_s:g}")
        cells += (f"{p50:.2f}", f"{max(times, default=float('nan')):.2f}", f"{fair:.2f}", f"{p50 / fair:.2f}")
        cells += (f"{a_span:.1f}", f"{o.throttled:,}", f"{o.failed}", verdict)
        print(" | ".join(cells))


def print_cost(rows: Sequence[Outcome]) -> None:
    """The cost table, then what the limits add per model call, by Redis command."""
    print("\ncost: an endpoint with room for every request (no 429, no wait); per model call answered")
    print(
        "case | forks | calls | Redis round trips/call | Redis cmd/call | EVALSHA+EVAL/call | Redis CPU µs/call "
        "| worker CPU ms/call | failed"
    )
    for o in rows:
        calls = max(o.served, 1)
        scripts = o.redis_calls["evalsha"] + o.redis_calls["eval"] + o.redis_calls["fcall"]
        cells = (o.case.label, f"{o.case.forks:,}", f"{o.served:,}", f"{o.redis_round_trips / calls:.2f}")
        cells += (f"{sum(o.redis_calls.values()) / calls:.2f}", f"{scripts / calls:.2f}")
        cells += (f"{o.redis_cpu_s * 1e6 / calls:.0f}", f"{o.worker_cpu_s * 1e3 / calls:.2f}")
        print(" | ".join((*cells, f"{o.failed}")))
    by = {o.case.label: o for o in rows}
    if "limits" in by and "no limits" in by:
        with_, without = by["limits"], by["no limits"]
        added = with_.redis_round_trips / max(with_.served, 1) - without.redis_round_trips / max(without.served, 1)
        verdict = "ok" if added <= 1.05 else "MISS"  # 5% for the benchmark's own polls, which vary with the run
        print(f"limits − no limits: {added:+.2f} Redis round trips per model call (target ≤ 1): {verdict}")
        names = set(with_.redis_calls) | set(without.redis_calls)
        delta = {
            n: with_.redis_calls[n] / max(with_.served, 1) - without.redis_calls[n] / max(without.served, 1)
            for n in names
        }
        shown = ", ".join(f"{n} {d:+.2f}" for n, d in sorted(delta.items(), key=lambda x: -abs(x[1])) if abs(d) >= 0.05)
        print(f"limits − no limits, Redis commands per model call by name (|Δ| ≥ 0.05): {shown or 'none'}")


def phases(o: Outcome, group: str) -> str:
    """Where a group's forks spent their time, medians: launch → started → first model call, inside the model
    calls (admission wait + the call; the stub's latency alone is 3 × L), and the rest (tools, records)."""
    forks = [f for f in o.forks if f.group == group and f.started_ms and f.finished_ms and f.first_call_ms]
    if not forks:
        return f"{group}: no fork finished"
    med = statistics.median
    dispatch = med([(f.started_ms or 0) - f.launched_ms for f in forks]) / 1000
    setup = med([(f.first_call_ms or 0) - (f.started_ms or 0) for f in forks]) / 1000
    calls = med([f.in_calls_s for f in forks])
    total = med([((f.finished_ms or 0) - f.launched_ms) / 1000 for f in forks])
    waited = sum(f.waits > 0 for f in forks)
    return (
        f"{group}: median launch → finished {total:.2f} s = launch → started {dispatch:.2f} s, started → first "
        f"model call {setup:.2f} s, in the {CALLS} model calls {calls:.2f} s ({CALLS} × L = "
        f"{CALLS * o.case.latency_s:g} s), rest; {waited}/{len(forks)} forks had a call queued"
    )


def print_details(rows: Sequence[Outcome]) -> None:
    """Errors, the stub's connections, notes."""
    print()
    for o in rows:
        errors = Counter(f.error or f.status for f in o.forks if f.status != "succeeded")
        line = f"{o.case.part} / {o.case.label}: stub connections at once {o.stub.get('max_open_connections')}"
        line += f", Redis {sum(o.redis_calls.values()):,} commands, worker CPU {o.worker_cpu_s:.1f} s"
        print(line + (f"; NOTE {o.note}" if o.note else ""))
        for error, n in errors.most_common(3):
            print(f"  {n} × {error}")
        throttled = {k: v["throttled"] for k, v in o.stub.get("by_key", {}).items() if v.get("throttled")}
        if throttled and len(throttled) <= 5:
            print(f"  429s by parent session: {throttled}")
        served, first, last = o.served, o.stub.get("first_request_at"), o.stub.get("last_answer_at")
        if served and first and last and last > first:
            busy = served * o.case.latency_s / (last - first)
            print(
                f"  the stub: first request → last answer {last - first:.1f} s, {busy:.1f} requests in service on "
                f"average = {busy / o.case.k:.0%} of K"
            )
        top = ", ".join(f"{n} {c / max(served, 1):.1f}" for n, c in o.redis_calls.most_common(6))
        print(f"  Redis per model call: {sum(o.redis_calls.values()) / max(served, 1):.1f} commands ({top}), "
              f"{o.redis_cpu_s * 1e6 / max(served, 1):.0f} µs CPU")  # fmt: skip
        for group in o.case.groups:
            print("  " + phases(o, group.name))


def run(plan: Plan, parts: Sequence[str]) -> list[Outcome]:
    """Every case in turn, each on its own Redis, stub and workers."""
    parent = parse_parent_snapshot(json.loads(EXAMPLE_PARENT.read_text()))
    rows = []
    with tempfile.TemporaryDirectory(prefix="forkq-admission-") as tmpdir:
        tmp = Path(tmpdir)
        cwd = tmp / "project"
        (cwd / "src").mkdir(parents=True)
        (cwd / "README.md").write_text("forkq admission bench\n")
        parent = parent.model_copy(update={"approval_mode": "yolo", "cwd": str(cwd), "model": MODEL})
        for case in cases(plan, parts):
            print(f"{case.part} / {case.label}: {case.forks} forks, K={case.k}, L={case.latency_s:g} s", flush=True)
            started = time.monotonic()
            try:
                rows.append(run_case(case, plan, parent, tmp))
            except Exception as exc:  # one case failing must not lose the others
                print(f"  {type(exc).__name__}: {exc}", flush=True)
                rows.append(Outcome(case, note=repr(exc)[:300]))
            print(f"  done in {time.monotonic() - started:.0f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller parts: a smoke run of about 2 minutes")
    parser.add_argument("--parts", default="storm,fairness,cost", help="comma-separated (default all three)")
    parser.add_argument("--latency-s", type=float, default=None, help="L of the storm and fairness parts (default 1 s)")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"storm", "fairness", "cost"}
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from storm, fairness, cost")
    plan = QUICK if args.quick else FULL
    if args.latency_s is not None:
        if not args.latency_s > 0:
            parser.error(f"--latency-s must be a positive number of seconds, got {args.latency_s}")
        plan = replace(plan, latency_s=args.latency_s)
    began = time.monotonic()
    print(
        f"forkq admission: {os.cpu_count()} CPUs, Python {platform.python_version()}, Celery {celery.__version__}, "
        f"FORKQ_MODEL_LIMITS {'read' if limits_supported() else 'NOT in this tree: runs without limits only'}",
        flush=True,
    )
    rows = run(plan, parts)
    print("\n" + "=" * 100)
    if storm := [o for o in rows if o.case.part == "storm"]:
        print_storm(storm)
    if fair := [o for o in rows if o.case.part == "fairness"]:
        print_fairness(fair)
    if cost := [o for o in rows if o.case.part == "cost"]:
        print_cost(cost)
    print_details(rows)
    print("\nload average (1, 5, 15 min) at the end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(f"total {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()

"""Benchmark: dispatching forks through Celery and Redis, each figure beside a baseline from the same run.

Run: `python bench/dispatch.py [--quick]`. Starts a private redis-server (TCP) and six worker
processes on it: two forkq workers (`celery -A workers.app`), two bare-Celery workers
(`celery -A bench.bare_app`) and two bare-Celery workers with forkq's broker connection
(`celery -A bench.bare_app:conn_app`), all with the threads pool and forkq's broker settings. Measures:

1. latency: launch → the fork's first model call has answered (scripted, delay 0; seen by the
   caller on the fork's event stream), vs send → a bare no-op task has run (seen by BLPOP);
2. throughput: N one-step forks vs N bare no-op tasks, enqueued at once, until all are done; in
   rounds (bare, bare with forkq's connection, forks, in a rotating order) so that a noisy machine's
   drift hits all three alike, the ratio being the median of the rounds' ratios;
3. Redis memory of 100 `all` forks of one ~5 MB parent (launch only) vs one copy of its history, and of
   100 parents × 10 `all` forks each (~0.5 MB parents, launched interleaved: one fork of each parent in
   turn, ten times) vs one copy of each parent's history;
4. the inline-seed trade-off behind FORKQ_INLINE_SEED_MAX_BYTES (inline vs read from Redis).

`--memory` measures only the two memory figures (no workers; they do not depend on the machine's load).
`--cost` measures only what a job costs in CPU (caller, worker, Redis), forks against bare no-ops, with one
worker of each kind and larger bursts than the throughput figure's: the figure to compare two trees by.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/dispatch.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import msgpack  # noqa: E402
import redis  # noqa: E402

from bench.bare_app import BARE_QUEUE, CONN_QUEUE, NOOP_TASK, make_bare_app  # noqa: E402
from bench.history import make_history  # noqa: E402
from bench.procs import Proc as Worker  # noqa: E402
from bench.procs import wait_ready, worker_env, workers  # noqa: E402
from broker_config.settings import Settings  # noqa: E402
from workers.client import ForkClient, new_fork_id  # noqa: E402
from workers.demo.redis_server import RedisServer  # noqa: E402
from workers.history.messages import parse_history  # noqa: E402
from workers.history.selection import build_fork_seed  # noqa: E402
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot  # noqa: E402
from workers.records.fork import split_seed  # noqa: E402

EXAMPLE_PARENT = ROOT / "workers" / "examples" / "parent.json"
PARAMS = {"description": "bench fork", "prompt": "Review the lease code.", "subagent_type": "fork"}
CONCURRENCY = 32  # forkq's default FORKQ_WORKER_CONCURRENCY, for both worker kinds
FORK_QUEUE = "forks"
IDLE_QUEUE = "bench-idle"  # no worker consumes it: jobs stay in the broker to be measured
IDLE_NS = "bench-idle"
SEED_TARGETS = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 3 << 20)  # under the 4 MiB job cap
HUGE = 1 << 40
TIMEOUT_S = 60.0
SETTLE_S = 1.0  # idle time before each throughput burst
WAIT_BLOCK = 32  # keys per EXISTS while a burst's end is awaited
T = TypeVar("T")
# the worker's first event at the first model call: 'model_call' (published as the call starts); 'step'
# (published once it answered) only as a fallback
FIRST_CALL_EVENTS = ("model_call", "step")


@dataclass(frozen=True)
class Plan:
    """How much to measure: the full run, or `--quick`."""

    latency_n: int
    throughput_n: int
    rounds: int
    memory_forks: int
    memory_messages: int
    inline_k: int
    warmup: int
    family_parents: int = 100
    family_forks: int = 10
    family_messages: int = 125


FULL = Plan(latency_n=300, throughput_n=500, rounds=5, memory_forks=100, memory_messages=1250, inline_k=25, warmup=20)
QUICK = Plan(latency_n=200, throughput_n=200, rounds=2, memory_forks=100, memory_messages=1250, inline_k=3, warmup=5)


# ── measurements ──────────────────────────────────────────────────────────────────────────────


def done_key(token: str) -> str:
    """The list a bare no-op task pushes to when it has run."""
    return f"bench:bare:done:{token}"


def bare_round_trip(app: celery.Celery, r: redis.Redis) -> float:
    """send_task → a worker runs the no-op → the caller's BLPOP returns; seconds."""
    key = done_key(uuid.uuid4().hex)
    start = time.perf_counter()
    app.send_task(NOOP_TASK, args=[key])
    if r.blpop([key], timeout=TIMEOUT_S) is None:
        raise RuntimeError(f"bare task {key} did not run within {TIMEOUT_S:.0f} s")
    return time.perf_counter() - start


@dataclass(frozen=True)
class ForkSample:
    """One launch: s to `launch()` returning and to the first model call; ms to 'started' (Redis clock)."""

    fork_id: str
    launch_s: float
    first_call_s: float
    started_ms: int
    event: str


def fork_round_trip(client: ForkClient, parent: ParentSnapshot) -> ForkSample:
    """launch() → the caller reads the worker's first-model-call event (XREAD BLOCK on the fork's stream)."""
    fid = new_fork_id()
    wall = time.time()
    start = time.perf_counter()
    client.launch(parent, PARAMS, fork_id=fid)
    launched = time.perf_counter()
    after, started_ms = "0-0", -1
    while True:
        events = client.store.events(fid, after=after, block_ms=int(TIMEOUT_S * 1000))
        if not events:
            raise RuntimeError(f"fork {fid}: no model call within {TIMEOUT_S:.0f} s")
        for event in events:
            after = event.id
            if event.type == "started":
                started_ms = event.at_ms - int(wall * 1000)
            elif event.type in FIRST_CALL_EVENTS:
                return ForkSample(fid, launched - start, time.perf_counter() - start, started_ms, event.type)
            elif event.type == "finished":
                raise RuntimeError(f"fork {fid} ended before a model call: {event.wire_data()}")


def pct(values: Sequence[float], p: int) -> float:
    """The p-th percentile (p50 is the median)."""
    return statistics.median(values) if p == 50 else statistics.quantiles(values, n=100)[p - 1]


def wait_all(r: redis.Redis, keys: Sequence[str]) -> None:
    """Wait until every key in `keys` exists: EXISTS over the next `WAIT_BLOCK` keys not yet seen, every 2 ms.

    Jobs end in about the order they were sent, so a cursor passes each block once it is all done. An EXISTS
    over every key at each poll (as before) cost the machine more the longer a burst ran, taken from the
    workers being measured and more from the slower kind: 27 µs of Redis CPU per fork in 1,000-fork bursts,
    and the caller's packing of every key at each poll.
    """
    deadline = time.monotonic() + TIMEOUT_S
    done = 0
    while done < len(keys):
        block = keys[done : done + WAIT_BLOCK]
        if r.exists(*block) == len(block):
            done += len(block)
            continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {done + r.exists(*block)} of {len(keys)} jobs seen done after {TIMEOUT_S:.0f} s")
        time.sleep(0.002)


@dataclass(frozen=True)
class Burst:
    """N jobs enqueued at once: enqueue and total seconds; caller CPU, worker CPU, Redis commands per job."""

    n: int
    enqueue_s: float
    total_s: float
    caller_cpu_ms: float
    worker_cpu_ms: float
    redis_cmds: float
    redis_cpu_ms: float

    @property
    def rate(self) -> float:
        """Jobs per second, first enqueue to last completion."""
        return self.n / self.total_s

    @property
    def cpu_ms(self) -> float:
        """CPU per job of the caller, the workers and Redis together (ms)."""
        return self.caller_cpu_ms + self.worker_cpu_ms + self.redis_cpu_ms


def settle(seconds: float = SETTLE_S) -> None:
    """Let the previous burst's tail (acks, event flushes) end and collect the caller's garbage, so that
    each burst starts from an idle machine whichever kind ran before it."""
    gc.collect()
    time.sleep(seconds)


def burst(n: int, group: Sequence[Worker], enqueue: Callable[[], list[str]], r: redis.Redis) -> Burst:
    """Run `enqueue` (which returns the keys that appear when each job is done) and wait for them all."""
    settle()
    cmds0, rcpu0 = redis_calls(r), redis_cpu_s(r)
    cpu0, wcpu0 = time.process_time(), sum(w.cpu_ns() for w in group)
    start = time.perf_counter()
    keys = enqueue()
    enqueued, caller_cpu = time.perf_counter(), time.process_time() - cpu0
    wait_all(r, keys)
    end = time.perf_counter()
    worker_cpu = (sum(w.cpu_ns() for w in group) - wcpu0) / 1e6
    cmds, rcpu = redis_calls(r) - cmds0, redis_cpu_s(r) - rcpu0
    return Burst(n, enqueued - start, end - start, caller_cpu * 1e3 / n, worker_cpu / n, cmds / n, rcpu * 1e3 / n)


def redis_calls(r: redis.Redis) -> int:
    """Commands Redis has run so far (INFO commandstats), minus this benchmark's own EXISTS polls and INFOs."""
    stats = r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in ("cmdstat_exists", "cmdstat_info"))


def redis_cpu_s(r: redis.Redis) -> float:
    """CPU seconds redis-server has used so far (INFO cpu, user + system, main thread included)."""
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def fork_burst(client: ForkClient, parent: ParentSnapshot, n: int, group: Sequence[Worker]) -> Burst:
    """N one-step forks: launch them all, then wait for every result record."""
    fids = [new_fork_id() for _ in range(n)]

    def enqueue() -> list[str]:
        for fid in fids:
            client.launch(parent, PARAMS, fork_id=fid)
        return [client.store.keys.result(fid) for fid in fids]

    result = burst(n, group, enqueue, client.redis)
    statuses = {client.store.state(fid).status.value for fid in fids}
    if statuses != {"succeeded"}:
        raise RuntimeError(f"throughput forks ended as {statuses}, expected all succeeded")
    return result


def bare_burst(app: celery.Celery, r: redis.Redis, n: int, group: Sequence[Worker]) -> Burst:
    """N bare no-op tasks: send them all, then wait for every done key."""
    keys = [done_key(uuid.uuid4().hex) for _ in range(n)]

    def enqueue() -> list[str]:
        for key in keys:
            app.send_task(NOOP_TASK, args=[key])
        return keys

    result = burst(n, group, enqueue, r)
    r.delete(*keys)
    return result


def memory_now(r: redis.Redis) -> int:
    """INFO memory used_memory."""
    return int(r.info("memory")["used_memory"])


def key_bytes(r: redis.Redis, patterns: Sequence[str]) -> dict[str, tuple[int, int]]:
    """MEMORY USAGE of the keys matching `patterns`, by kind (the key's last part): kind → (keys, bytes)."""
    kinds: dict[str, tuple[int, int]] = {}
    for key in {k.decode() for p in patterns for k in r.scan_iter(match=p, count=1000)}:
        kind = "chunk" if ":chunk:" in key else key.rsplit(":", 1)[-1] if ":" in key else "job queue"
        count, size = kinds.get(kind, (0, 0))
        kinds[kind] = (count + 1, size + int(r.memory_usage(key, samples=0) or 0))
    return kinds


@contextmanager
def writer(url: str) -> Iterator[redis.Redis]:
    """A connection for big writes, closed before memory is read: Redis frees its grown query buffer then."""
    client = redis.Redis.from_url(url)
    try:
        yield client
    finally:
        client.connection_pool.disconnect()
        time.sleep(0.05)


def drop(r: redis.Redis, patterns: Sequence[str]) -> None:
    """Delete every key matching `patterns` (this benchmark's own namespaces only)."""
    for pattern in patterns:
        for batch in _batches(list(r.scan_iter(match=pattern, count=1000)), 500):
            r.delete(*batch)


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# ── the four figures ──────────────────────────────────────────────────────────────────────────


@dataclass
class Bench:
    """Everything a measurement needs: Redis, clients, apps and worker groups."""

    url: str
    r: redis.Redis
    plan: Plan
    bare_app: celery.Celery
    conn_app: celery.Celery  # the bare app with forkq's broker connection
    fork_client: ForkClient
    parent: ParentSnapshot
    fork_workers: list[Worker]
    bare_workers: list[Worker]
    conn_workers: list[Worker]

    def client(self, **overrides: Any) -> ForkClient:
        """A ForkClient on this Redis with some settings changed."""
        return ForkClient(Settings(redis_url=self.url, **overrides), redis_client=self.r)


def measure_latency(b: Bench) -> tuple[list[float], list[ForkSample]]:
    """Alternate bare round trips and fork launches, one at a time, after a warm-up."""
    bare: list[float] = []
    forks: list[ForkSample] = []
    for i in range(b.plan.warmup + b.plan.latency_n):
        bare_s = bare_round_trip(b.bare_app, b.r)
        fork = fork_round_trip(b.fork_client, b.parent)
        if i >= b.plan.warmup:
            bare.append(bare_s)
            forks.append(fork)
    return bare, forks


@dataclass(frozen=True)
class Throughput:
    """Rounds of three bursts: bare no-ops (stock Celery), bare no-ops with forkq's connection, forks."""

    bare: list[Burst]
    conn: list[Burst]
    forks: list[Burst]

    def ratios(self, base: Sequence[Burst]) -> list[float]:
        """Each round's fork rate over the baseline's rate in the same round."""
        return [f.rate / b.rate for f, b in zip(self.forks, base, strict=True)]

    def ratio(self, base: Sequence[Burst]) -> float:
        """The median of the rounds' ratios."""
        return statistics.median(self.ratios(base))

    def median(self, bursts: Sequence[Burst]) -> Burst:
        """The burst of the median rate (the lower middle one for an even count)."""
        return sorted(bursts, key=lambda x: x.rate)[(len(bursts) - 1) // 2]


def measure_throughput(b: Bench) -> Throughput:
    """A small warm burst of each kind, then rounds of the three bursts, the order rotating each round."""
    n = b.plan.throughput_n
    kinds: list[Callable[[int], Burst]] = [
        lambda k: bare_burst(b.bare_app, b.r, k, b.bare_workers),
        lambda k: bare_burst(b.conn_app, b.r, k, b.conn_workers),
        lambda k: fork_burst(b.fork_client, b.parent, k, b.fork_workers),
    ]
    for kind in kinds:
        kind(50)
    results: list[list[Burst]] = [[], [], []]
    for r in range(b.plan.rounds):
        for i in (r % 3, (r + 1) % 3, (r + 2) % 3):
            results[i].append(kinds[i](n))
    return Throughput(*results)


@dataclass(frozen=True)
class Memory:
    """Redis memory of N forks of one parent vs one copy of its history, two ways."""

    history_bytes: int
    forks: int
    fork_delta: int
    fork_kinds: dict[str, tuple[int, int]]
    copy_delta: int
    copy_key_bytes: int
    launch_ms: float

    @property
    def ratio(self) -> float:
        """The forks' memory over one copy's."""
        return self.fork_delta / self.copy_delta


def measure_memory(b: Bench) -> Memory:
    """Launch N `all` forks of a ~5 MB parent into an unconsumed queue; then SET one copy of its history."""
    raw = make_history(b.plan.memory_messages)
    blob = msgpack.packb(raw)
    parent = b.parent.model_copy(update={"history": parse_history(raw)})
    ns, queue = "bench-mem", "bench-mem-idle"
    patterns = [f"{ns}:*", queue]
    with writer(b.url) as w:
        ForkClient(Settings(redis_url=b.url, namespace=ns, queue=queue), redis_client=w).launch(parent, PARAMS)
    drop(b.r, patterns)  # the warm-up above loaded the Lua scripts and declared the queue
    before = memory_now(b.r)
    start = time.perf_counter()
    with writer(b.url) as w:
        client = ForkClient(Settings(redis_url=b.url, namespace=ns, queue=queue), redis_client=w)
        for _ in range(b.plan.memory_forks):
            client.launch(parent, PARAMS)
        launch_ms = (time.perf_counter() - start) * 1e3 / b.plan.memory_forks
    fork_delta = memory_now(b.r) - before
    fork_kinds = key_bytes(b.r, patterns)
    drop(b.r, patterns)
    copy_delta, copy_key_bytes = one_copy(b, blob)
    return Memory(len(blob), b.plan.memory_forks, fork_delta, fork_kinds, copy_delta, copy_key_bytes, launch_ms)


def measure_family_memory(b: Bench) -> Memory:
    """Launch `family_forks` `all` forks of each of `family_parents` parents, one fork of each parent in turn
    (siblings share chunks, but never arrive in a row), into an unconsumed queue; then SET one copy of each
    parent's history."""
    plan = b.plan
    raws = [make_history(plan.family_messages, seed=100 + i) for i in range(plan.family_parents)]
    blobs = [msgpack.packb(raw) for raw in raws]
    parents = [
        b.parent.model_copy(update={"history": parse_history(raw), "session_id": f"bench-family-{i}"})
        for i, raw in enumerate(raws)
    ]
    ns, queue = "bench-family", "bench-family-idle"
    patterns = [f"{ns}:*", queue]
    settings = Settings(redis_url=b.url, namespace=ns, queue=queue)
    with writer(b.url) as w:
        ForkClient(settings, redis_client=w).launch(b.parent, PARAMS)
    drop(b.r, patterns)  # the warm-up above loaded the Lua scripts and declared the queue
    before = memory_now(b.r)
    start = time.perf_counter()
    with writer(b.url) as w:
        client = ForkClient(settings, redis_client=w)
        for _ in range(plan.family_forks):
            for parent in parents:
                client.launch(parent, PARAMS)
    forks = plan.family_parents * plan.family_forks
    launch_ms = (time.perf_counter() - start) * 1e3 / forks
    fork_delta = memory_now(b.r) - before
    fork_kinds = key_bytes(b.r, patterns)
    drop(b.r, patterns)
    before = memory_now(b.r)
    with writer(b.url) as w:
        for batch in _batches(list(enumerate(blobs)), 10):
            w.mset({f"bench:family-copy:{i}": blob for i, blob in batch})
    copy_delta = memory_now(b.r) - before
    copy_key_bytes = sum(int(b.r.memory_usage(f"bench:family-copy:{i}", samples=0) or 0) for i in range(len(blobs)))
    drop(b.r, ["bench:family-copy:*"])
    return Memory(sum(map(len, blobs)), forks, fork_delta, fork_kinds, copy_delta, copy_key_bytes, launch_ms)


def one_copy(b: Bench, blob: bytes) -> tuple[int, int]:
    """(used_memory delta, MEMORY USAGE) of one SET of `blob`; the smallest of three tries, because Redis
    sometimes keeps a grown query buffer as the value (5.0 or 5.5 MB for the same 5.0 MB blob)."""
    tries = []
    for _ in range(3):
        before = memory_now(b.r)
        with writer(b.url) as w:
            w.set("bench:one-copy", blob)
        tries.append((memory_now(b.r) - before, int(b.r.memory_usage("bench:one-copy", samples=0) or 0)))
        b.r.delete("bench:one-copy")
    return min(tries)


def seed_bytes(raw: list[dict[str, Any]]) -> int:
    """Bytes of an `all` fork's seed chunks for this parent history."""
    seed = build_fork_seed(parse_history(raw), fork_turns=None, directive=PARAMS["prompt"])
    return sum(map(len, split_seed(seed.initial_messages)))


def history_for_seed(target: int) -> tuple[list[dict[str, Any]], int]:
    """A make_history() parent whose `all` seed is as close to `target` bytes as message counts allow."""
    low, high = 4, 4000
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if seed_bytes(make_history(mid)) < target else (low, mid)
    candidates = [make_history(n) for n in (low, high)]
    best = min(candidates, key=lambda raw: abs(seed_bytes(raw) - target))
    return best, seed_bytes(best)


@dataclass(frozen=True)
class InlineRow:
    """One seed size and transport: caller and worker costs per fork."""

    seed: int
    mode: str
    launch_ms: float
    first_call_ms: float
    first_call_p99_ms: float
    worker_cpu_ms: float
    broker_bytes: int


MODES = {"inline": HUGE, "redis": 0}  # inline_seed_max_bytes that forces each transport


def _one_fork(b: Bench, client: ForkClient, parent: ParentSnapshot) -> tuple[ForkSample, float]:
    """One launch, and the workers' CPU (ms) until the fork has finished."""
    cpu0 = sum(w.cpu_ns() for w in b.fork_workers)
    sample = fork_round_trip(client, parent)
    client.wait(sample.fork_id, timeout=TIMEOUT_S)
    return sample, (sum(w.cpu_ns() for w in b.fork_workers) - cpu0) / 1e6


def broker_bytes(b: Bench, parent: ParentSnapshot, limit: int) -> int:
    """MEMORY USAGE of one job in the broker (launched into a queue no worker consumes)."""
    idle = b.client(inline_seed_max_bytes=limit, namespace=IDLE_NS, queue=IDLE_QUEUE)
    for _ in range(3):
        idle.launch(parent, PARAMS)
    queued = int(b.r.memory_usage(IDLE_QUEUE, samples=0) or 0) // 3
    drop(b.r, [f"{IDLE_NS}:*", IDLE_QUEUE])
    return queued


def inline_rows(b: Bench, parent: ParentSnapshot, seed: int) -> list[InlineRow]:
    """k sequential launches per transport, alternating inline and Redis so that drift hits both alike."""
    clients = {mode: b.client(inline_seed_max_bytes=limit) for mode, limit in MODES.items()}
    runs: dict[str, list[tuple[ForkSample, float]]] = {mode: [] for mode in MODES}
    for i in range(2 + b.plan.inline_k):
        for mode, client in clients.items():
            run = _one_fork(b, client, parent)
            if i >= 2:  # the first two warm up each client's connections
                runs[mode].append(run)
    rows = []
    for mode, limit in MODES.items():
        first = [s.first_call_s * 1e3 for s, _ in runs[mode]]
        launch = statistics.median(s.launch_s * 1e3 for s, _ in runs[mode])
        cpu = statistics.median(c for _, c in runs[mode])
        rows.append(InlineRow(seed, mode, launch, pct(first, 50), pct(first, 99), cpu, broker_bytes(b, parent, limit)))
    return rows


def measure_inline(b: Bench) -> list[InlineRow]:
    """Both transports for each seed size in SEED_TARGETS."""
    rows = []
    for target in SEED_TARGETS:
        raw, size = history_for_seed(target)
        rows += inline_rows(b, b.parent.model_copy(update={"history": parse_history(raw)}), size)
    return rows


def recommend(rows: Sequence[InlineRow], slack: float = 1.1, floor_ms: float = 1.0) -> int:
    """The largest measured seed size up to which inline costs at most `slack`× (or `floor_ms` more than) the
    p50 first-call latency and the worker CPU of reading the seed from Redis; 0 when inline never keeps up."""
    by_seed: dict[int, dict[str, InlineRow]] = {}
    for row in rows:
        by_seed.setdefault(row.seed, {})[row.mode] = row

    def keeps_up(inline: float, fetched: float) -> bool:
        return inline <= max(slack * fetched, fetched + floor_ms)

    best = 0
    for seed in sorted(by_seed):
        inline, fetched = by_seed[seed]["inline"], by_seed[seed]["redis"]
        if not (
            keeps_up(inline.first_call_ms, fetched.first_call_ms)
            and keeps_up(inline.worker_cpu_ms, fetched.worker_cpu_ms)
        ):
            break
        best = seed
    return best


# ── report ────────────────────────────────────────────────────────────────────────────────────


def verdict(ratio: float, target: str) -> str:
    """`≤2× ok`, `≥0.5× MISS`, ... for a ratio against a target written as `≤N×` or `≥N×`."""
    if not target:
        return ""
    bound = float(target[1:-1])
    ok = ratio <= bound if target[0] == "≤" else ratio >= bound
    return f"{target} {'ok' if ok else 'MISS'}"


def memory_rows(mems: Sequence[Memory]) -> list[tuple[str, float, float, float, str]]:
    """The headline rows of the memory figures: 100 forks of one parent, then the interleaved families."""
    labels = [f"Redis memory, {mems[0].forks} forks (MB)", f"  {mems[1].forks} forks of 100 parents, interleaved"]
    pairs = zip(labels, mems, strict=True)
    return [(label, m.fork_delta / 1e6, m.copy_delta / 1e6, m.ratio, "≤1.1×") for label, m in pairs]


def print_rows(rows: Sequence[tuple[str, float, float, float, str]]) -> None:
    """A headline table."""
    print(f"\n{'figure':<42} {'forkq':>9} {'baseline':>9} {'ratio':>7}  target")
    for label, value, base, ratio, target in rows:
        print(f"{label:<42} {value:>9.2f} {base:>9.2f} {ratio:>6.2f}×  {verdict(ratio, target)}")


def print_report(
    b: Bench, latency: tuple[list[float], list[ForkSample]], tp: Throughput, mems: Sequence[Memory]
) -> None:
    """The headline table: each figure, its baseline from this run, the ratio and the target."""
    bare_ms = [s * 1e3 for s in latency[0]]
    first = [s.first_call_s * 1e3 for s in latency[1]]
    bare_b, conn_b, fork_b = tp.median(tp.bare), tp.median(tp.conn), tp.median(tp.forks)
    server = b.r.info("server")["redis_version"]
    print(
        f"\nforkq dispatch: {os.cpu_count()} CPUs, Python {platform.python_version()}, redis-server {server}, ", end=""
    )
    print(f"Celery {celery.__version__}; 2 forkq + 2 + 2 bare-Celery workers, threads pool, concurrency {CONCURRENCY}")
    print("load average (1, 5, 15 min) at the end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    p50, p99 = (pct(first, 50), pct(bare_ms, 50)), (pct(first, 99), pct(bare_ms, 99))
    rows = [
        ("launch → first model call, p50 (ms)", *p50, p50[0] / p50[1], "≤1.2×"),
        ("launch → first model call, p99 (ms)", *p99, p99[0] / p99[1], ""),
        (f"throughput, {fork_b.n} at once (jobs/s)", fork_b.rate, bare_b.rate, tp.ratio(tp.bare), "≥0.8×"),
        ("  vs bare Celery + forkq's connection", fork_b.rate, conn_b.rate, tp.ratio(tp.conn), ""),
    ]
    print_rows([*rows, *memory_rows(mems)])


def print_details(latency: tuple[list[float], list[ForkSample]], tp: Throughput) -> None:
    """What each figure measured, with the breakdowns that locate the time."""
    forks = latency[1]
    kinds = sorted({s.event for s in forks})
    print(f"\nlatency: {len(forks)} sequential launches of workers/examples/parent.json (all), alternating with as")
    print(f"  many bare no-ops; fork = launch() start → caller reads the '{'/'.join(kinds)}' event (XREAD BLOCK);")
    print("  bare = send_task → caller's BLPOP returns the no-op's LPUSH.")
    print(f"  fork p50: launch() returns at {pct([s.launch_s * 1e3 for s in forks], 50):.2f} ms, ", end="")
    print(f"'started' (claim; Redis clock, 1 ms steps) at {pct([s.started_ms for s in forks], 50):.0f} ms")
    rounds = " ".join(f"{r:.2f}×" for r in tp.ratios(tp.bare))
    conn = " ".join(f"{r:.2f}×" for r in tp.ratios(tp.conn))
    print(f"throughput: {len(tp.forks)} rounds, forks/bare per round {rounds}; forks/bare+connection {conn};")
    print("  the table shows each kind's median-rate round and the median of the per-round ratios")
    for name, x in (("bare", tp.median(tp.bare)), ("conn", tp.median(tp.conn)), ("forks", tp.median(tp.forks))):
        print(f"throughput {name:<5}: enqueue {x.enqueue_s:.2f} s, all done {x.total_s:.2f} s; per job: ", end="")
        print(
            f"caller CPU {x.caller_cpu_ms:.2f} ms, worker CPU {x.worker_cpu_ms:.2f} ms, "
            f"Redis CPU {x.redis_cpu_ms:.2f} ms, {x.redis_cmds:.1f} Redis commands"
        )
    print_budget(tp.median(tp.bare), tp.median(tp.forks))


def print_budget(bare: Burst, forks: Burst) -> None:
    """The CPU a job costs in all (caller, worker, Redis) and what the throughput target asks of a fork.

    With every CPU of the machine busy (the caller, the workers and Redis share them), jobs/s is about
    the CPUs over the CPU a job costs, so the ratio of the two kinds' costs predicts the throughput ratio.
    """
    bare_ms, fork_ms = bare.cpu_ms, forks.cpu_ms
    busy = fork_ms * forks.rate / 1e3
    print(f"CPU per job in all: forks {fork_ms:.2f} ms, bare {bare_ms:.2f} ms; predicted throughput ratio ", end="")
    print(f"{bare_ms / fork_ms:.2f}× (these median rounds: {forks.rate / bare.rate:.2f}×); ", end="")
    print(f"forks kept {busy:.1f} of {os.cpu_count()} CPUs busy; ", end="")
    print(f"≥0.8× asks a fork to cost ≤ {bare_ms / 0.8:.2f} ms in all")


def print_memory(mems: Sequence[Memory]) -> None:
    """What the memory figures measured, by kind of key."""
    for mem, what in zip(mems, ("one parent", "100 parents, interleaved"), strict=True):
        total = sum(size for _, size in mem.fork_kinds.values())
        print(f"memory, {what}: parent histories {mem.history_bytes / 1e6:.2f} MB as msgpack; {mem.forks} ", end="")
        print(f"launches ({mem.launch_ms:.1f} ms each); used_memory delta {mem.fork_delta / 1e6:.2f} MB ", end="")
        print(f"vs the copies' {mem.copy_delta / 1e6:.2f} MB; by MEMORY USAGE {total / 1e6:.2f} MB vs ", end="")
        print(f"{mem.copy_key_bytes / 1e6:.2f} MB ({total / mem.copy_key_bytes:.2f}×):")
        for kind, (count, size) in sorted(mem.fork_kinds.items(), key=lambda item: -item[1][1]):
            print(f"  {kind:<10} {count:>5} keys {size / 1e6:>7.3f} MB  ({size / count / 1024:>6.1f} KB each)")


def print_inline(rows: Sequence[InlineRow]) -> None:
    """The inline-seed table and the largest size where inline does not lose."""
    print("\ninline seed (FORKQ_INLINE_SEED_MAX_BYTES): seed inside the job vs read by the worker from Redis")
    head = ("seed", "mode", "launch() p50", "1st call p50", "1st call p99", "worker CPU/fork", "broker B/job")
    print("{:>8} {:<7} {:>13} {:>13} {:>13} {:>16} {:>13}".format(*head))
    for row in rows:
        print(
            f"{row.seed / 1024:>6.0f}KB {row.mode:<7} {row.launch_ms:>10.2f} ms {row.first_call_ms:>10.2f} ms "
            f"{row.first_call_p99_ms:>10.2f} ms {row.worker_cpu_ms:>13.2f} ms {row.broker_bytes:>13,}"
        )
    best = recommend(rows) / 1024
    print(f"inline keeps up with Redis (p50 first call and worker CPU within 10% or 1 ms) up to {best:.0f} KB")


# ── main ──────────────────────────────────────────────────────────────────────────────────────


def timed(name: str, phase: Callable[[Bench], T], b: Bench) -> T:
    """Run one phase and say how long it took."""
    start = time.monotonic()
    result = phase(b)
    print(f"{name}: {time.monotonic() - start:.1f} s", flush=True)
    return result


def one_step_setup(stack: ExitStack) -> tuple[RedisServer, Path, dict[str, str]]:
    """A private Redis, a temp dir, and the workers' environment with a one-step script (answer at once)."""
    server = stack.enter_context(RedisServer())
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="forkq-bench-")))
    script = tmp / "script.json"
    step = {"delay_s": 0, "content": {"role": "model", "parts": [{"text": "Done."}]}}
    script.write_text(json.dumps({"steps": [step]}))
    return server, tmp, worker_env(server.url, script)


def run(plan: Plan) -> None:
    """Start Redis and the workers, measure, print, stop everything."""
    started = time.monotonic()
    with ExitStack() as stack:
        server, tmp, env = one_step_setup(stack)
        fork_group = stack.enter_context(
            workers("workers.app", FORK_QUEUE, ["fork1", "fork2"], env, tmp, concurrency=CONCURRENCY)
        )
        bare_group = stack.enter_context(
            workers("bench.bare_app", BARE_QUEUE, ["bare1", "bare2"], env, tmp, concurrency=CONCURRENCY)
        )
        conn_group = stack.enter_context(
            workers("bench.bare_app:conn_app", CONN_QUEUE, ["conn1", "conn2"], env, tmp, concurrency=CONCURRENCY)
        )
        r = stack.enter_context(redis.Redis.from_url(server.url))
        settings = Settings(redis_url=server.url, queue=FORK_QUEUE)
        bare_app = make_bare_app(settings)
        conn_app = make_bare_app(settings, forkq_connection=True)
        fork_client = ForkClient(settings, redis_client=r)
        wait_ready(bare_app, [*fork_group, *bare_group, *conn_group])
        parent = parse_parent_snapshot(json.loads(EXAMPLE_PARENT.read_text()))
        b = Bench(server.url, r, plan, bare_app, conn_app, fork_client, parent, fork_group, bare_group, conn_group)
        print(f"redis-server {server.url}, workers ready after {time.monotonic() - started:.1f} s", flush=True)
        latency = timed("latency", measure_latency, b)
        throughput = timed("throughput", measure_throughput, b)
        mems = [timed("memory", measure_memory, b), timed("memory, families", measure_family_memory, b)]
        inline = timed("inline seed", measure_inline, b)
        print_report(b, latency, throughput, mems)
        print_details(latency, throughput)
        print_memory(mems)
        print_inline(inline)
    print(f"\ntotal {time.monotonic() - started:.0f} s")


def run_memory(plan: Plan) -> None:
    """Only the memory figures: Redis and a client, no workers."""
    with RedisServer() as server, redis.Redis.from_url(server.url) as r:
        parent = parse_parent_snapshot(json.loads(EXAMPLE_PARENT.read_text()))
        settings = Settings(redis_url=server.url, queue=FORK_QUEUE)
        fork_client = ForkClient(settings, redis_client=r)
        app = make_bare_app(settings)
        b = Bench(server.url, r, plan, app, app, fork_client, parent, [], [], [])
        mems = [timed("memory", measure_memory, b), timed("memory, families", measure_family_memory, b)]
        print(f"\nforkq dispatch memory: redis-server {r.info('server')['redis_version']}")
        print_rows(memory_rows(mems))
        print()
        print_memory(mems)


def run_cost(n: int, rounds: int) -> None:
    """Only the CPU per job: one forkq worker and one bare-Celery worker, `rounds` alternating bursts of `n`."""
    with ExitStack() as stack:
        server, tmp, env = one_step_setup(stack)
        fork_group = stack.enter_context(
            workers("workers.app", FORK_QUEUE, ["fork1"], env, tmp, concurrency=CONCURRENCY)
        )
        bare_group = stack.enter_context(
            workers("bench.bare_app", BARE_QUEUE, ["bare1"], env, tmp, concurrency=CONCURRENCY)
        )
        r = stack.enter_context(redis.Redis.from_url(server.url))
        settings = Settings(redis_url=server.url, queue=FORK_QUEUE)
        bare_app = make_bare_app(settings)
        fork_client = ForkClient(settings, redis_client=r)
        wait_ready(bare_app, [*fork_group, *bare_group])
        parent = parse_parent_snapshot(json.loads(EXAMPLE_PARENT.read_text()))
        fork_burst(fork_client, parent, 50, fork_group)
        bare_burst(bare_app, r, 50, bare_group)
        forks: list[Burst] = []
        bare: list[Burst] = []
        for _ in range(rounds):
            forks.append(fork_burst(fork_client, parent, n, fork_group))
            bare.append(bare_burst(bare_app, r, n, bare_group))
        print(f"\nforkq dispatch cost: {os.cpu_count()} CPUs, Python {platform.python_version()}, ", end="")
        print(f"redis-py {redis.__version__}; 1 forkq + 1 bare-Celery worker, threads pool, concurrency {CONCURRENCY}")
        print(f"{rounds} rounds of {n:,} jobs each kind, launched while the worker consumes; CPU per job (ms)")
        print(f"{'':<24}{'caller':>10}{'worker':>10}{'Redis':>10}{'commands':>10}{'jobs/s':>10}")
        for name, bursts in (("forks", forks), ("bare no-ops", bare)):
            for i, x in enumerate(bursts, 1):
                print(
                    f"{name + f' {i}':<24}{x.caller_cpu_ms:>10.3f}{x.worker_cpu_ms:>10.3f}{x.redis_cpu_ms:>10.3f}"
                    f"{x.redis_cmds:>10.1f}{x.rate:>10.0f}"
                )
        med = statistics.median
        fork_w, bare_w = med(x.worker_cpu_ms for x in forks), med(x.worker_cpu_ms for x in bare)
        print(f"median worker CPU per job: forks {fork_w:.3f} ms, bare {bare_w:.3f} ms, {fork_w / bare_w:.2f}×")
        print(f"(Redis CPU includes the wait: EXISTS over the next {WAIT_BLOCK} done keys every 2 ms, for both kinds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (under a minute)")
    parser.add_argument("--memory", action="store_true", help="only the memory figures (no workers)")
    parser.add_argument("--cost", action="store_true", help="only the CPU per job, one worker of each kind")
    parser.add_argument("--n", type=int, default=2000, help="jobs per burst with --cost (default 2,000)")
    parser.add_argument("--rounds", type=int, default=3, help="bursts of each kind with --cost (default 3)")
    args = parser.parse_args()
    if args.cost:
        run_cost(args.n, args.rounds)
    elif args.memory:
        run_memory(QUICK if args.quick else FULL)
    else:
        run(QUICK if args.quick else FULL)


if __name__ == "__main__":
    main()

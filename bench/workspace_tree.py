"""A generated source tree for the workspace benchmarks: many small files, a few large ones, optionally in git.

`make_tree(root, files=10_000, total_bytes=100 MB, git=True)` writes `files` files under `root` in nested folders
(about 100 files a folder), whose sizes follow a long-tailed law scaled to exactly `total_bytes`; one file in fifty
is executable. With `git=True` the tree is committed in a fresh repository, plus an ignored `build/` folder git does
not list. The contents are pseudo-random from a fixed seed, so two runs give the same tree.

Run alone it makes a tree and prints what it made: `python -m bench.workspace_tree DIR [FILES] [BYTES]`.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

FILES_PER_FOLDER = 100
GIT_IDENTITY = ("-c", "user.name=bench", "-c", "user.email=bench@example.invalid", "-c", "commit.gpgsign=false")


def sizes(files: int, total_bytes: int, seed: int = 29) -> list[int]:
    """`files` sizes with a long tail (Pareto), summing to exactly `total_bytes`."""
    rng = random.Random(seed)
    raw = [rng.paretovariate(1.2) for _ in range(files)]
    scale = total_bytes / sum(raw)
    out = [int(r * scale) for r in raw]
    out[0] += total_bytes - sum(out)  # the rounding's remainder
    return out


def make_tree(root: Path, files: int = 10_000, total_bytes: int = 100 * 1024 * 1024, git: bool = True) -> Path:
    """Write the tree under `root` (created; it must not exist or be empty) and return `root`."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    pool = rng.randbytes(8 * 1024 * 1024)  # file bodies are slices of one random pool: fast, and distinct per file
    for i, size in enumerate(sizes(files, total_bytes)):
        folder = root / f"pkg{i // (FILES_PER_FOLDER * 10):02d}" / f"mod{(i // FILES_PER_FOLDER) % 10}"
        if i % FILES_PER_FOLDER == 0:
            folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"file{i:05d}.py"
        with path.open("wb") as f:
            f.write(i.to_bytes(4, "big"))  # every file distinct, even two of one size from one slice
            left = max(size - 4, 0)
            while left:
                start = rng.randrange(len(pool) - min(left, len(pool)) + 1)
                chunk = pool[start : start + min(left, len(pool))]
                f.write(chunk)
                left -= len(chunk)
        if i % 50 == 0:
            path.chmod(0o755)
    if git:
        (root / ".gitignore").write_text("build/\n")
        (root / "build").mkdir(exist_ok=True)
        (root / "build" / "out.bin").write_bytes(b"ignored\n" * 1000)
        for args in (["init", "-q"], ["add", "-A"], [*GIT_IDENTITY, "commit", "-q", "-m", "tree"]):
            subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    return root


def main() -> None:
    """Make a tree at the path given and print its size."""
    root = Path(sys.argv[1])
    files = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    total = int(sys.argv[3]) if len(sys.argv) > 3 else 100 * 1024 * 1024
    start = time.perf_counter()
    make_tree(root, files, total, git=True)
    n = sum(len(f) for _, _, f in os.walk(root / "pkg00"))
    print(f"made {files} files, {total} bytes under {root} in {time.perf_counter() - start:.1f} s ({n} in pkg00)")


if __name__ == "__main__":
    main()

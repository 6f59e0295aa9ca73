"""Trees on disk for the patch and apply tests: write one, read one back, run real git on it."""

from __future__ import annotations

import os
import random
import stat
import subprocess
from pathlib import Path

from workers.workspace.manifest import Changes, Entry, Manifest, Mode, blob_digest

Tree = dict[str, tuple[Mode, bytes]]  # path → (mode, bytes); a symlink's bytes are its target


class Blobs(dict[str, bytes]):
    """Blobs by digest: the `read` the patch and apply functions take."""

    def read(self, digest: str) -> bytes:
        """The blob's bytes."""
        return self[digest]


def manifest_of(tree: Tree, blobs: Blobs) -> Manifest:
    """The manifest of `tree`, its blobs added to `blobs`."""
    entries = []
    for path, (mode, data) in tree.items():
        digest = blob_digest(data)
        blobs[digest] = data
        entries.append(Entry(path, mode, len(data), digest))
    return Manifest.of(entries)


def changes_of(base: Tree, new: Tree, blobs: Blobs) -> tuple[Manifest, Changes]:
    """The base manifest and the changes that turn `base` into `new`."""
    before = manifest_of(base, blobs)
    return before, before.changes_to(manifest_of(new, blobs))


def write_tree(root: Path, tree: Tree) -> None:
    """Write `tree` under `root` (folders made as needed)."""
    root.mkdir(parents=True, exist_ok=True)
    for path, (mode, data) in tree.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if mode == Mode.SYMLINK:
            os.symlink(os.fsdecode(data), target)
        else:
            target.write_bytes(data)
            target.chmod(0o755 if mode == Mode.EXECUTABLE else 0o644)


def read_tree(root: Path, *, skip: tuple[str, ...] = (".git",)) -> Tree:
    """The files and symlinks under `root` (folders are implied by their files), without `skip` at the top."""
    tree: Tree = {}
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        if rel == Path("."):
            dirs[:] = [d for d in dirs if d not in skip]
        for name in files + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            path = Path(folder) / name
            info = path.lstat()
            key = (rel / name).as_posix()
            if stat.S_ISLNK(info.st_mode):
                tree[key] = (Mode.SYMLINK, os.fsencode(os.readlink(path)))
            else:
                tree[key] = (Mode.of(info.st_mode), path.read_bytes())
    return tree


def folders(root: Path) -> set[str]:
    """Every folder under `root` (relative), so that a test sees folders made or left behind."""
    return {Path(f).relative_to(root).as_posix() for f, _, _ in os.walk(root)}


def git(cwd: Path, *args: str, stdin: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run real git in `cwd`, free of the user's and the system's configuration, and never above `cwd`."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(cwd),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CEILING_DIRECTORIES": str(cwd.parent),
        "LC_ALL": "C",
    }
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "core.symlinks=true", *args]
    return subprocess.run(command, cwd=cwd, env=env, input=stdin, capture_output=True, check=check)


def git_repo(root: Path, tree: Tree) -> Path:
    """A git repository at `root` whose one commit is `tree`."""
    write_tree(root, tree)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "--allow-empty", "-m", "base")
    return root


def random_bytes(seed: int, size: int) -> bytes:
    """`size` reproducible random bytes."""
    return random.Random(seed).randbytes(size)

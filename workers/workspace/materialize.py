"""Build a manifest into a folder on a worker, and replay a run's journaled changes on it.

A build writes every file of a manifest into an empty folder: first the folders, then the regular files
(created with `O_EXCL | O_NOFOLLOW`, so nothing is ever written through a link), then the symlinks, last, with
their targets as stored (never followed, never checked: a link out of the tree is the tree's own business, and
the sandbox decides what it may reach). Blobs come from the worker's `WorkspaceCache`, each verified as it is
copied (a damaged cache file is dropped and fetched again), and the rest from one call of `fetch` (which
batches its reads); fetched blobs are written from memory and kept in the cache. Files are copies, never
links, so a fork cannot change the cache through its tree: a large file is cloned (FICLONE) where the
filesystem shares blocks copy-on-write, else copied in the kernel (`copy_file_range`).

With `git=True` the folder also gets a fresh repository whose one commit is the base tree, made with no user or
system configuration and a fixed author and date (the same tree gives the same commit on every worker), so
`git status` starts clean and `git diff` shows exactly the fork's own changes. Its objects are stored without
compression: `git add` then costs less than half the CPU, and the repository takes about as much disk as the tree.
Removing a run's folder and measuring its disk are in `cleanup` (and named here too).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from workers.errors import WorkspaceError
from workers.workspace.beneath import write_fully
from workers.workspace.cache import Fetch, WorkspaceCache, fetch_verified
from workers.workspace.cleanup import disk_usage, remove_tree
from workers.workspace.manifest import Changes, Entry, Manifest, Mode

__all__ = [
    "BuildStats",
    "Fetch",
    "WorkspaceCache",
    "apply_changes_to_tree",
    "build",
    "disk_usage",
    "remove_tree",
]

KERNEL_COPY_MIN: Final = 256 * 1024  # a cached file this large is verified through mmap and copied by the kernel
FICLONE: Final = getattr(fcntl, "FICLONE", 0x40049409)  # Python < 3.12 does not name it
_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
GIT_TIMEOUT_S: Final = 600
BASE_COMMIT_MESSAGE: Final = "forkq: the workspace as the fork started"
# a fixed identity and date: the base commit of one tree is the same commit on every worker and every revival
_GIT_ENV: Final = {
    "GIT_CONFIG_GLOBAL": os.devnull,  # no user configuration (filters, hooks, signing, templates)
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "forkq",
    "GIT_AUTHOR_EMAIL": "forkq@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "forkq",
    "GIT_COMMITTER_EMAIL": "forkq@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "LC_ALL": "C",
}
# written into the repository, so the fork's own git commands see them too
_GIT_CONFIG: Final = """[core]
\tautocrlf = false
\tsafecrlf = false
\tsymlinks = true
\tfilemode = true
\thooksPath = /dev/null
[gc]
\tauto = 0
[maintenance]
\tauto = false
[commit]
\tgpgSign = false
"""


@dataclass(frozen=True, slots=True)
class BuildStats:
    """What a build wrote: files and their bytes, the blobs it fetched (not cached) and their bytes, and its time."""

    files: int
    bytes: int
    fetched: int
    fetched_bytes: int
    seconds: float


@dataclass(slots=True)
class _Counts:
    files: int = 0
    bytes: int = 0
    fetched: int = 0
    fetched_bytes: int = 0


def build(
    manifest: Manifest,
    dest: Path,
    cache: WorkspaceCache,
    fetch: Fetch,
    *,
    git: bool = False,
    trusted: bool = False,
) -> BuildStats:
    """Write the files of `manifest` into `dest` (absent or an empty folder), from `cache` or else `fetch`; with
    `git`, commit them as the base of a fresh repository in `dest`. A build that fails removes `dest`. `trusted`:
    `fetch` verifies every blob against its digest itself (`BlobStore.get` does), so the build does not again.

    Raises:
        WorkspaceError: `dest` is not an empty folder, a file cannot be written, a blob is missing, or git fails.
        RecordIntegrityError: a fetched blob's bytes do not have its digest.
    """
    started = time.perf_counter()
    if git:
        _refuse_git_paths(manifest)
    root = _empty_folder(dest)
    try:
        _make_folders(root, manifest.entries)
        counts = _place(root, manifest.entries, cache, fetch, replace=False, trusted=trusted)
        if git:
            _commit_base(root)
    except OSError as exc:
        remove_tree(Path(root))
        raise WorkspaceError(f"workspace {root}: the build failed: {exc}", cause=exc) from exc
    except BaseException:
        remove_tree(Path(root))
        raise
    return BuildStats(counts.files, counts.bytes, counts.fetched, counts.fetched_bytes, time.perf_counter() - started)


def apply_changes_to_tree(
    dest: Path, changes: Changes, cache: WorkspaceCache, fetch: Fetch, *, trusted: bool = False
) -> None:
    """Replay journaled `changes` on the tree in `dest`: write changed files, remove removed ones and the folders
    they leave empty. Nothing is written or removed through a symlink. `trusted` as for `build`.

    Raises:
        WorkspaceError: a change's folder is a file or a symlink in `dest`, or a file cannot be written.
        RecordIntegrityError: a fetched blob's bytes do not have its digest.
    """
    root = os.path.abspath(dest)
    if not stat.S_ISDIR(_lstat_mode(root)):
        raise WorkspaceError(f"workspace {root}: not a folder; build the workspace before replaying its changes")
    try:
        for path, entry in sorted(changes.items()):
            if entry is None:
                _remove(root, path)
        writes = [entry for entry in changes.values() if entry is not None]
        made: set[str] = set()
        for entry in writes:
            _real_folder(root, _parent(entry.path), create=True, known=made)
        _place(root, writes, cache, fetch, replace=True, trusted=trusted)
    except OSError as exc:
        raise WorkspaceError(f"workspace {root}: replaying {len(changes)} changes failed: {exc}", cause=exc) from exc


def _place(
    root: str, entries: Sequence[Entry], cache: WorkspaceCache, fetch: Fetch, *, replace: bool, trusted: bool
) -> _Counts:
    """Write `entries` under `root`: cached blobs first (verified), then every other blob from one fetch (verified
    once: here, or by a `trusted` fetch), each kept in the cache after its files are written; the symlinks last."""
    by_digest: dict[str, list[Entry]] = {}
    for entry in entries:
        by_digest.setdefault(entry.digest, []).append(entry)
    writer = _Writer(root, replace=replace)
    refetch: list[str] = []
    with cache.hold(by_digest) as held:
        for digest, source in held.items():
            if not _copy_cached(source, digest, by_digest[digest], writer):
                refetch.append(digest)
    for digest in refetch:  # damaged or vanished: never copied, fetched again below
        cache.discard(digest)
    missing = [d for d in by_digest if d not in held] + refetch
    if missing:
        for digest, data in fetch_verified(fetch, missing, trusted=trusted):
            writer.counts.fetched += 1
            writer.counts.fetched_bytes += len(data)
            writer.write_all(by_digest[digest], data)
            cache.put_later(digest, data)
    writer.make_links()
    return writer.counts


def _copy_cached(source: str, digest: str, entries: list[Entry], writer: _Writer) -> bool:
    """Copy the cached blob `source` to `entries` if its bytes have `digest`; False (nothing written) if not."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size < KERNEL_COPY_MIN:
            data = os.read(fd, size + 1)  # one byte more: a file that grew since fstat fails the digest
            if hashlib.sha256(data).hexdigest() != digest:
                return False
            writer.write_all(entries, data)
            return True
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
            if hashlib.sha256(view).hexdigest() != digest:
                return False
            for entry in entries:
                writer.copy(entry, fd, view)
        return True
    finally:
        os.close(fd)


class _Writer:
    """Writes files under one root: created exclusively in a fresh build, else beside the old file and renamed
    over it (a rename replaces a symlink itself, never its target)."""

    def __init__(self, root: str, *, replace: bool) -> None:
        self.root = root
        self.replace = replace
        self.counts = _Counts()
        self.links: list[tuple[Entry, bytes]] = []

    def _open(self, entry: Entry) -> tuple[int, str, str]:
        final = f"{self.root}/{entry.path}"
        if not self.replace:
            return os.open(final, _CREATE, 0o600), final, final
        temporary = f"{final[: final.rfind('/')]}/.forkq-{uuid.uuid4().hex}"
        return os.open(temporary, _CREATE, 0o600), temporary, final

    def _close(self, fd: int, entry: Entry, written: str, final: str, size: int) -> None:
        try:
            os.fchmod(fd, 0o755 if entry.mode is Mode.EXECUTABLE else 0o644)  # exactly, whatever the umask
        finally:
            os.close(fd)
        if written != final:
            try:
                os.replace(written, final)
            except OSError:  # e.g. a folder stands at `final`: leave no stray file behind
                os.unlink(written)
                raise
        self.counts.files += 1
        self.counts.bytes += size

    def write_all(self, entries: Iterable[Entry], data: bytes) -> None:
        """Write `data` to each of `entries` (symlinks are kept for `make_links`)."""
        for entry in entries:
            if entry.mode is Mode.SYMLINK:
                self.links.append((entry, data))
                continue
            fd, written, final = self._open(entry)
            try:
                write_fully(fd, data)
            except BaseException:
                os.close(fd)
                raise
            self._close(fd, entry, written, final, len(data))

    def copy(self, entry: Entry, source_fd: int, view: mmap.mmap) -> None:
        """Copy the verified file `source_fd` (mapped as `view`) to `entry`: a clone, else a copy in the kernel."""
        if entry.mode is Mode.SYMLINK:
            self.links.append((entry, bytes(view)))
            return
        fd, written, final = self._open(entry)
        try:
            _kernel_copy(source_fd, fd, view)
        except BaseException:
            os.close(fd)
            raise
        self._close(fd, entry, written, final, len(view))

    def make_links(self) -> None:
        """Create the symlinks, after every regular file, so no file is written through one."""
        for entry, target in self.links:
            final = f"{self.root}/{entry.path}"
            if not self.replace:
                os.symlink(target, final)
            else:
                temporary = f"{final[: final.rfind('/')]}/.forkq-{uuid.uuid4().hex}"
                os.symlink(target, temporary)
                os.replace(temporary, final)
            self.counts.files += 1
            self.counts.bytes += len(target)


def _kernel_copy(source_fd: int, fd: int, view: mmap.mmap) -> None:
    size = len(view)
    with contextlib.suppress(OSError):  # no reflinks on this filesystem (ext4, tmpfs) or across two of them
        fcntl.ioctl(fd, FICLONE, source_fd)
        return
    done = 0
    with contextlib.suppress(OSError):  # no copy_file_range here (old kernel, some filesystems): write it
        while done < size:
            copied = os.copy_file_range(source_fd, fd, size - done, done, done)
            if not copied:
                break
            done += copied
    while done < size:
        done += os.pwrite(fd, view[done:], done)


def _empty_folder(dest: Path) -> str:
    root = os.path.abspath(dest)
    try:
        mode = os.lstat(root).st_mode
    except FileNotFoundError:
        os.makedirs(root, 0o755)
        return root
    if not stat.S_ISDIR(mode):
        raise WorkspaceError(f"workspace {root}: exists and is not a folder; build into a new or empty folder")
    with os.scandir(root) as found:
        if next(found, None) is not None:
            raise WorkspaceError(f"workspace {root}: the folder is not empty; build into a new or empty folder")
    return root


def _make_folders(root: str, entries: Iterable[Entry]) -> None:
    folders: set[str] = set()
    for entry in entries:
        folder = _parent(entry.path)
        while folder and folder not in folders:
            folders.add(folder)
            folder = _parent(folder)
    for folder in sorted(folders):  # a folder sorts before the folders inside it
        os.mkdir(f"{root}/{folder}", 0o755)


def _parent(path: str) -> str:
    return path[: max(path.rfind("/"), 0)]


def _lstat_mode(path: str) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def _real_folder(root: str, folder: str, *, create: bool, known: set[str] | None = None) -> bool:
    """Whether `folder` under `root` is a real folder (no component a symlink or file), made if `create`.

    Raises:
        WorkspaceError: a component is a file or a symlink.
    """
    if not folder or (known is not None and folder in known):
        return True
    parts = folder.split("/")
    for depth in range(1, len(parts) + 1):
        current = "/".join(parts[:depth])
        if known is not None and current in known:
            continue
        mode = _lstat_mode(f"{root}/{current}")
        if mode == 0 and create:
            os.mkdir(f"{root}/{current}", 0o755)
        elif mode == 0:
            return False
        elif not stat.S_ISDIR(mode):
            raise WorkspaceError(
                f"workspace {root}: {current!r} is a file or symlink, not a folder, so {folder!r} cannot be "
                "reached without following it; the changes do not fit this tree (rebuild it from its manifest)",
                field="path",
            )
        if known is not None:
            known.add(current)
    return True


def _remove(root: str, path: str) -> None:
    folder = _parent(path)
    if not _real_folder(root, folder, create=False):
        return
    target = f"{root}/{path}"
    mode = _lstat_mode(target)
    if stat.S_ISDIR(mode):
        remove_tree(Path(target))
    elif mode:
        os.unlink(target)
    while folder:  # the folders the removal left empty go too (a manifest lists files only)
        try:
            os.rmdir(f"{root}/{folder}")
        except OSError:
            break
        folder = _parent(folder)


def _refuse_git_paths(manifest: Manifest) -> None:
    for entry in manifest:
        if any(part.lower() == ".git" for part in entry.path.split("/")):
            raise WorkspaceError(
                f"workspace path {entry.path!r}: a `.git` inside the tree cannot be committed to its base "
                "repository; leave it out of the snapshot",
                field="path",
            )


def commit_base(dest: Path, manifest: Manifest) -> None:
    """Make the built tree in `dest` the one commit of a fresh repository there (what `build(git=True)` does last).

    Raises:
        WorkspaceError: the manifest holds a `.git` path, or git fails.
    """
    _refuse_git_paths(manifest)
    _commit_base(str(dest))


def _commit_base(root: str) -> None:
    """A fresh repository in `root` whose one commit is everything in it."""
    _git(root, "init", "-q", "--template=")
    with open(f"{root}/.git/config", "a", encoding="utf-8") as config:
        config.write(_GIT_CONFIG)
    # -f: a file the tree's .gitignore names is still part of the snapshot (it was tracked), so part of the base
    _git(root, "add", "-A", "-f")
    _git(root, "commit", "-q", "--no-verify", "--allow-empty", "-m", BASE_COMMIT_MESSAGE)


def _git(root: str, *args: str) -> None:
    executable = shutil.which("git")
    if executable is None:
        raise WorkspaceError(
            "git: not found on PATH; install git on the worker, or snapshot a tree that is not a git work tree",
            field="git",
        )
    command = [executable, "-c", "core.fsync=none", "-c", "core.looseCompression=0", *args]
    try:
        done = subprocess.run(command, cwd=root, env=_GIT_ENV, capture_output=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WorkspaceError(f"workspace {root}: `git {args[0]}` did not run: {exc}", field="git") from exc
    if done.returncode:
        tail = done.stderr.decode("utf-8", "replace").strip()[-800:]
        raise WorkspaceError(
            f"workspace {root}: `git {' '.join(args)}` exited {done.returncode}: {tail}; the base commit needs a "
            "working git (2.28 or later)",
            field="git",
        )

"""The files of a materialized workspace that a tool call changed, found with inotify, so a step costs what it changed.

A `Tracker` starts from the manifest the folder was built from and watches every folder of the tree.
Each `collect` (after a tool call, when every writer of the call has ended) reads the queued events
without blocking, and looks only at the paths they name: a regular file is hashed, a symlink read, a
folder (new, moved in, or replaced) walked, a missing path removed. What differs from the tree as of
the last collect is returned as `Changes`, with the bytes of every blob the tree did not hold before.
A file written again with the same bytes and mode is no change.

Fallback. When the event queue overflowed, a watch could not be added (the per-user watch limit), or
inotify is unavailable (or turned off), a collect walks the whole tree instead (`rescanned=True`): a
file is read again only when its `(size, mtime_ns, ctime_ns, inode)` differs from what the tracker
last saw, or was too recent to trust (a write in the same timestamp tick keeps the same mtime).

Rules:
- A `.git` (any case) at any depth is not part of the tree: the top one is the workspace's own
  repository, and git never tracks a path through one, so neither a snapshot nor a patch holds it
  (and a repository cloned into the tree does not flood the journal).
- Symlinks are never followed: a link is an entry whose blob is its target, and a file is read
  through folders opened one by one without following links (`beneath`), so a folder swapped for a
  link by a process still running cannot lead a read out of the tree. Other file types (fifos,
  sockets, devices) and empty folders are not entries.
- A path a manifest cannot hold (a name that is not UTF-8, too long or too deep) is left out: it is
  logged and reported in `Collected.skipped`, so the caller can tell the model. So is a file the
  tracker cannot read; its previous entry then stays.
- Bounds: when the tree after a collect is over `max_bytes` or `max_files`, `collect` raises
  `WorkspaceTooLarge` and keeps nothing: the changes stay pending and the next collect reports them
  with whatever the next call changes. So the recorded tree never exceeds the bounds, and deleting
  files in the next call brings it back.
- A file with several names (hard links) written through one of them makes an event for that name
  only: its other names in the tree keep their old entry until a rescan.

One tracker per fork run, used by one thread at a time; it holds no state outside itself.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from workers.errors import WorkspaceError, WorkspaceTooLarge
from workers.workspace import beneath, inotify
from workers.workspace.manifest import Changes, Entry, Manifest, Mode, blob_digest, check_path

log = logging.getLogger("forkq.workspace")

GIT_DIR: Final = ".git"
# a stat row is trusted only when the file's mtime is older than the stat by more than the clock's tick
RACY_NS: Final = 100_000_000
COARSE_RACY_NS: Final = 2_000_000_000  # file systems that keep whole seconds (FAT keeps two)
LARGEST_SHOWN: Final = 5

Row = tuple[int, int, int, int]  # (size, mtime_ns, ctime_ns, inode) of a file as last seen


class _Trust(enum.Enum):
    """How far a file's stat row is trusted before its bytes are read again."""

    NONE = "none"  # an event says its content may have changed: always read
    WEAK = "weak"  # only its mode changed: the same size, mtime and inode keep the digest
    ROW = "row"  # a walk: the same size, mtime, ctime and inode keep the digest


@dataclass(frozen=True, slots=True)
class Collected:
    """What changed since the last collect, the new blobs, whether the whole tree was walked, and paths left out.

    `blobs` holds the bytes of every digest of `changes` the tree did not name before this collect
    (the others are stored already: the base's blobs, and every earlier collect's).
    """

    changes: Changes
    blobs: dict[str, bytes]
    rescanned: bool
    skipped: tuple[str, ...] = ()


@dataclass(slots=True)
class _Pass:
    """One collect's findings, kept apart from the tracker until they are within the bounds."""

    changes: Changes = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    rows: dict[str, Row | None] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


class Tracker:
    """The files of a materialized workspace that changed since the last collect, found with inotify."""

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        *,
        max_bytes: int | None = None,
        max_files: int | None = None,
        use_inotify: bool = True,
    ) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._use_inotify = use_inotify
        self._entries: dict[str, Entry] = manifest.by_path()
        self._manifest: Manifest | None = manifest
        self._folders: collections.Counter[str] = collections.Counter()
        self._digests: collections.Counter[str] = collections.Counter()
        self._total = 0
        for entry in self._entries.values():
            self._count(entry, 1)
        self._rows: dict[str, Row] = {}
        self._pending: dict[str, bool] = {}  # dirty path → whether its content may have changed (not only mode)
        self._rescan = False
        self._inotify: inotify.Inotify | None = None
        self._wd_path: dict[int, str] = {}
        self._path_wd: dict[str, int] = {}
        self._orphans: set[int] = set()

    @property
    def manifest(self) -> Manifest:
        """The tree as of the last collect (built when asked, so a collect costs nothing for the rest of the tree)."""
        if self._manifest is None:
            self._manifest = Manifest.of(self._entries.values())
        return self._manifest

    @property
    def watching(self) -> bool:
        """Whether changes are found from inotify's events (else every collect walks the whole tree)."""
        return self._inotify is not None

    @property
    def watches(self) -> int:
        """How many folders are watched."""
        return len(self._path_wd)

    def start(self) -> None:
        """Watch every folder of the tree, and note each file's stat (a path that differs from the manifest is
        reported by the first collect)."""
        if self._use_inotify:
            try:
                self._inotify = inotify.Inotify()
            except inotify.InotifyUnavailable as exc:
                log.warning("workspace %s: %s; every collect walks the whole tree", self.root, exc)
        seen: set[str] = set()
        skipped: list[str] = []
        now = time.time_ns()
        for path, st in self._walk("", skipped):
            seen.add(path)
            entry = self._entries.get(path)
            mode = Mode.of(st.st_mode)
            if entry is None or entry.mode != mode or entry.size != st.st_size:  # a link's size: its target's
                self._pending[path] = True
            elif mode != Mode.SYMLINK and not _racy(st, now):
                self._rows[path] = _row(st)
        for path in self._entries.keys() - seen:
            self._pending[path] = True
        for message in skipped:
            log.warning("workspace %s: %s", self.root, message)

    def collect(self) -> Collected:
        """The changes since the last collect, and the bytes of their new blobs.

        Raises:
            WorkspaceTooLarge: the tree after these changes is over the bounds; nothing is kept, and the
                next collect reports these changes again.
        """
        self._drain()
        rescanned = self._rescan or self._inotify is None
        targets = {"": False} if rescanned else _outermost(self._pending)
        found = _Pass()
        for path, content in targets.items():
            self._resolve(path, content, found)
        self._drop_orphans()
        for message in found.skipped:
            log.warning("workspace %s: %s", self.root, message)
        self._check_bounds(found.changes)
        self._commit(found)
        return Collected(dict(sorted(found.changes.items())), found.blobs, rescanned, tuple(found.skipped))

    def close(self) -> None:
        """Stop watching (the folder itself is the caller's to remove)."""
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        self._wd_path.clear()
        self._path_wd.clear()

    def __enter__(self) -> Tracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # events

    def _drain(self) -> None:
        if self._inotify is None:
            return
        for event in self._inotify.read():
            if event.mask & inotify.IN_Q_OVERFLOW:
                log.warning("workspace %s: inotify's event queue overflowed; walking the whole tree", self.root)
                self._rescan = True
                continue
            base = self._wd_path.get(event.wd)
            if base is None:
                continue  # a watch already dropped: its folder's path is dirty on its own
            if event.mask & (inotify.IN_IGNORED | inotify.IN_DELETE_SELF | inotify.IN_MOVE_SELF | inotify.IN_UNMOUNT):
                self._mark(base, True)
                if event.mask & inotify.IN_IGNORED:
                    self._unmap(event.wd)
            if not event.name:
                continue
            name = os.fsdecode(event.name)
            if name.lower() == GIT_DIR:
                continue
            self._mark(f"{base}/{name}" if base else name, bool(event.mask & ~(inotify.IN_ATTRIB | inotify.IN_ISDIR)))

    def _mark(self, path: str, content: bool) -> None:
        self._pending[path] = self._pending.get(path, False) or content

    # resolution: what a path holds now against what the tree had there

    def _resolve(self, path: str, content: bool, found: _Pass) -> None:
        if path:
            try:
                check_path(path)
            except WorkspaceError as exc:
                found.skipped.append(f"{_shown(path)}: {_reason(exc)}")
                return
        self._detach(path)
        now: dict[str, Entry] = {}
        try:
            st = os.lstat(self._abs(path))
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            for child, child_st in self._walk(path, found.skipped):
                entry = self._entry(child, child_st, found, _Trust.ROW)
                if entry is not None:
                    now[child] = entry
        elif st is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            entry = self._entry(path, st, found, _Trust.NONE if content else _Trust.WEAK)
            if entry is not None:
                now[path] = entry
        for old in self._under(path):
            if old not in now:
                found.changes[old] = None
                found.rows[old] = None
        for new, entry in now.items():
            if self._entries.get(new) != entry:
                found.changes[new] = entry

    def _entry(self, path: str, st: os.stat_result, found: _Pass, trust: _Trust) -> Entry | None:
        """The entry of the file or symlink at `path`, read only when its stat says it may have changed."""
        if stat.S_ISLNK(st.st_mode):
            try:
                target = beneath.read_link(str(self.root), path)
            except FileNotFoundError:
                return None
            except OSError as exc:
                return self._unreadable(path, exc, found)
            return self._blob(path, Mode.SYMLINK, target, found)
        old, row = self._entries.get(path), self._rows.get(path)
        if old is not None and row is not None and old.mode != Mode.SYMLINK and trust is not _Trust.NONE:
            now = _row(st)
            # a path that only saw a mode change may trust its size, mtime and inode (a chmod moves the ctime)
            if now == row or (trust is _Trust.WEAK and (now[0], now[1], now[3]) == (row[0], row[1], row[3])):
                return Entry(path, Mode.of(st.st_mode), old.size, old.digest)
        return self._read(path, found)

    def _read(self, path: str, found: _Pass) -> Entry | None:
        try:
            read = beneath.read_file(str(self.root), path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._unreadable(path, exc, found)
        if read is None:
            return None  # replaced by a fifo or a device since the listing: not a file of the tree
        st, data = read
        found.rows[path] = None if _racy(st, time.time_ns()) else _row(st)
        return self._blob(path, Mode.of(st.st_mode), data, found)

    def _blob(self, path: str, mode: Mode, data: bytes, found: _Pass) -> Entry:
        digest = blob_digest(data)
        if digest not in self._digests:
            found.blobs[digest] = data
        return Entry(path, mode, len(data), digest)

    def _unreadable(self, path: str, exc: OSError, found: _Pass) -> Entry | None:
        found.skipped.append(f"{_shown(path)}: cannot be read ({exc.strerror}); its previous version is kept")
        return self._entries.get(path)

    def _under(self, path: str) -> list[str]:
        """The tree's paths at `path` or beneath it."""
        if not path:
            return list(self._entries)
        found = [path] if path in self._entries else []
        if self._folders.get(path):
            prefix = path + "/"
            found.extend(p for p in self._entries if p.startswith(prefix))
        return found

    # walking and watching

    def _walk(self, top: str, skipped: list[str]) -> Iterator[tuple[str, os.stat_result]]:
        """The regular files and symlinks under the folder `top`, with their lstat; every folder is watched first,
        so what is written after it is listed makes an event."""
        folders = [top]
        while folders:
            folder = folders.pop()
            self._watch(folder)
            try:
                with os.scandir(self._abs(folder)) as listing:
                    items = list(listing)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for item in items:
                path = f"{folder}/{item.name}" if folder else item.name
                if item.name.lower() == GIT_DIR:
                    continue
                if path not in self._entries:
                    try:
                        check_path(path)
                    except WorkspaceError as exc:
                        skipped.append(f"{_shown(path)}: {_reason(exc)}")
                        continue
                if item.is_dir(follow_symlinks=False):
                    folders.append(path)
                elif item.is_symlink() or item.is_file(follow_symlinks=False):
                    try:
                        yield path, item.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue

    def _watch(self, folder: str) -> None:
        if self._inotify is None:
            return
        try:
            wd = self._inotify.add_watch(os.fsencode(self._abs(folder)))
        except inotify.InotifyUnavailable as exc:
            log.warning("workspace %s: %s; every collect walks the whole tree from now on", self.root, exc)
            self.close()
            return
        except OSError:
            return  # gone, or no longer a folder: its parent's event says so
        previous = self._wd_path.get(wd)
        if previous is not None and previous != folder and self._path_wd.get(previous) == wd:
            del self._path_wd[previous]  # the same folder, moved: its watch follows it
        stale = self._path_wd.get(folder)
        if stale is not None and stale != wd:
            self._wd_path.pop(stale, None)
            self._orphans.add(stale)
        self._wd_path[wd] = folder
        self._path_wd[folder] = wd
        self._orphans.discard(wd)

    def _detach(self, path: str) -> None:
        """Forget the watches at and under `path` before it is walked again; those of folders found again come back,
        the others (moved out, removed) are dropped after the collect."""
        if self._inotify is None or (path and path not in self._path_wd):
            return
        prefix = path + "/"
        for folder in [p for p in self._path_wd if not path or p == path or p.startswith(prefix)]:
            self._orphans.add(self._path_wd.pop(folder))
        for wd in self._orphans:
            self._wd_path.pop(wd, None)

    def _drop_orphans(self) -> None:
        if self._inotify is not None:
            for wd in self._orphans:
                self._inotify.rm_watch(wd)
        self._orphans.clear()

    def _unmap(self, wd: int) -> None:
        path = self._wd_path.pop(wd, None)
        if path is not None and self._path_wd.get(path) == wd:
            del self._path_wd[path]

    # the tree's state

    def _check_bounds(self, changes: Changes) -> None:
        if self.max_bytes is None and self.max_files is None:
            return
        files, total = len(self._entries), self._total
        for path, entry in changes.items():
            old = self._entries.get(path)
            files += (entry is not None) - (old is not None)
            total += (entry.size if entry else 0) - (old.size if old else 0)
        over_files = self.max_files is not None and files > self.max_files
        over_bytes = self.max_bytes is not None and total > self.max_bytes
        if not (over_files or over_bytes):
            return
        largest = _largest({**self._entries, **changes})
        shown = ", ".join(f"{folder} ({size} bytes, {count} files)" for folder, size, count in largest)
        raise WorkspaceTooLarge(
            f"workspace {self.root}: {files} files and {total} bytes after this call, over the bounds of "
            f"{self.max_files} files and {self.max_bytes} bytes (FORKQ_WORKSPACE_MAX_FILES, "
            f"FORKQ_WORKSPACE_MAX_BYTES); largest folders: {shown}; remove files (the changes are recorded once the "
            "tree is back within the bounds)",
            largest=largest,
        )

    def _commit(self, found: _Pass) -> None:
        for path, entry in found.changes.items():
            old = self._entries.pop(path, None)
            if old is not None:
                self._count(old, -1)
            if entry is not None:
                self._entries[path] = entry
                self._count(entry, 1)
        for path, row in found.rows.items():
            if row is None:
                self._rows.pop(path, None)
            else:
                self._rows[path] = row
        if found.changes:
            self._manifest = None
        self._pending.clear()
        self._rescan = False

    def _count(self, entry: Entry, sign: int) -> None:
        self._total += sign * entry.size
        self._digests[entry.digest] += sign
        if self._digests[entry.digest] <= 0:
            del self._digests[entry.digest]
        parts = entry.path.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            self._folders[folder] += sign
            if self._folders[folder] <= 0:
                del self._folders[folder]

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path) if path else str(self.root)


def _outermost(pending: dict[str, bool]) -> dict[str, bool]:
    """The pending paths that lie under no other pending path (a folder walked covers what is beneath it)."""
    if "" in pending:
        return {"": pending[""]}
    kept: dict[str, bool] = {}
    for path, content in pending.items():
        parts = path.split("/")
        if not any("/".join(parts[:i]) in pending for i in range(1, len(parts))):
            kept[path] = content
    return kept


def _row(st: os.stat_result) -> Row:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _racy(st: os.stat_result, now_ns: int) -> bool:
    """Whether a write in the same timestamp tick could leave this stat unchanged (then the row is not trusted)."""
    margin = COARSE_RACY_NS if st.st_mtime_ns % 1_000_000_000 == 0 else RACY_NS
    return st.st_mtime_ns >= now_ns - margin or st.st_ctime_ns >= now_ns - margin


def _shown(path: str) -> str:
    """A path as a log line can show it (a name that is not UTF-8 keeps its bytes as escapes)."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _reason(exc: WorkspaceError) -> str:
    return str(exc).split(": ", 1)[-1] + " (left out of the workspace)"


def _largest(entries: dict[str, Entry | None]) -> list[tuple[str, int, int]]:
    """The biggest top-level folders of a tree (`.` for the files at its root), as `(folder, bytes, files)`."""
    sizes: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for path, entry in entries.items():
        if entry is not None:
            folder = path.split("/", 1)[0] if "/" in path else "."
            sizes[folder] += entry.size
            counts[folder] += 1
    return [(folder, size, counts[folder]) for folder, size in sizes.most_common(LARGEST_SHOWN)]

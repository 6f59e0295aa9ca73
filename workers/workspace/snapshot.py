"""A launch's snapshot of the parent's folder: every file's path, mode, size and SHA-256, read once.

`snapshot(root, max_bytes=, max_files=, cache_dir=)` lists the folder (workers.workspace.listing: git's
listing in a git work tree, else a walk minus `.forkqignore`), refuses a tree over the bounds from the
listing and the files' stat alone, before any file is read, then digests every file. A file whose stat
matches the launcher's stat cache (workers.workspace.statcache) is not read again, so a launch of an
unchanged tree reads no file; the others are read in 1 MiB chunks. Symlinks stay links: their blob is
the target's bytes, as git stores it, and nothing is followed.

A file that changes while it is read (its size, mtime, ctime or inode after the read differ from before,
or it holds more or fewer bytes than its size) is read once more; a second change is an error naming it.
The bytes stored later come from `Snapshot.read`, which reads the file again and checks them against the
digest, so a file changed since the snapshot is an error too, never a blob under the wrong digest.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from workers.errors import WorkspaceError, WorkspaceTooLarge
from workers.workspace.listing import IGNORE_FIX, list_files
from workers.workspace.manifest import Entry, Manifest, Mode, blob_digest
from workers.workspace.statcache import StatCache, StatKey, stat_key

CHUNK: Final = 1 << 20  # bytes one read takes: a large file is hashed in bounded memory
LARGEST_SHOWN: Final = 5  # folders a refusal names
TOP_FILES: Final = "."  # the folder name a refusal gives the files at the top of the tree
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a fifo swapped in must not block


class _Changed(Exception):
    """A file's bytes or stat changed while it was read."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A folder's files as a manifest, and the way back from a digest to the bytes on disk."""

    root: Path  # the folder snapshotted, absolute and resolved
    manifest: Manifest
    git: bool  # the folder lies in a git work tree and git listed its files
    hashed: int = 0  # files read and hashed (the others came from the stat cache, or are symlinks)
    reused: int = 0  # files whose digest the stat cache gave
    _index: dict[str, tuple[Entry, ...]] = field(default_factory=dict, repr=False, compare=False)

    def entries_of(self, digest: str) -> tuple[Entry, ...]:
        """The entries whose blob is `digest` (empty when the snapshot has none)."""
        if not self._index and self.manifest.entries:
            index: dict[str, list[Entry]] = defaultdict(list)
            for entry in self.manifest.entries:
                index[entry.digest].append(entry)
            self._index.update((d, tuple(es)) for d, es in index.items())
        return self._index.get(digest, ())

    def paths_of(self, digest: str) -> tuple[str, ...]:
        """The paths whose blob is `digest`."""
        return tuple(e.path for e in self.entries_of(digest))

    def read(self, digest: str) -> bytes:
        """The bytes of blob `digest`, read again from disk and checked against the digest.

        Raises:
            WorkspaceError: no file of the snapshot has that digest, or the file was changed or removed since.
        """
        entries = self.entries_of(digest)
        if not entries:
            raise WorkspaceError(f"workspace {self.root}: no file of this snapshot has blob {digest}", field="digest")
        entry = entries[0]
        path = os.path.join(self.root, entry.path)
        try:
            if entry.mode is Mode.SYMLINK:
                data = os.readlink(os.fsencode(path))
            else:
                with open(path, "rb", opener=_open) as f:
                    data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            raise self._gone(entry, "was removed") from None
        except OSError:  # a link where a file was (ELOOP), or a file where a link was (EINVAL)
            raise self._gone(entry, "was changed") from None
        if blob_digest(data) != digest:
            raise self._gone(entry, "was changed")
        return data

    def _gone(self, entry: Entry, what: str) -> WorkspaceError:
        return WorkspaceError(
            f"workspace {self.root}: {entry.path} {what} since the snapshot; launch again when it is quiet",
            field="path",
        )


def snapshot(root: Path, *, max_bytes: int, max_files: int, cache_dir: Path | None = None) -> Snapshot:
    """The snapshot of the folder `root`: refused over `max_bytes` or `max_files` before any file is read.

    `cache_dir` holds the stat cache (none when None: every file is read).

    Raises:
        WorkspaceTooLarge: the tree is over a bound; the message names its largest folders and the fix.
        WorkspaceError: `root` is not a folder, a path is not valid, a file cannot be read, or a file changed
            while it was read.
    """
    started_ns = time.time_ns()
    root = _folder(root)
    listing = list_files(root, stop_after=max_files)
    check_bounds(root, listing.files, max_bytes=max_bytes, max_files=max_files, complete=listing.git)
    cache = StatCache.load(cache_dir, root)
    entries, seen, hashed = _digest_all(root, listing.files, cache.lookup)
    if hashed or cache.hits != len(cache.trusted):
        cache.save(seen, started_ns)
    entries.sort(key=lambda e: e.path.encode("utf-8"))
    # no Manifest.of: a listing holds each path once, and no file lies under another
    return Snapshot(root, Manifest(tuple(entries)), listing.git, hashed=hashed, reused=cache.hits)


def _folder(root: Path) -> Path:
    try:
        resolved = Path(root).resolve(strict=True)
    except OSError as exc:
        raise WorkspaceError(f"workspace {root}: not found ({exc.strerror}); launch from an existing folder") from exc
    if not resolved.is_dir():
        raise WorkspaceError(f"workspace {root}: not a folder; launch from a folder, or with workspace shared")
    return resolved


def _digest_all(
    root: Path, files: list[tuple[str, os.stat_result]], lookup: Callable[[str, StatKey], str | None]
) -> tuple[list[Entry], dict[str, tuple[StatKey, str]], int]:
    """The entries of `files`, the (stat, digest) of each regular file for the cache, and how many were read."""
    entries: list[Entry] = []
    seen: dict[str, tuple[StatKey, str]] = {}
    hashed = 0
    is_lnk = stat.S_ISLNK
    modes: dict[int, Mode] = {}  # Mode.of by st_mode, once per distinct st_mode: it costs per file otherwise
    for rel, st in files:
        if is_lnk(st.st_mode):
            target = _link_target(root, rel, st)
            entries.append(Entry(rel, Mode.SYMLINK, len(target), blob_digest(target)))
            continue
        key, st_mode = stat_key(st), st.st_mode
        digest = lookup(rel, key)
        if digest is None:
            found = _hash_stable(root, rel, st)
            if found is None:
                continue  # removed since it was listed
            now, digest = found  # its stat once read: it may have changed once, and been read again
            key, st_mode = stat_key(now), now.st_mode
            hashed += 1
        seen[rel] = (key, digest)
        mode = modes.get(st_mode)
        if mode is None:
            mode = modes[st_mode] = Mode.of(st_mode)
        entries.append(Entry(rel, mode, key[0], digest))
    return entries, seen, hashed


def _changed_error(root: Path, rel: str) -> WorkspaceError:
    return WorkspaceError(
        f"workspace {root}: {rel} changed while it was read; launch again when it is quiet, or {IGNORE_FIX}",
        field="path",
    )


def _link_target(root: Path, rel: str, st: os.stat_result) -> bytes:
    """A symlink's target bytes (never followed), read again once if the link changed meanwhile."""
    path = os.fsencode(os.path.join(root, rel))
    for _ in range(2):
        try:
            target = os.readlink(path)
        except OSError:
            target = None
        if target is not None and len(target) == st.st_size:
            return target
        try:
            st = os.lstat(path)
        except OSError:
            break
        if not stat.S_ISLNK(st.st_mode):
            break
    raise _changed_error(root, rel)


def _hash_stable(root: Path, rel: str, st: os.stat_result) -> tuple[os.stat_result, str] | None:
    """(stat, digest) of a regular file, read once more if it changed while read; None if it is gone."""
    path = os.path.join(root, rel)
    for attempt in range(2):
        try:
            return st, _hash_file(path, st)
        except _Changed:
            pass
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise WorkspaceError(
                f"workspace {root}: {rel} cannot be read ({exc.strerror}); make it readable, or {IGNORE_FIX}",
                field="path",
                cause=exc,
            ) from exc
        if attempt == 0:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return None
            if not stat.S_ISREG(st.st_mode):
                break
    raise _changed_error(root, rel)


def _open(path: str, flags: int) -> int:
    return os.open(path, flags | _OPEN_FLAGS)


def _hash_file(path: str, st: os.stat_result) -> str:
    """The SHA-256 of a regular file whose lstat was `st`.

    Raises:
        _Changed: the file is not the one `st` describes any more, or changed while it was read.
        OSError: it cannot be opened (FileNotFoundError: it is gone).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == getattr(os, "ELOOP", 40) or isinstance(exc, IsADirectoryError):
            raise _Changed from exc  # a link or folder now stands where the file was
        raise
    try:
        size = st.st_size
        if size <= CHUNK:
            data = os.read(fd, size + 1)
            while 0 < len(data) <= size:  # a short read: read on to the end (or past the size)
                more = os.read(fd, size + 1 - len(data))
                if not more:
                    break
                data += more
            digest, read = hashlib.sha256(data), len(data)
        else:
            digest, read = _hash_chunks(fd, size)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if read != size or stat_key(after)[:4] != stat_key(st)[:4] or not stat.S_ISREG(after.st_mode):
        raise _Changed
    return digest.hexdigest()


def _hash_chunks(fd: int, size: int) -> tuple[hashlib._Hash, int]:
    """The SHA-256 of a file read in `CHUNK` reads, and the bytes read (stopping once past `size`)."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    read = 0
    with open(fd, "rb", buffering=0, closefd=False) as f:
        while read <= size:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            read += n
    return digest, read


def check_bounds(
    root: Path, files: list[tuple[str, os.stat_result]], *, max_bytes: int, max_files: int, complete: bool = True
) -> None:
    """Refuse a tree over `max_bytes` or `max_files` (`complete`: the listing was not cut short).

    Raises:
        WorkspaceTooLarge: it is over; the message names the largest top-level folders and the fix.
    """
    total = sum(st.st_size for _, st in files)
    if len(files) <= max_files and total <= max_bytes:
        return
    by_files = total <= max_bytes  # over the file bound only: the folders with most files are the ones to name
    sizes = folder_sizes(files)
    largest = sorted(sizes, key=lambda s: (s[2], s[1]) if by_files else (s[1], s[2]), reverse=True)[:LARGEST_SHOWN]
    counted = f"{len(files):,} files" if complete or len(files) <= max_files else f"over {max_files:,} files"
    named = ", ".join(f"{_name(folder)} ({_human(size)}, {n:,} files)" for folder, size, n in largest)
    raise WorkspaceTooLarge(
        f"workspace {root}: {counted} of {_human(total)} is over the bounds of a snapshot workspace "
        f"({max_files:,} files, {_human(max_bytes)}: FORKQ_WORKSPACE_MAX_FILES, FORKQ_WORKSPACE_MAX_BYTES); "
        f"the largest folders: {named}; add them to .forkqignore (or .gitignore), or launch with workspace shared",
        largest=largest,
    )


def folder_sizes(files: list[tuple[str, os.stat_result]]) -> list[tuple[str, int, int]]:
    """(top-level folder, bytes, files) for each top-level folder of `files` ("." for the files at the top)."""
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for rel, st in files:
        top = rel.split("/", 1)[0] if "/" in rel else TOP_FILES
        sizes[top][0] += st.st_size
        sizes[top][1] += 1
    return [(folder, size, n) for folder, (size, n) in sizes.items()]


def _name(folder: str) -> str:
    return "the files at the top" if folder == TOP_FILES else folder + "/"


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"

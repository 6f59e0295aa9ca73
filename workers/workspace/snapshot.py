"""A launch's snapshot of the parent's folder: every file's path, mode, size and SHA-256, read once.

`snapshot(root, max_bytes=, max_files=, cache_dir=)` lists the folder (workers.workspace.listing: git's
listing in a git work tree, else a walk minus `.forkqignore`), refuses a tree over the bounds from the
listing and the files' stat alone, before any file is read, then digests every file. A file whose stat
matches the launcher's stat cache (workers.workspace.statcache) is not read again, so a launch of an
unchanged tree reads no file; and a tracked file git finds unchanged since its index whose blob's digest
the cache knows is not even stat'ed. The others are read in 1 MiB chunks, by a few threads when there are
many bytes. Symlinks stay links: their blob is the target's bytes, as git stores it, and nothing is
followed.

A file that changes while it is read (its size, mtime, ctime or inode after the read differ from before,
or it holds more or fewer bytes than its size) is read once more; a second change is an error naming it.
The bytes of the files read, up to `keep_bytes` in all, go to the caller's `on_read` as they are read (a launch
stores them meanwhile), or are kept for `Snapshot.read`: either way a first launch reads and hashes each byte
once, and they are the bytes the digest was computed from, between the two stats that showed no change. Any
other file is read again by `Snapshot.read` and checked against the digest, so a file changed since the snapshot
is an error, never a blob under the wrong digest.

In a git work tree whose git answers and stat'ed files are as at the last launch (workers.workspace.quick), the
snapshot is that launch's manifest, by its digest, with no entry built (`Snapshot.quick`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Final, NoReturn

from workers.base.collector import collector_paused
from workers.errors import WorkspaceError, WorkspaceTooLarge
from workers.workspace import quick
from workers.workspace.listing import IGNORE_FIX, GitRun, Listing, list_files, stat_files
from workers.workspace.manifest import Entry, Manifest, Mode, blob_digest
from workers.workspace.statcache import RACY_NS, StatCache

CHUNK: Final = 1 << 20  # bytes one read takes: a large file is hashed in bounded memory
PARALLEL_BYTES: Final = 8 << 20  # files to read worth more than this are read by threads
HASH_THREADS: Final = 4
KEEP_BYTES: Final = 128 << 20  # bytes of the files it read a snapshot keeps for `Snapshot.read` (the rest: read again)
BATCH_FILES: Final = 64  # files one thread's task reads
LARGEST_SHOWN: Final = 5  # folders a refusal names
TOP_FILES: Final = "."  # the folder name a refusal gives the files at the top of the tree
GIT_MODES: Final = {"100644": Mode.FILE, "100755": Mode.EXECUTABLE, "120000": Mode.SYMLINK}
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a fifo swapped in must not block


class _Changed(Exception):
    """A file's bytes or stat changed while it was read."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A folder's files as a manifest, and the way back from a digest to the bytes on disk."""

    root: Path  # the folder snapshotted, absolute and resolved
    digest: str  # the manifest's
    git: bool  # the folder lies in a git work tree and git listed its files
    hashed: int = 0  # files read and hashed (the others came from the stat cache or git, or are symlinks)
    reused: int = 0  # files whose digest the stat cache gave (stat'ed, not read)
    from_git: int = 0  # files git found unchanged, whose blob's digest the cache gave (neither stat'ed nor read)
    quick: bool = False  # the tree was the last snapshot's (workers.workspace.quick): no entry was built
    _manifest: list[Manifest] = field(default_factory=list, repr=False, compare=False)  # [] until decoded
    _encoded: bytes = field(default=b"", repr=False, compare=False)  # the manifest's bytes
    _index: dict[str, tuple[Entry, ...]] = field(default_factory=dict, repr=False, compare=False)
    _kept: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)  # digest → the bytes hashed

    @property
    def manifest(self) -> Manifest:
        """The manifest (a quick snapshot's is decoded on first use)."""
        if not self._manifest:
            self._manifest.append(Manifest.decode(self._encoded, what=f"the launch record of {self.root}"))
        return self._manifest[0]

    @property
    def encoded(self) -> bytes:
        """The manifest's canonical bytes (whose SHA-256 is `digest`)."""
        return self._encoded

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
        """The bytes of blob `digest`, checked against the digest: the ones the snapshot hashed if it kept them
        (handed out once, then forgotten), else read again from disk and hashed.

        Raises:
            WorkspaceError: no file of the snapshot has that digest, or the file was changed or removed since.
        """
        kept = self._kept.pop(digest, None)
        if kept is not None:
            return kept
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


def snapshot(
    root: Path,
    *,
    max_bytes: int,
    max_files: int,
    cache_dir: Path | None = None,
    keep_bytes: int = KEEP_BYTES,
    on_read: OnRead | None = None,
) -> Snapshot:
    """The snapshot of the folder `root`: refused over `max_bytes` or `max_files` before any file is read.

    `cache_dir` holds the stat cache (none when None: every file is read). The bytes of the files read, up to
    `keep_bytes`, are kept for `Snapshot.read`; or, with `on_read`, handed to it batch by batch as they are read
    (digests checked: a store may take them as they are), while the next ones are read, and not kept.

    Raises:
        WorkspaceTooLarge: the tree is over a bound; the message names its largest folders and the fix.
        WorkspaceError: `root` is not a folder, a path is not valid, a file cannot be read, or a file changed
            while it was read.
    """
    # a snapshot makes a few objects per file and no cycles; in a launcher whose heap is large, the collections so
    # many allocations set off scan all of it, and cost a launch of 10,000 files some 30-60 ms (more than listing)
    with collector_paused():
        return _snapshot(
            root, max_bytes=max_bytes, max_files=max_files, cache_dir=cache_dir, keep_bytes=keep_bytes, on_read=on_read
        )


def _snapshot(
    root: Path, *, max_bytes: int, max_files: int, cache_dir: Path | None, keep_bytes: int, on_read: OnRead | None
) -> Snapshot:
    started_ns = time.time_ns()
    root = _folder(root)
    if cache_dir is None:
        cache, listing = StatCache(None), list_files(root, stop_after=max_files)
    else:
        found = _listed(root, cache_dir, max_bytes=max_bytes, max_files=max_files)
        if isinstance(found, Snapshot):
            return found
        cache, listing = found
    entries, unknown = _known_blobs(listing.unchanged, cache)
    files = listing.files + stat_files(root, list(unknown)) if unknown else listing.files
    total = sum(e.size for e in entries) + sum(st.st_size for _, st in files)
    if len(entries) + len(files) > max_files or total > max_bytes:
        sizes = [(e.path, e.size) for e in entries] + [(rel, st.st_size) for rel, st in files]
        refuse(root, sizes, max_bytes=max_bytes, max_files=max_files, complete=listing.git)
    kept: dict[str, bytes] = {}
    read = _digest_all(root, files, cache, kept, keep_bytes=keep_bytes, on_read=on_read)
    if unknown:
        read = _with_git_modes(read, unknown)
        _learn_blobs(cache, unknown, started_ns)
    entries += read
    cache.save(started_ns)
    entries.sort(key=attrgetter("path"))  # code point order is UTF-8 byte order: the manifest's order
    # no Manifest.of: a listing holds each path once, and no file lies under another
    manifest = Manifest(tuple(entries))
    stated = _stated(files, unknown, cache)
    encoded = manifest.encode()
    digest = blob_digest(encoded)
    _remember(
        cache_dir,
        root,
        key=listing.key,
        files=stated,
        started_ns=started_ns,
        manifest=manifest,
        encoded=encoded,
        digest=digest,
    )
    return Snapshot(
        root,
        digest,
        listing.git,
        hashed=cache.added,
        reused=cache.hits,
        from_git=cache.blob_hits,
        _manifest=[manifest],
        _encoded=encoded,
        _kept=kept,
    )


def _listed(root: Path, cache_dir: Path, *, max_bytes: int, max_files: int) -> Snapshot | tuple[StatCache, Listing]:
    """The quick snapshot of `root` if its launch record holds (workers.workspace.quick), else its stat cache and
    listing. git runs while the record is read; the stat cache, which costs more to decode, is read while git runs
    when there is no record."""
    run = GitRun.start(root)
    record = quick.load(cache_dir, root) if run is not None else None
    if run is None or record is None:
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(StatCache.load, cache_dir, root)
            git = run.finish() if run is not None else None
            cache = loading.result()
    else:
        git = run.finish()
        if record.files <= max_files and record.total_bytes <= max_bytes and record.holds(root, git.key):
            return Snapshot(root, record.digest, git=True, quick=True, _encoded=record.manifest)
        cache = StatCache.load(cache_dir, root)
    return cache, list_files(root, stop_after=max_files, git=git)


def _remember(
    cache_dir: Path | None,
    root: Path,
    *,
    key: str | None,
    files: list[tuple[str, os.stat_result]],
    started_ns: int,
    manifest: Manifest,
    encoded: bytes,
    digest: str,
) -> None:
    """Keep the launch record of this snapshot of a git tree (`key`: its git answers'; `encoded`: the manifest's
    bytes, `digest` their SHA-256) in `cache_dir`, for the next launch's shortcut; forget it when the tree was
    walked or git failed."""
    if cache_dir is None or key is None:
        if cache_dir is not None:
            quick.forget(cache_dir, root)
        return
    stats = [quick.stat_row(rel, st) for rel, st in files]
    record = quick.LaunchRecord(key, started_ns, stats, digest, len(manifest), manifest.total_bytes, encoded)
    quick.save(cache_dir, root, record)


def _stated(
    files: list[tuple[str, os.stat_result]], unknown: dict[str, tuple[str, str]], cache: StatCache
) -> list[tuple[str, os.stat_result]]:
    """The files a launch record must stat: all that were stat'ed, but the tracked ones whose blob was learned (git's
    answers name their blob ids)."""
    learned = {rel for rel, (blob_id, _) in unknown.items() if blob_id in cache.found_blobs}
    return [f for f in files if f[0] not in learned] if learned else files


def _known_blobs(
    unchanged: list[tuple[str, str, str]], cache: StatCache
) -> tuple[list[Entry], dict[str, tuple[str, str]]]:
    """The entries of the files git found unchanged whose blob's digest the cache knows, and the (blob id, git mode)
    of the others by path: those are stat'ed and read like any file."""
    entries: list[Entry] = []
    unknown: dict[str, tuple[str, str]] = {}
    blobs, used = cache.blobs, cache.found_blobs  # StatCache.by_blob, inlined: this loop runs once per file
    for rel, git_mode, blob_id in unchanged:
        known = blobs.get(blob_id)
        if known is None:
            unknown[rel] = (blob_id, git_mode)
        else:
            used[blob_id] = known
            entries.append(Entry(rel, GIT_MODES[git_mode], known[1], known[2]))
    cache.blob_hits += len(entries)
    return entries, unknown


def _with_git_modes(entries: list[Entry], unknown: dict[str, tuple[str, str]]) -> list[Entry]:
    """`entries` with git's mode for the tracked files git found unchanged: the mode their entry has once their blob
    is known (they differ where git ignores the disk's modes: core.fileMode or core.symlinks false)."""
    out = []
    for entry in entries:
        known = unknown.get(entry.path)
        if known is not None and GIT_MODES[known[1]] is not entry.mode:
            entry = Entry(entry.path, GIT_MODES[known[1]], entry.size, entry.digest)  # noqa: PLW2901
        out.append(entry)
    return out


def _learn_blobs(cache: StatCache, unknown: dict[str, tuple[str, str]], started_ns: int) -> None:
    """Record the digest of each git blob read this time, if the file surely held that blob when it was read.

    git found the file unchanged since its index after this snapshot started; the stat it was read with shows no
    write (mtime) nor replacement or attribute change (ctime) since the racy window before that: so it still held
    the blob when it was read. A symlink is not recorded: reading it again costs what a lookup does.
    """
    limit = started_ns - RACY_NS
    for rel, (blob_id, _) in unknown.items():
        e = cache.found.get(rel)
        if e is not None and e[2] < limit and e[3] < limit:
            cache.learn(blob_id, e[1], e[6])


def _folder(root: Path) -> Path:
    try:
        resolved = Path(root).resolve(strict=True)
    except OSError as exc:
        raise WorkspaceError(f"workspace {root}: not found ({exc.strerror}); launch from an existing folder") from exc
    if not resolved.is_dir():
        raise WorkspaceError(f"workspace {root}: not a folder; launch from a folder, or with workspace shared")
    return resolved


def _digest_all(
    root: Path,
    files: list[tuple[str, os.stat_result]],
    cache: StatCache,
    kept: dict[str, bytes],
    *,
    keep_bytes: int,
    on_read: OnRead | None,
) -> list[Entry]:
    """The entries of `files`: digests from the stat cache, else read (and added to it); the bytes of the ones read,
    while they fit in `keep_bytes`, go to `on_read` as they are read, else to `kept` (digest → bytes)."""
    entries: list[Entry] = []
    misses: list[tuple[str, os.stat_result]] = []
    modes: dict[int, Mode] = {}  # Mode.of once per distinct st_mode: it costs per file otherwise
    is_lnk, lookup = stat.S_ISLNK, cache.lookup
    for rel, st in files:
        st_mode = st.st_mode
        if is_lnk(st_mode):
            target = _link_target(root, rel, st)
            entries.append(Entry(rel, Mode.SYMLINK, len(target), blob_digest(target)))
            continue
        digest = lookup(rel, st)
        if digest is None:
            misses.append((rel, st))
            continue
        mode = modes.get(st_mode)
        if mode is None:
            mode = modes[st_mode] = Mode.of(st_mode)
        entries.append(Entry(rel, mode, st.st_size, digest))
    keep, budget = [], keep_bytes
    for _, st in misses:  # decided before reading: the same files whichever thread reads them
        keep.append(st.st_size <= budget)
        budget -= st.st_size if keep[-1] else 0
    done = 0
    for batch in _hash_all(root, misses, keep):
        read: list[tuple[str, bytes]] = []
        for (rel, _), found in zip(misses[done : done + len(batch)], batch, strict=True):
            if found is not None:  # else removed since it was listed
                now, digest, data = found  # its stat once read: it may have changed once, and been read again
                if data is not None:
                    read.append((digest, data))
                cache.add(rel, now, digest)
                mode = modes.get(now.st_mode)
                if mode is None:
                    mode = modes[now.st_mode] = Mode.of(now.st_mode)
                entries.append(Entry(rel, mode, now.st_size, digest))
        done += len(batch)
        if on_read is None:
            kept.update(read)
        elif read:
            on_read(read)  # while the threads read on
    return entries


Hashed = tuple[os.stat_result, str, bytes | None]  # a file's stat once read, its digest, its bytes if kept
OnRead = Callable[[list[tuple[str, bytes]]], None]  # (digest, bytes) of files just read, as checked


def _hash_all(root: Path, files: list[tuple[str, os.stat_result]], keep: list[bool]) -> Iterator[list[Hashed | None]]:
    """`_hash_stable` of each file (keeping its bytes where `keep` says), batch after batch in the files' order: by a
    few threads when there are many bytes (reads and SHA-256 of more than 2 KiB release the GIL), in batches so that
    a small file does not cost a future of its own; the threads read on while the caller handles a batch."""
    if len(files) < 2 or sum(st.st_size for _, st in files) < PARALLEL_BYTES:
        yield [_hash_stable(root, rel, st, k) for (rel, st), k in zip(files, keep, strict=True)]
        return
    tasks = list(zip(files, keep, strict=True))
    batches = [tasks[i : i + BATCH_FILES] for i in range(0, len(tasks), BATCH_FILES)]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        yield from pool.map(lambda batch: [_hash_stable(root, rel, st, k) for (rel, st), k in batch], batches)


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


def _hash_stable(root: Path, rel: str, st: os.stat_result, keep: bool = False) -> Hashed | None:
    """(stat, digest, bytes if `keep`) of a regular file, read once more if it changed while read; None if it is
    gone."""
    path = os.path.join(root, rel)
    for attempt in range(2):
        try:
            return st, *_hash_file(path, st, keep)
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


def _hash_file(path: str, st: os.stat_result, keep: bool = False) -> tuple[str, bytes | None]:
    """The SHA-256 of a regular file whose lstat was `st`, and its bytes if `keep` (read whole, not in chunks).

    Raises:
        _Changed: the file is not the one `st` describes any more, or changed while it was read.
        OSError: it cannot be opened (FileNotFoundError: it is gone).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP or isinstance(exc, IsADirectoryError):
            raise _Changed from exc  # a link or folder now stands where the file was
        raise
    try:
        size, data = st.st_size, None
        if size <= CHUNK or keep:
            data = os.read(fd, size + 1)
            # a short read: read on to the size (or past it). A read of all `size` bytes needs no read at the end: a
            # file that grew or was written meanwhile has another size, mtime or ctime in the fstat below
            while 0 < len(data) < size:
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
    if read != size or _version(after) != _version(st) or not stat.S_ISREG(after.st_mode):
        raise _Changed
    return digest.hexdigest(), data if keep else None


def _version(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a file is written or replaced."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


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


def refuse(
    root: Path, files: list[tuple[str, int]], *, max_bytes: int, max_files: int, complete: bool = True
) -> NoReturn:
    """Refuse a tree of `files` (path, size) over `max_bytes` or `max_files` (`complete`: the listing was not cut
    short, else there are more files).

    Raises:
        WorkspaceTooLarge: always; the message names the largest top-level folders and the fix.
    """
    total = sum(size for _, size in files)
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


def folder_sizes(files: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(top-level folder, bytes, files) for each top-level folder of `files` (path, size); "." for the files at
    the top."""
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for rel, size in files:
        top = rel.split("/", 1)[0] if "/" in rel else TOP_FILES
        sizes[top][0] += size
        sizes[top][1] += 1
    return [(folder, size, n) for folder, (size, n) in sizes.items()]


def _name(folder: str) -> str:
    return "the files at the top" if folder == TOP_FILES else folder + "/"


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"

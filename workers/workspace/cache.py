"""A worker's bounded local cache of workspace blobs: one read-only file per digest, least recently used evicted.

Layout: `<directory>/<first two hex digits>/<digest>`, written in place and entered in the index once whole (a
file a crash cut short is found at start, and fails verification at its first use). The index (digest → size, in
order of use) lives in memory, behind one lock, because one worker process builds many forks' trees at once from
threads; at start it is read from the folder, oldest modification first (use is not recorded on disk: a restart
forgets the order of use, not the blobs). A build holds the digests it copies from (`hold`), so no other thread
evicts them mid-copy, and a blob being written counts against the bound already.

The cache trusts nothing it reads back: a build verifies every cached file against its digest as it copies it,
and a file that fails is dropped and fetched again (`discard`). Files are mode 0o444 in a 0o700 folder, and a
build copies them (never links them), so nothing a fork does to its tree reaches the cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from workers.errors import RecordIntegrityError, WorkspaceError
from workers.workspace.manifest import blob_digest, is_digest

log = logging.getLogger("forkq.workspace")

DEFERRED_MAX_BYTES: Final = 128 * 1024 * 1024  # blobs waiting for the background writer; past it, written at once
Fetch = Callable[[Sequence[str]], Iterable[tuple[str, bytes]]]
"""Blobs by digest, e.g. `BlobStore.get`: called once with every digest wanted, yields `(digest, bytes)`."""


def fetch_verified(fetch: Fetch, digests: Sequence[str], *, trusted: bool = False) -> Iterator[tuple[str, bytes]]:
    """`fetch(digests)` (one call for all of them), each blob checked against its digest, and every digest given.
    `trusted`: the fetch verifies every blob itself (as `BlobStore.get` does), so each is hashed once, not twice;
    that every digest comes once, and no other, is still checked.

    Raises:
        RecordIntegrityError: a blob's bytes do not have its digest.
        WorkspaceError: `fetch` gave a digest that was not asked for, or left one out.
    """
    wanted = set(digests)
    for digest, data in fetch(digests):
        if digest not in wanted:
            raise WorkspaceError(f"workspace blob {digest}: fetched but not asked for (or fetched twice)")
        actual = digest if trusted else blob_digest(data)
        if actual != digest:
            raise RecordIntegrityError(
                f"workspace blob {digest}: the fetched bytes have digest {actual}; the blob store holds damaged "
                "data, launch the fork again to upload the file"
            )
        wanted.discard(digest)
        yield digest, data
    if wanted:
        raise WorkspaceError(
            f"workspace blobs {', '.join(sorted(wanted)[:3])}{' ...' if len(wanted) > 3 else ''}: the blob store "
            f"did not return {len(wanted)} of them; launch the fork again to upload its files"
        )


class WorkspaceCache:
    """A worker's bounded local cache of blobs (files named by digest under `directory`), least recently used
    evicted first; safe to share between threads. With `deferred`, `put_later` leaves the writing to a background
    thread, so a build's critical path creates the tree's files only."""

    def __init__(self, directory: Path, max_bytes: int, *, deferred: bool = False) -> None:
        if max_bytes < 0:
            raise WorkspaceError(f"workspace cache {directory}: max_bytes {max_bytes} is negative; give 0 or more")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._root = os.path.abspath(directory)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._held: dict[str, int] = {}  # digest → how many builds copy from it now: never evicted meanwhile
        self._writing: set[str] = set()  # digests being written now, their bytes already counted in _used
        self._writing_bytes = 0
        self._held_bytes = 0  # the bytes of the cached blobs in _held
        self._used = 0
        self.deferred = deferred
        self._later: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._later_bytes = 0  # bytes in _later, at most DEFERRED_MAX_BYTES
        self._writer: threading.Thread | None = None
        os.makedirs(self._root, mode=0o700, exist_ok=True)
        for prefix in range(256):  # every folder a blob can go to, made once
            with contextlib.suppress(FileExistsError):
                os.mkdir(f"{self._root}/{prefix:02x}", 0o700)
        self._load()

    def _load(self) -> None:
        found: list[tuple[float, str, int]] = []
        for sub in os.scandir(self._root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for item in os.scandir(sub.path):
                info = item.stat(follow_symlinks=False)
                if is_digest(item.name) and item.name[:2] == sub.name and item.is_file(follow_symlinks=False):
                    # a file a crash cut short is kept: every read verifies it, and drops it then
                    found.append((info.st_mtime, item.name, info.st_size))
                else:  # a stranger: not ours to keep
                    with contextlib.suppress(OSError):
                        os.unlink(item.path)
        with self._lock:
            for _, digest, size in sorted(found):
                self._sizes[digest] = size
                self._used += size
            self._make_room(0)  # the bound may have been lowered since the files were written

    @property
    def used_bytes(self) -> int:
        """The bytes of the blobs held now (at most `max_bytes`)."""
        with self._lock:
            return self._used

    def _file(self, digest: str) -> str:
        return f"{self._root}/{digest[:2]}/{digest}"

    def path(self, digest: str) -> Path | None:
        """The file of blob `digest` (marked as just used), or None when it is not cached."""
        with self._lock:
            if digest not in self._sizes:
                return None
            self._sizes.move_to_end(digest)
        return Path(self._file(digest))

    def ensure(self, digests: Iterable[str], fetch: Fetch) -> None:
        """Fetch the blobs of `digests` that are not cached (one call of `fetch`), verify and store them; blobs
        larger than the cache's room are verified but not kept.

        Raises:
            RecordIntegrityError: a fetched blob's bytes do not have its digest; nothing of it was stored.
            WorkspaceError: `fetch` did not return a blob.
        """
        with self._lock:
            missing = [d for d in dict.fromkeys(digests) if d not in self._sizes]
        if missing:
            for digest, data in fetch_verified(fetch, missing):
                self.put(digest, data)

    def put(self, digest: str, data: bytes) -> bool:
        """Store `data`, whose digest the caller verified (see `fetch_verified`); whether the cache holds it now (a
        blob that does not fit beside the blobs builds hold is not kept)."""
        size = len(data)
        if size > self.max_bytes:
            return False
        with self._lock:
            if digest in self._sizes or digest in self._writing:
                return digest in self._sizes
            if not self._make_room(size):
                return False
            self._writing.add(digest)
            self._writing_bytes += size
            self._used += size  # counted while written: other threads keep the bound
        target = self._file(digest)
        try:
            _write_new(target, data)
        except BaseException:
            with self._lock:
                self._writing.discard(digest)
                self._writing_bytes -= size
                self._used -= size
            with contextlib.suppress(OSError):
                os.unlink(target)
            raise
        with self._lock:
            self._writing.discard(digest)
            self._writing_bytes -= size
            self._sizes[digest] = size
            if digest in self._held:  # held by a build that found it damaged or missing, and fetched it again
                self._held_bytes += size
        return True

    def put_later(self, digest: str, data: bytes) -> None:
        """`put`, by the background writer when the cache is `deferred` and fewer than DEFERRED_MAX_BYTES wait
        already, else now; `flush` waits for the writer. A write that fails only costs a later fetch (logged)."""
        size = len(data)
        with self._lock:
            if digest in self._sizes or digest in self._writing or size > self.max_bytes:
                return
            later = self.deferred and self._later_bytes + size <= DEFERRED_MAX_BYTES
            if later:
                self._later_bytes += size
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_later, name="forkq-cache-writer", daemon=True)
                    self._writer.start()
        if later:
            self._later.put((digest, data))
        else:
            self.put(digest, data)

    def _write_later(self) -> None:
        """The background writer: stores the blobs `put_later` queued, one at a time, for the process's life."""
        while True:
            digest, data = self._later.get()
            try:
                self.put(digest, data)
            except OSError as exc:  # a full or broken disk: the blob is fetched again when next needed
                log.warning("workspace cache %s: blob %s not stored: %s", self._root, digest, exc)
            finally:
                with self._lock:
                    self._later_bytes -= len(data)
                self._later.task_done()

    def flush(self) -> None:
        """Wait until the blobs `put_later` queued are stored (or given up)."""
        self._later.join()

    def _make_room(self, size: int) -> bool:
        """Evict unheld blobs, least recently used first, until `size` more bytes fit; whether they do (lock held).
        Nothing is evicted when the held blobs and those being written leave no room anyway."""
        if self._used + size <= self.max_bytes:
            return True
        if self._held_bytes + self._writing_bytes + size > self.max_bytes:
            return False
        victims: list[str] = []
        freed = 0
        for digest, stored in self._sizes.items():  # least recently used first; held blobs were moved to the end
            if digest not in self._held:
                victims.append(digest)
                freed += stored
                if self._used - freed + size <= self.max_bytes:
                    break
        for digest in victims:
            self._drop(digest)
        return True

    def _drop(self, digest: str) -> None:
        size = self._sizes.pop(digest)
        self._used -= size
        if digest in self._held:
            self._held_bytes -= size
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(digest))

    def discard(self, digest: str) -> None:
        """Forget blob `digest` and remove its file (it failed verification, or vanished)."""
        with self._lock:
            if digest in self._sizes:
                self._drop(digest)

    @contextlib.contextmanager
    def hold(self, digests: Iterable[str]) -> Iterator[dict[str, str]]:
        """The files of the cached blobs among `digests`, kept from eviction until the block ends."""
        with self._lock:
            held = {d: self._file(d) for d in dict.fromkeys(digests) if d in self._sizes}
            for digest in held:
                self._sizes.move_to_end(digest)
                if digest not in self._held:
                    self._held_bytes += self._sizes[digest]
                self._held[digest] = self._held.get(digest, 0) + 1
        try:
            yield held
        finally:
            with self._lock:
                for digest in held:
                    left = self._held.pop(digest) - 1
                    if left:
                        self._held[digest] = left
                    elif digest in self._sizes:
                        self._held_bytes -= self._sizes[digest]


def _write_new(path: str, data: bytes) -> None:
    """Write a cache file, read-only from the start; the name is free (a blob is written by one thread at a time,
    and a file is unlinked when its blob leaves the index), else left by a crash: replaced."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o444)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, 0o444)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)

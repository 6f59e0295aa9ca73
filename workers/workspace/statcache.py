"""The launcher's stat cache: a file's digest by its stat, so a launch of an unchanged tree reads no file.

One cache file per snapshotted folder, named by the SHA-256 of the folder's absolute path, in the folder
the caller gives (a launcher's cache folder). It holds, for each file of the last snapshot, its size,
mtime and ctime (ns), inode and device, and the SHA-256 of its bytes: a file whose stat is the same is
taken to hold the same bytes, as git's index does. The file is the SHA-256 of the rest, then canonical
msgpack (workers.base.codec) `{schema_version, started_ns, entries: [[path, size, mtime, ctime, inode, device,
digest], ...], blobs: [[blob id, size, digest], ...]}`, replaced atomically (a temporary file, then
rename). It holds only the last snapshot's files, so it is bounded by the workspace's file bound; a cache
folder keeps the `MAX_ROOTS` most recently written files.

It also holds the digest and size of git blobs by blob id: a file git finds unchanged since its index
holds its index blob, so its entry needs neither stat nor read once the blob's digest is known (see
workers.workspace.snapshot for when a digest is learned). A blob id names its content forever, so these
need no stat; the file keeps the ones the last snapshot used.

Racy timestamps, as git handles them: a file changed twice within one timestamp tick keeps its stat,
so an entry is trusted only when the file's mtime lies `RACY_NS` or more before the start of the
snapshot that wrote it (it was then surely not written again within the tick after it was read).
The others are hashed again next time. A cache that cannot be read or written is ignored: it only
saves time, so a launch never fails because of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from workers.base import codec
from workers.errors import RecordDecodeError

SCHEMA_VERSION: Final = 2
RACY_NS: Final = 2_000_000_000  # coarser than any file system's mtime tick (FAT's is 2 s)
MAX_ROOTS: Final = 64  # cache files one cache folder keeps (one per snapshotted folder)
SUFFIX: Final = ".statcache"
CHECKSUM_BYTES: Final = 32  # a cache file starts with the SHA-256 of the rest


def cache_file(cache_dir: Path, root: Path) -> Path:
    """The cache file of the folder `root` in `cache_dir`."""
    return cache_dir / (hashlib.sha256(os.fsencode(root)).hexdigest() + SUFFIX)


@dataclass(slots=True)
class StatCache:
    """The digests of one folder's files by path and stat: the last snapshot's, and the ones this one found."""

    path: Path | None  # None: no cache folder, nothing is kept
    known: dict[str, list[Any]] = field(default_factory=dict)  # path → [path, size, mtime, ctime, ino, dev, digest]
    limit_ns: int = 0  # an entry is trusted only if its mtime is before this (the racy window)
    found: dict[str, list[Any]] = field(default_factory=dict)  # this snapshot's entries, hits and added ones
    blobs: dict[str, list[Any]] = field(default_factory=dict)  # git blob id → [blob id, size, digest]
    found_blobs: dict[str, list[Any]] = field(default_factory=dict)  # the ones this snapshot used or learned
    hits: int = 0
    added: int = 0
    blob_hits: int = 0
    learned: int = 0

    def learn(self, blob_id: str, size: int, digest: str) -> None:
        """Record that git blob `blob_id` holds `size` bytes of digest `digest`."""
        self.learned += 1
        self.found_blobs[blob_id] = [blob_id, size, digest]

    def lookup(self, rel: str, st: os.stat_result) -> str | None:
        """The digest of `rel` if the cache holds it for exactly this stat (out of the racy window), else None."""
        e = self.known.get(rel)
        if (
            e is None
            or e[2] >= self.limit_ns
            or e[1] != st.st_size
            or e[2] != st.st_mtime_ns
            or e[3] != st.st_ctime_ns
            or e[4] != st.st_ino
            or e[5] != st.st_dev
        ):
            return None
        self.hits += 1
        self.found[rel] = e
        digest: str = e[6]
        return digest

    def add(self, rel: str, st: os.stat_result, digest: str) -> None:
        """Record the digest of `rel` as read with stat `st`."""
        self.added += 1
        self.found[rel] = [rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, digest]

    @classmethod
    def load(cls, cache_dir: Path | None, root: Path) -> StatCache:
        """The cache of `root` in `cache_dir` (empty when there is none, or it is unreadable)."""
        if cache_dir is None:
            return cls(None)
        path = cache_file(cache_dir, root)
        try:
            data = path.read_bytes()
        except OSError:
            return cls(path)
        known, blobs, started = _decode(data)
        return cls(path, known, limit_ns=started - RACY_NS, blobs=blobs)

    def save(self, started_ns: int) -> None:
        """Write this snapshot's entries, if they differ from the file's, as found by a snapshot started at
        `started_ns`. Entries still in the racy window are written too: a later snapshot may trust them."""
        if self.path is None or (
            not self.added
            and not self.learned
            and len(self.found) == len(self.known)
            and len(self.found_blobs) == len(self.blobs)
        ):
            return
        body = codec.encode(
            {
                "schema_version": SCHEMA_VERSION,
                "started_ns": started_ns,
                "entries": list(self.found.values()),
                "blobs": list(self.found_blobs.values()),
            }
        )
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists()
            tmp.write_bytes(hashlib.sha256(body).digest() + body)
            tmp.replace(self.path)
            if fresh:
                _prune(self.path.parent)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _decode(data: bytes) -> tuple[dict[str, list[Any]], dict[str, list[Any]], int]:
    """A cache file's entries by path and the start of the snapshot that wrote it; none if it is damaged or foreign
    (the checksum makes it safe to index entries unchecked after that)."""
    if len(data) < CHECKSUM_BYTES or hashlib.sha256(data[CHECKSUM_BYTES:]).digest() != data[:CHECKSUM_BYTES]:
        return {}, {}, 0
    try:
        raw = codec.decode(data[CHECKSUM_BYTES:], what="stat cache")
    except RecordDecodeError:
        return {}, {}, 0
    if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
        return {}, {}, 0
    entries, blobs, started = raw.get("entries"), raw.get("blobs"), raw.get("started_ns")
    if not isinstance(entries, list) or not isinstance(blobs, list) or not isinstance(started, int):
        return {}, {}, 0
    return {e[0]: e for e in entries}, {b[0]: b for b in blobs}, started


def _prune(cache_dir: Path) -> None:
    """Remove all but the `MAX_ROOTS` most recently written cache files of `cache_dir`."""
    found: list[tuple[int, Path]] = []
    for entry in os.scandir(cache_dir):
        if entry.name.endswith(SUFFIX):
            with contextlib.suppress(OSError):
                found.append((entry.stat().st_mtime_ns, Path(entry.path)))
    for _, path in sorted(found, reverse=True)[MAX_ROOTS:]:
        for each in (path, path.with_suffix(".launch")):  # and its folder's launch record (workers.workspace.quick)
            with contextlib.suppress(OSError):
                each.unlink()

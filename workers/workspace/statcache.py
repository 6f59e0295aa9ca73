"""The launcher's stat cache: a file's digest by its stat, so a launch of an unchanged tree reads no file.

One cache file per snapshotted folder, named by the SHA-256 of the folder's absolute path, in the folder
the caller gives (a launcher's cache folder). It holds, for each file of the last snapshot, its size,
mtime and ctime (ns), inode and device, and the SHA-256 of its bytes: a file whose stat is the same is
taken to hold the same bytes, as git's index does. The file is canonical msgpack (workers.base.codec),
replaced atomically (a temporary file, then rename), and holds only the last snapshot's files, so it is
bounded by the workspace's file bound; a cache folder keeps the `MAX_ROOTS` most recently written files.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from workers.base import codec
from workers.errors import RecordDecodeError

SCHEMA_VERSION: Final = 1
RACY_NS: Final = 2_000_000_000  # coarser than any file system's mtime tick (FAT's is 2 s)
MAX_ROOTS: Final = 64  # cache files one cache folder keeps (one per snapshotted folder)
SUFFIX: Final = ".statcache"

StatKey = tuple[int, int, int, int, int]  # size, mtime_ns, ctime_ns, inode, device


def stat_key(st: os.stat_result) -> StatKey:
    """What identifies a file's version in the cache."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def cache_file(cache_dir: Path, root: Path) -> Path:
    """The cache file of the folder `root` in `cache_dir`."""
    return cache_dir / (hashlib.sha256(os.fsencode(root)).hexdigest() + SUFFIX)


@dataclass(slots=True)
class StatCache:
    """The digests of one folder's files by path and stat, as the last snapshot of it found them."""

    path: Path | None  # None: no cache folder, nothing is kept
    trusted: dict[str, tuple[StatKey, str]] = field(default_factory=dict)
    hits: int = 0

    def lookup(self, rel: str, key: StatKey) -> str | None:
        """The digest of `rel` if the cache holds it for exactly this stat, else None."""
        found = self.trusted.get(rel)
        if found is None or found[0] != key:
            return None
        self.hits += 1
        return found[1]

    @classmethod
    def load(cls, cache_dir: Path | None, root: Path) -> StatCache:
        """The cache of `root` in `cache_dir` (empty when there is none, or it is unreadable)."""
        if cache_dir is None:
            return cls(None)
        path = cache_file(cache_dir, root)
        try:
            raw = codec.decode(path.read_bytes(), what=f"stat cache {path}")
        except (OSError, RecordDecodeError):
            return cls(path)
        return cls(path, _trusted_entries(raw))

    def save(self, files: Mapping[str, tuple[StatKey, str]], started_ns: int) -> None:
        """Replace the cache with `files` (path → (stat, digest)), found by a snapshot that started at `started_ns`.

        Entries not yet out of the racy window are written too: the next snapshot, started later, may trust them.
        """
        if self.path is None:
            return
        body = {
            "schema_version": SCHEMA_VERSION,
            "started_ns": started_ns,
            "entries": [[rel, *key, digest] for rel, (key, digest) in files.items()],
        }
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists()
            tmp.write_bytes(codec.encode(body))
            tmp.replace(self.path)
            if fresh:
                _prune(self.path.parent)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _trusted_entries(raw: Any) -> dict[str, tuple[StatKey, str]]:
    """The entries of a decoded cache file that are out of the racy window (none if it is malformed)."""
    if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
        return {}
    started, entries = raw.get("started_ns"), raw.get("entries")
    if not isinstance(started, int) or not isinstance(entries, list):
        return {}
    trusted: dict[str, tuple[StatKey, str]] = {}
    limit = started - RACY_NS
    for item in entries:
        if not isinstance(item, list) or len(item) != 7:
            return {}
        rel, size, mtime, ctime, ino, dev, digest = item
        if mtime < limit and isinstance(digest, str):
            trusted[rel] = ((size, mtime, ctime, ino, dev), digest)
    return trusted


def _prune(cache_dir: Path) -> None:
    """Remove all but the `MAX_ROOTS` most recently written cache files of `cache_dir`."""
    found: list[tuple[int, Path]] = []
    for entry in os.scandir(cache_dir):
        if entry.name.endswith(SUFFIX):
            with contextlib.suppress(OSError):
                found.append((entry.stat().st_mtime_ns, Path(entry.path)))
    for _, path in sorted(found, reverse=True)[MAX_ROOTS:]:
        with contextlib.suppress(OSError):
            path.unlink()

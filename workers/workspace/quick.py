"""A sibling launch's shortcut: a git tree whose listing and stat'ed files are as last time has last time's manifest.

After a snapshot of a git work tree, the launcher's cache folder keeps one record per folder (next to its stat
cache, workers.workspace.statcache): the key of git's two answers (`GitOutput.key`: the SHA-256 of `git
ls-files -s -v` and `git diff-files`), the lstat of every file the snapshot stat'ed (untracked files, tracked ones
git found changed or does not check), the manifest's digest, size and file count, and the manifest's bytes.

The next launch runs git, and when the key is the same and every one of those files has the same lstat (size,
mtime, ctime, inode, device), out of the racy window of the snapshot that wrote the record, the tree holds what it
held then: the same key means the same tracked files with the same blobs and modes, the same untracked and changed
ones, and git's own check that no other tracked file differs from its index; the same lstat means the same bytes
and mode, as the stat cache takes it. The launch then uses the recorded digest, without parsing the listing or
building an entry per file; the manifest itself is decoded only if the caller asks for it. An edited, added,
removed or chmod'ed file changes git's answers or a recorded lstat, and the snapshot is taken in full.

The record is the SHA-256 of its header, the header's length (4 bytes, big-endian), the header (canonical msgpack),
then the manifest's bytes, which must have the header's digest; it is replaced atomically. A record that cannot be
read or fails a check is ignored (the snapshot is then taken in full), one that cannot be written is not kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from workers.base import codec
from workers.errors import RecordDecodeError
from workers.workspace.manifest import blob_digest
from workers.workspace.statcache import RACY_NS, cache_file

SCHEMA_VERSION: Final = 2
SUFFIX: Final = ".launch"
CHECKSUM_BYTES: Final = 32


@dataclass(frozen=True, slots=True)
class LaunchRecord:
    """What the last snapshot of a git tree found, and what it took for the tree to be the same."""

    key: str  # GitOutput.key of that snapshot's git answers
    started_ns: int  # when that snapshot started: a file is trusted if its mtime and ctime lie before the racy window
    stats: list[list[Any]]  # [path, size, mtime, ctime, inode, device] of every file it stat'ed
    digest: str  # the manifest's
    files: int
    total_bytes: int
    manifest: bytes  # the manifest's canonical bytes

    def holds(self, root: Path, key: str | None) -> bool:
        """Whether the tree `root`, whose git answers have `key`, is the one this record describes."""
        if key != self.key:
            return False
        limit = self.started_ns - RACY_NS
        prefix = str(root) + "/"
        for rel, size, mtime, ctime, ino, dev in self.stats:
            if mtime >= limit or ctime >= limit:
                return False
            try:
                st = os.lstat(prefix + rel)
            except OSError:
                return False
            if (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev) != (size, mtime, ctime, ino, dev):
                return False
        return True


def record_file(cache_dir: Path, root: Path) -> Path:
    """The record of the folder `root` in `cache_dir`."""
    return cache_file(cache_dir, root).with_suffix(SUFFIX)


def stat_row(rel: str, st: os.stat_result) -> list[Any]:
    """A file's row in `LaunchRecord.stats`."""
    return [rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def load(cache_dir: Path, root: Path) -> LaunchRecord | None:
    """The record of `root` (None when there is none, or it is damaged or foreign)."""
    try:
        data = record_file(cache_dir, root).read_bytes()
    except OSError:
        return None
    start = CHECKSUM_BYTES + 4
    end = start + int.from_bytes(data[CHECKSUM_BYTES:start], "big")
    if len(data) < end or hashlib.sha256(data[start:end]).digest() != data[:CHECKSUM_BYTES]:
        return None
    try:
        raw = codec.decode(data[start:end], what="launch record")
    except RecordDecodeError:
        return None
    manifest = data[end:]
    if not isinstance(raw, dict) or (raw.get("schema_version"), raw.get("digest")) != (
        SCHEMA_VERSION,
        blob_digest(manifest),
    ):
        return None
    try:  # the checksum vouches for the header's shape, written by `save`
        return LaunchRecord(
            raw["key"], raw["started_ns"], raw["stats"], raw["digest"], raw["files"], raw["bytes"], manifest
        )
    except KeyError:
        return None


def save(cache_dir: Path, root: Path, record: LaunchRecord) -> None:
    """Write the record of `root` (atomically; not at all if the folder cannot be written)."""
    header = codec.encode(
        {
            "schema_version": SCHEMA_VERSION,
            "key": record.key,
            "started_ns": record.started_ns,
            "stats": record.stats,
            "digest": record.digest,
            "files": record.files,
            "bytes": record.total_bytes,
        }
    )
    path = record_file(cache_dir, root)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            f.write(hashlib.sha256(header).digest() + len(header).to_bytes(4, "big"))
            f.write(header)
            f.write(record.manifest)
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def forget(cache_dir: Path, root: Path) -> None:
    """Remove the record of `root`: the last snapshot was not of git's listing, or it cannot be trusted."""
    with contextlib.suppress(OSError):
        record_file(cache_dir, root).unlink()

"""A workspace's manifest: every file of a tree by path, with its mode, size and content digest.

A snapshot workspace is a manifest plus the blobs it names. Paths are relative POSIX paths in UTF-8,
checked by `check_path` (no `..`, no absolute path, no empty or `.` component, bounded length and
depth). Modes are git's: `0o100644` a regular file, `0o100755` an executable one, `0o120000` a
symlink whose blob is its target. A digest is the SHA-256 of the blob's bytes, in hex: every client
can compute it (a browser's Web Crypto, Node, Python), and a server checks each upload against it.

The manifest's canonical msgpack (entries sorted by the UTF-8 bytes of their paths) is what the
bootstrap record names by digest, so it is part of a fork's immutable inputs. A tool call's changes
are a `Changes`: path → new entry, or None for a removed file; `Manifest.apply` folds them in.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from workers.base import codec
from workers.errors import RecordDecodeError, WorkspaceError

SCHEMA_VERSION: Final = 1
MAX_PATH_BYTES: Final = 4096  # as Linux's PATH_MAX
MAX_NAME_BYTES: Final = 255  # as Linux's NAME_MAX
MAX_PATH_DEPTH: Final = 64
DIGEST_HEX_LENGTH: Final = 64
DIGEST_RE: Final = re.compile(r"[0-9a-f]{64}")


class Mode(enum.IntEnum):
    """A manifest entry's mode, as git writes it."""

    FILE = 0o100644
    EXECUTABLE = 0o100755
    SYMLINK = 0o120000

    @classmethod
    def of(cls, st_mode: int) -> Mode:
        """The mode of a regular file or symlink from its `st_mode` (any execute bit makes it executable)."""
        if st_mode & 0o170000 == 0o120000:
            return cls.SYMLINK
        return cls.EXECUTABLE if st_mode & 0o111 else cls.FILE


def blob_digest(data: bytes) -> str:
    """The content address of a blob: SHA-256 of its bytes, in hex."""
    return hashlib.sha256(data).hexdigest()


def is_digest(value: object) -> bool:
    """Whether `value` is a blob digest as forkq writes it (64 lowercase hex digits)."""
    # a regex, not a loop over the characters: an uploaded manifest's 50,000 digests are checked per request
    return isinstance(value, str) and DIGEST_RE.fullmatch(value) is not None


def check_path(path: object) -> str:
    """`path` if it is a valid workspace path (relative, normalized, bounded).

    Raises:
        WorkspaceError: it is not; the message names the path and what is wrong with it.
    """
    if not isinstance(path, str) or not path:
        raise WorkspaceError(f"workspace path {path!r}: expected a non-empty relative path", field="path")
    problem = _path_problem(path)
    if problem is not None:
        raise WorkspaceError(f"workspace path {path[:200]!r}: {problem}", field="path")
    return path


def _path_problem(path: str) -> str | None:  # noqa: PLR0911 - one reason per rule, each said its own way
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8; rename the file, or leave it out with .forkqignore"
    if len(encoded) > MAX_PATH_BYTES:
        return f"longer than {MAX_PATH_BYTES} bytes"
    if "\0" in path or "\\" in path:
        return "holds a NUL byte or a backslash; use plain POSIX paths"
    if path.startswith("/"):
        return "is absolute; paths are relative to the workspace's root"
    parts = path.split("/")
    if len(parts) > MAX_PATH_DEPTH:
        return f"is deeper than {MAX_PATH_DEPTH} folders"
    for part in parts:
        if part in ("", ".", ".."):
            return "has an empty, `.` or `..` component; paths must be normalized and stay inside the workspace"
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            return f"has a name longer than {MAX_NAME_BYTES} bytes"
    return None


@dataclass(frozen=True, slots=True)
class Entry:
    """One file of a workspace: its path, mode, size in bytes and the digest of its blob."""

    path: str
    mode: Mode
    size: int
    digest: str

    def wire(self) -> list[Any]:
        """The entry as stored: `[path, mode, size, digest]`."""
        return [self.path, int(self.mode), self.size, self.digest]

    def json(self) -> dict[str, Any]:
        """The entry as the HTTP API and the clients write it."""
        return {"path": self.path, "mode": int(self.mode), "size": self.size, "digest": self.digest}

    @classmethod
    def parse(cls, raw: object) -> Entry:
        """An entry from its stored list or its JSON object, checked.

        Raises:
            WorkspaceError: a field is missing or invalid; the message names it.
        """
        if isinstance(raw, Mapping):
            raw = [raw.get("path"), raw.get("mode"), raw.get("size"), raw.get("digest")]
        if not isinstance(raw, list | tuple) or len(raw) != 4:
            raise WorkspaceError(f"workspace entry {str(raw)[:200]}: expected path, mode, size and digest")
        path, mode, size, digest = raw
        path = check_path(path)
        if not isinstance(mode, int) or isinstance(mode, bool) or mode not in Mode._value2member_map_:
            raise WorkspaceError(
                f"workspace entry {path!r}: mode {mode!r} is not one of 0o100644, 0o100755 or 0o120000 "
                f"(33188, 33261 or 40960)",
                field="mode",
            )
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise WorkspaceError(f"workspace entry {path!r}: size {size!r} is not a byte count", field="size")
        if not is_digest(digest):
            raise WorkspaceError(
                f"workspace entry {path!r}: digest {str(digest)[:80]!r} is not the SHA-256 of the file in "
                "lowercase hex",
                field="digest",
            )
        return cls(path, Mode(mode), size, str(digest))


Changes = dict[str, Entry | None]  # path → its new entry, or None: the file was removed


@dataclass(frozen=True, slots=True)
class Manifest:
    """A tree of files by path (sorted by the UTF-8 bytes of the path)."""

    entries: tuple[Entry, ...]

    @classmethod
    def of(cls, entries: Iterable[Entry]) -> Manifest:
        """A manifest of `entries`, sorted and checked (no path twice, no file where a folder is).

        Raises:
            WorkspaceError: two entries have one path, or a file's path is another's folder.
        """
        ordered = tuple(sorted(entries, key=lambda e: e.path.encode("utf-8")))
        seen: set[str] = set()
        for entry in ordered:
            if entry.path in seen:
                raise WorkspaceError(f"workspace path {entry.path!r} is listed twice", field="path")
            seen.add(entry.path)
        for entry in ordered:
            parts = entry.path.split("/")
            for i in range(1, len(parts)):
                folder = "/".join(parts[:i])
                if folder in seen:
                    raise WorkspaceError(
                        f"workspace path {entry.path!r} lies under {folder!r}, which is a file", field="path"
                    )
        return cls(ordered)

    def by_path(self) -> dict[str, Entry]:
        """The entries by path."""
        return {e.path: e for e in self.entries}

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def total_bytes(self) -> int:
        """The sum of the files' sizes."""
        return sum(e.size for e in self.entries)

    def digests(self) -> set[str]:
        """The distinct blobs the manifest names."""
        return {e.digest for e in self.entries}

    def apply(self, changes: Mapping[str, Entry | None]) -> Manifest:
        """The manifest after `changes` (path → new entry, None: removed)."""
        if not changes:
            return self
        current = self.by_path()
        for path, entry in changes.items():
            if entry is None:
                current.pop(path, None)
            else:
                current[path] = entry
        return Manifest.of(current.values())

    def changes_to(self, other: Manifest) -> Changes:
        """What turns this manifest into `other`: changed or added entries, and None for removed paths."""
        mine, theirs = self.by_path(), other.by_path()
        changes: Changes = {p: e for p, e in theirs.items() if mine.get(p) != e}
        changes.update({p: None for p in mine if p not in theirs})
        return dict(sorted(changes.items()))

    def encode(self) -> bytes:
        """Canonical msgpack bytes: `{"schema_version", "entries": [[path, mode, size, digest], ...]}`."""
        return codec.encode({"schema_version": SCHEMA_VERSION, "entries": [e.wire() for e in self.entries]})

    @property
    def digest(self) -> str:
        """The manifest's content address: SHA-256 of its canonical bytes."""
        return blob_digest(self.encode())

    @classmethod
    def decode(cls, data: bytes, *, what: str = "workspace manifest") -> Manifest:
        """A manifest from its canonical bytes.

        Raises:
            RecordDecodeError: the bytes are not a manifest.
        """
        raw = codec.decode(data, what=what)
        if not isinstance(raw, dict) or not isinstance(raw.get("entries"), list):
            raise RecordDecodeError(f"{what}: expected a map with `entries`")
        try:
            return cls.of(Entry.parse(e) for e in raw["entries"])
        except WorkspaceError as exc:
            raise RecordDecodeError(f"{what}: {exc}", cause=exc) from exc


def encode_changes(changes: Mapping[str, Entry | None]) -> list[Any]:
    """A tool call's changes as stored in its journal entry: `[[path, mode, size, digest] | [path], ...]`."""
    return [entry.wire() if entry is not None else [path] for path, entry in sorted(changes.items())]


def decode_changes(raw: object) -> Changes:
    """Changes from their stored form (see `encode_changes`).

    Raises:
        WorkspaceError: the stored form is not a list of entries and removed paths.
    """
    if not isinstance(raw, list):
        raise WorkspaceError(f"workspace changes: expected a list, got {type(raw).__name__}")
    changes: Changes = {}
    for item in raw:
        if isinstance(item, list) and len(item) == 1:
            changes[check_path(item[0])] = None
        else:
            entry = Entry.parse(item)
            changes[entry.path] = entry
    return changes


EMPTY: Final = Manifest(())

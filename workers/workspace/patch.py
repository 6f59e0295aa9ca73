"""A fork's changes as a patch in git's format, which `git apply` accepts in a git repository or a plain folder.

The patch is what `git diff --binary --full-index` writes for the same trees, file by file in the order of
the paths' UTF-8 bytes:

- a header: `diff --git a/P b/P`, then `new file mode`, `deleted file mode` or `old mode`/`new mode`, then
  `index <old>..<new>` with full git blob ids (SHA-1 of `blob <size>\\0<bytes>`; `git apply` checks a
  binary file's preimage only against a full id);
- a text file's change: `--- a/P` / `+++ b/P` (`/dev/null` for an added or removed file) and unified hunks
  with 3 lines of context, `\\ No newline at end of file` after a last line without one;
- a binary file's change: `GIT binary patch`, the new bytes as a `literal` hunk (zlib-deflated, in git's
  base85 lines), then the old bytes the same way (the reverse hunk git writes so the patch can be reversed);
- a symlink is mode 120000 with its target as the content; a file that becomes a symlink or the other way
  round is a removal and an addition, as git writes a type change.

A file is binary when either side has a NUL byte in its first 8000 bytes (git's own test) or is not UTF-8:
git would diff the latter as text, but then the patch would not be UTF-8, and the API, the JSON output and
the web view carry it as text. Paths are quoted as git quotes them with `core.quotePath` on (the default):
`"`, `\\`, control characters and every non-ASCII byte; spaces stay unquoted, with the tab git adds after
a `---`/`+++` name that holds one.
"""

from __future__ import annotations

import base64
import collections
import difflib
import enum
import hashlib
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from workers.workspace.manifest import Changes, Entry, Manifest, Mode

Read = Callable[[str], bytes]  # a blob's digest → its bytes

CONTEXT_LINES: Final = 3
MAX_DIFF_WORK: Final = 2_000_000  # occurrences of a's lines in b difflib may weigh in one file (≤ ~1 s)
BINARY_PROBE_BYTES: Final = 8000  # git's FIRST_FEW_BYTES: how far it looks for a NUL
BINARY_LINE_BYTES: Final = 52  # the bytes one base85 line of a binary hunk carries
NULL_ID: Final = "0" * 40
STAT_NAME_WIDTH: Final = 50  # `git apply --stat` shortens longer names
STAT_WIDTH: Final = 70
_C_ESCAPES: Final = {7: "a", 8: "b", 9: "t", 10: "n", 11: "v", 12: "f", 13: "r", 34: '"', 92: "\\"}


class FileStatus(enum.StrEnum):
    """What a patch does to one file."""

    ADDED = "added"
    MODIFIED = "modified"
    DELETED = "deleted"
    MODE = "mode"  # only the executable bit changed


@dataclass(frozen=True, slots=True)
class FileStat:
    """One file's line counts in a patch (a binary file counts no lines)."""

    path: str
    added: int
    removed: int
    binary: bool
    status: FileStatus

    def json(self) -> dict[str, object]:
        """The stat as the HTTP API and the clients write it."""
        return {
            "path": self.path,
            "added": self.added,
            "removed": self.removed,
            "binary": self.binary,
            "status": str(self.status),
        }


@dataclass(frozen=True, slots=True)
class _FilePatch:
    """One `diff --git` block: a file's old and new entry (None: absent) and their bytes."""

    path: str
    old: Entry | None
    new: Entry | None
    old_data: bytes
    new_data: bytes

    @property
    def binary(self) -> bool:
        return is_binary(self.old_data) or is_binary(self.new_data)

    @property
    def status(self) -> FileStatus:
        if self.old is None:
            return FileStatus.ADDED
        if self.new is None:
            return FileStatus.DELETED
        return FileStatus.MODIFIED if self.old.digest != self.new.digest else FileStatus.MODE


def git_blob_id(data: bytes) -> str:
    """Git's id of a blob: SHA-1 of `blob <size>\\0` and the bytes, in hex."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def is_binary(data: bytes) -> bool:
    """Whether the patch carries `data` as binary: a NUL in its first 8000 bytes, or not UTF-8."""
    if b"\0" in data[:BINARY_PROBE_BYTES]:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def quote_path(path: str) -> str | None:
    """`path` in C quotes as git writes it with `core.quotePath` on, or None when it needs none."""
    raw = path.encode("utf-8", "surrogateescape")
    if not any(b < 0x20 or b >= 0x7F or b in (34, 92) for b in raw):
        return None
    out = []
    for b in raw:
        if b in _C_ESCAPES:
            out.append("\\" + _C_ESCAPES[b])
        elif b < 0x20 or b >= 0x7F:
            out.append(f"\\{b:03o}")
        else:
            out.append(chr(b))
    return '"' + "".join(out) + '"'


def _name(prefix: str, path: str) -> str:
    """`prefix` + `path`, quoted as a whole when the path needs it (git's `quote_two`)."""
    quoted = quote_path(path)
    return prefix + path if quoted is None else '"' + prefix + quoted[1:]


def changed_files(changes: Mapping[str, Entry | None], base: Manifest | None = None) -> list[str]:
    """The paths `changes` names, sorted by their UTF-8 bytes; with `base`, only those that change it."""
    if base is not None:
        old = base.by_path()
        changes = {p: e for p, e in changes.items() if not _unchanged(old.get(p), e)}
    return sorted(changes, key=lambda p: p.encode("utf-8"))


def _unchanged(old: Entry | None, new: Entry | None) -> bool:
    if old is None or new is None:
        return old is new
    return old.mode == new.mode and old.digest == new.digest


def _file_patches(base: Manifest, changes: Changes, read: Read) -> Iterator[_FilePatch]:
    """The `diff --git` blocks of `changes` on `base`, skipping entries that change nothing."""
    old_entries = base.by_path()
    for path in changed_files(changes, base):
        old, new = old_entries.get(path), changes[path]
        old_data = read(old.digest) if old is not None else b""
        new_data = read(new.digest) if new is not None else b""
        if old is not None and new is not None and (old.mode == Mode.SYMLINK) != (new.mode == Mode.SYMLINK):
            yield _FilePatch(path, old, None, old_data, b"")  # a type change: git removes, then adds
            yield _FilePatch(path, None, new, b"", new_data)
        else:
            yield _FilePatch(path, old, new, old_data, new_data)


def _header(fp: _FilePatch) -> list[str]:
    """The extended header lines of one block, ending with its `index` line."""
    lines = [f"diff --git {_name('a/', fp.path)} {_name('b/', fp.path)}"]
    old_id = git_blob_id(fp.old_data) if fp.old is not None else NULL_ID
    new_id = git_blob_id(fp.new_data) if fp.new is not None else NULL_ID
    if fp.old is None and fp.new is not None:
        lines.append(f"new file mode {int(fp.new.mode):o}")
    elif fp.new is None and fp.old is not None:
        lines.append(f"deleted file mode {int(fp.old.mode):o}")
    elif fp.old is not None and fp.new is not None:
        if fp.old.mode != fp.new.mode:
            lines += [f"old mode {int(fp.old.mode):o}", f"new mode {int(fp.new.mode):o}"]
        if old_id != new_id:
            same_mode = f" {int(fp.new.mode):o}" if fp.old.mode == fp.new.mode else ""
            lines.append(f"index {old_id}..{new_id}{same_mode}")
        return lines
    lines.append(f"index {old_id}..{new_id}")
    return lines


def _split_lines(data: bytes) -> list[bytes]:
    """`data`'s lines as git counts them: split after each LF only, the last one possibly without it."""
    lines = [line + b"\n" for line in data.split(b"\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def _hunk_range(start: int, stop: int) -> str:
    """A hunk's `start,length` as unified diffs write it: `,1` left out, an empty range at the line before."""
    length = stop - start
    if length == 1:
        return str(start + 1)
    return f"{start if length == 0 else start + 1},{length}"


Opcode = tuple[str, int, int, int, int]  # as difflib's: tag, a's range, b's range


def _opcodes(a: list[bytes], b: list[bytes]) -> list[Opcode]:
    """How `a` becomes `b`: the common head and tail kept as they are, difflib on what lies between.

    Trimming first keeps the usual edit cheap whatever the file. difflib's time grows with how often a's lines
    occur in b (lines in over 1% of b aside: its autojunk skips them), which is quadratic for a long file of a
    few distinct lines; past `MAX_DIFF_WORK` such occurrences the middle is replaced as a whole (a larger patch,
    as correct).
    """
    head, limit = 0, min(len(a), len(b))
    while head < limit and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < limit - head and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
        tail += 1
    a_mid, b_mid = a[head : len(a) - tail], b[head : len(b) - tail]
    if _diff_work(a_mid, b_mid) > MAX_DIFF_WORK:
        middle: list[Opcode] = [("replace", 0, len(a_mid), 0, len(b_mid))]
    else:
        middle = list(difflib.SequenceMatcher(None, a_mid, b_mid).get_opcodes())
    codes: list[Opcode] = [("equal", 0, head, 0, head)] if head else []
    codes += [(tag, i1 + head, i2 + head, j1 + head, j2 + head) for tag, i1, i2, j1, j2 in middle]
    if tail:
        codes.append(("equal", len(a) - tail, len(a), len(b) - tail, len(b)))
    return codes


def _diff_work(a: list[bytes], b: list[bytes]) -> int:
    """How many times a's lines occur in b, leaving out the lines difflib's autojunk treats as junk."""
    counts = collections.Counter(b)
    popular = len(b) // 100 + 1 if len(b) >= 200 else len(b)
    return sum(c for line in a if (c := counts.get(line, 0)) <= popular)


def _grouped(codes: list[Opcode], context: int) -> Iterator[list[Opcode]]:
    """The opcodes in hunks with `context` equal lines around each change (difflib's `get_grouped_opcodes`)."""
    if not any(tag != "equal" for tag, *_ in codes):
        return
    if codes[0][0] == "equal":
        tag, i1, i2, j1, j2 = codes[0]
        codes[0] = tag, max(i1, i2 - context), i2, max(j1, j2 - context), j2
    if codes[-1][0] == "equal":
        tag, i1, i2, j1, j2 = codes[-1]
        codes[-1] = tag, i1, min(i2, i1 + context), j1, min(j2, j1 + context)
    group: list[Opcode] = []
    for tag, i1, i2, j1, j2 in codes:
        if tag == "equal" and i2 - i1 > 2 * context:  # a long run without changes ends the hunk
            group.append((tag, i1, i1 + context, j1, j1 + context))
            yield group
            group = [(tag, i2 - context, i2, j2 - context, j2)]
            continue
        group.append((tag, i1, i2, j1, j2))
    if group and not (len(group) == 1 and group[0][0] == "equal"):
        yield group


def _text_hunks(old: bytes, new: bytes) -> Iterator[bytes]:
    """The unified hunks turning `old` into `new`, as lines that end with LF."""
    a, b = _split_lines(old), _split_lines(new)
    for group in _grouped(_opcodes(a, b), CONTEXT_LINES):
        a_range = _hunk_range(group[0][1], group[-1][2])
        b_range = _hunk_range(group[0][3], group[-1][4])
        yield f"@@ -{a_range} +{b_range} @@\n".encode()
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                yield from _prefixed(b" ", a[i1:i2])
                continue
            yield from _prefixed(b"-", a[i1:i2])
            yield from _prefixed(b"+", b[j1:j2])


def _prefixed(sign: bytes, lines: list[bytes]) -> Iterator[bytes]:
    for line in lines:
        yield sign + line if line.endswith(b"\n") else sign + line + b"\n\\ No newline at end of file\n"


def _binary_hunk(data: bytes) -> Iterator[bytes]:
    """A `literal` hunk of a binary patch: the size, then the deflated bytes in git's base85 lines."""
    yield b"literal %d\n" % len(data)
    packed = zlib.compress(data)
    for start in range(0, len(packed), BINARY_LINE_BYTES):
        chunk = packed[start : start + BINARY_LINE_BYTES]
        size = len(chunk)
        marker = chr(ord("A") + size - 1) if size <= 26 else chr(ord("a") + size - 27)
        yield marker.encode() + base64.b85encode(chunk, pad=True) + b"\n"
    yield b"\n"


def _body(fp: _FilePatch) -> Iterator[bytes]:
    """A block's content change: nothing for a mode change or an empty file, else hunks."""
    if fp.old_data == fp.new_data and ((fp.old is not None and fp.new is not None) or not fp.old_data):
        return
    if fp.binary:
        yield b"GIT binary patch\n"
        yield from _binary_hunk(fp.new_data)
        yield from _binary_hunk(fp.old_data)
        return
    old_name = _name("a/", fp.path) if fp.old is not None else "/dev/null"
    new_name = _name("b/", fp.path) if fp.new is not None else "/dev/null"
    # git ends a name that holds a space with a tab, so that a reader knows where it stops
    yield f"--- {old_name}{chr(9) if ' ' in old_name else ''}\n".encode()
    yield f"+++ {new_name}{chr(9) if ' ' in new_name else ''}\n".encode()
    yield from _text_hunks(fp.old_data, fp.new_data)


def render_patch(base: Manifest, changes: Changes, read: Read) -> bytes:
    """`changes` on `base` as a git patch (binary files included); empty when nothing changes."""
    out: list[bytes] = []
    for fp in _file_patches(base, changes, read):
        out.extend(line.encode() + b"\n" for line in _header(fp))
        out.extend(_body(fp))
    return b"".join(out)


def _stat(fp: _FilePatch) -> FileStat:
    if fp.binary:
        return FileStat(fp.path, 0, 0, True, fp.status)
    added = removed = 0
    for line in _text_hunks(fp.old_data, fp.new_data):
        if line.startswith(b"+"):
            added += 1
        elif line.startswith(b"-"):
            removed += 1
    return FileStat(fp.path, added, removed, False, fp.status)


def diffstat(base: Manifest, changes: Changes, read: Read) -> list[FileStat]:
    """One stat per `diff --git` block of the patch (a type change is a removal and an addition)."""
    return [_stat(fp) for fp in _file_patches(base, changes, read)]


def _stat_name(path: str) -> str:
    quoted = quote_path(path)
    return path if quoted is None else quoted


def render_stat(stats: list[FileStat]) -> str:
    """The stats as `git apply --stat` prints them: a line per file, scaled bars, then the totals."""
    if not stats:
        return " 0 files changed\n"
    names = [_stat_name(s.path) for s in stats]
    name_width = min(max(len(n) for n in names), STAT_NAME_WIDTH)
    max_change = max(s.added + s.removed for s in stats)
    bar_width = STAT_WIDTH - name_width if name_width + max_change > STAT_WIDTH else max_change
    lines = []
    for stat, full_name in zip(stats, names, strict=True):
        name = full_name
        if len(name) > name_width:  # keep the tail, from a folder boundary where there is one
            cut = len(name) + 3 - name_width
            slash = name.find("/", cut)
            name = "..." + name[slash if slash >= 0 else cut :]
        if stat.binary:
            lines.append(f" {name:<{name_width}} |  Bin")
            continue
        add, total = stat.added, stat.added + stat.removed
        if max_change > 0:
            add = (add * bar_width + max_change // 2) // max_change
            total = (total * bar_width + max_change // 2) // max_change
        lines.append(f" {name:<{name_width}} |{stat.added + stat.removed:5d} {'+' * add}{'-' * (total - add)}")
    lines.append(_summary(stats))
    return "\n".join(lines) + "\n"


def _summary(stats: list[FileStat]) -> str:
    """The totals line, as git's `print_stat_summary` words it."""
    files, added, removed = len(stats), sum(s.added for s in stats), sum(s.removed for s in stats)
    text = f" {files} file{'s' if files != 1 else ''} changed"
    if added or not removed:
        text += f", {added} insertion{'s' if added != 1 else ''}(+)"
    if removed or not added:
        text += f", {removed} deletion{'s' if removed != 1 else ''}(-)"
    return text

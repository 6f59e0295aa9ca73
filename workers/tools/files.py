"""The built-in file tools of a coding fork: read, list, write and edit files (search and shell: their own modules).

Every path argument resolves against the fork's working directory and is refused when it escapes it
(`..`, an absolute path elsewhere, a symlink pointing out). In a snapshot fork (`ToolContext.confinement`)
an absolute path under the parent's cwd names the same place in the fork's workspace. Resolving and opening are one step
(`workers.tools.beneath`): a tool reads or writes the very file it resolved, even while a symlink is
swapped in meanwhile, and creates missing parent directories one at a time from the descriptor of
the one above. Only regular files are read or written: a FIFO, socket or device is refused after
a non-blocking open (never stat-then-open), so no call can hang on one. Every result is bounded:
the model's context is the scarce resource, and each result is journaled in Redis.

Flags. The read-only tools are idempotent. `write_file` is idempotent too: writing the same content
twice leaves the file as writing it once, so a write interrupted by a worker's death is simply run
again on revival. `edit` is not: once applied, a second run no longer finds `old_string` (or, when
`new_string` contains it, replaces again). `run_shell_command` is mutating and not idempotent: a
command can do anything. `write_file` and `edit` are the file-edit tools that the `auto-edit`
approval mode approves; a shell command is not an edit.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from workers.tools.beneath import ANY, DIRECTORY, RootDir
from workers.tools.registry import ToolContext, ToolError, resolve_inside

READ_MAX_LINES = 2000  # read_file's default and largest `limit`
READ_MAX_CHARS = 256 * 1024  # a read stops at this many characters even before `limit` lines
LINE_MAX_CHARS = 2000  # a longer line (minified code, data) is clipped
READ_SKIP_CHARS = 64 * 1024  # the rest of a clipped line is read past this much at a time, never whole
EDIT_MAX_BYTES = 16 * 1024 * 1024  # edit reads the whole file: larger ones are refused (write_file replaces them)
LIST_MAX_ENTRIES = 1000
BINARY_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a file as binary
NOT_A_FILE = "is a directory, not a file; use list_directory to see what it holds"

# ── paths ──────────────────────────────────────────────────────────────────────────────────────


def root_of(ctx: ToolContext) -> RootDir:
    """The fork's working directory, held open (close it, or use it as a context manager)."""
    try:
        return RootDir.open(ctx.cwd)
    except OSError as exc:
        raise ToolError(f"the fork's working directory {str(ctx.cwd)!r} does not exist or is not a directory") from exc


def relative(root: RootDir, ctx: ToolContext, path: str) -> str:
    """`path` as a path below the working directory; an absolute one must name a place inside it.

    Raises:
        ToolError: an absolute path elsewhere, or one that cannot be resolved.
    """
    if "\0" in path:
        raise ToolError(f"path {path!r} cannot be resolved (a NUL byte); use a plain path inside the working directory")
    if not path.startswith("/"):
        return path
    if ctx.confinement is not None:  # the parent's path, as the inherited history names files: the workspace's
        path = ctx.confinement.inside(path) or path
    for prefix in (root.path, os.path.abspath(ctx.cwd)):
        if path == prefix:
            return "."
        if path.startswith(prefix.rstrip("/") + "/"):
            return path[len(prefix.rstrip("/")) + 1 :]
    # reaching the directory through a symlink elsewhere: where it resolves now (the open stays confined)
    return resolve_inside(Path(root.path), path, ctx.confinement).relative_to(root.path).as_posix() or "."


def open_path(root: RootDir, ctx: ToolContext, path: str, flags: int) -> int:
    """A descriptor of `path` opened beneath the working directory.

    Raises:
        ToolError: the path leads outside, or cannot be resolved.
        OSError: whatever else open(2) says (ENOENT, EISDIR, ...): each tool words its own message.
    """
    try:
        return root.open_beneath(relative(root, ctx, path), flags)
    except ValueError as exc:
        raise ToolError(
            f"path {path!r} cannot be resolved ({exc}); use a plain path inside the working directory"
        ) from exc
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            where = ctx.confinement.alias if ctx.confinement is not None else root.path
            raise ToolError(f"path {path!r} is outside the working directory {where!r}; use a path inside it") from exc
        if exc.errno == errno.ELOOP:
            raise ToolError(
                f"path {path!r} cannot be resolved (too many levels of symbolic links); "
                "use a plain path inside the working directory"
            ) from exc
        raise


def _special(path: str, mode: int) -> ToolError:
    kind = "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device or special file"
    return ToolError(f"{path!r} is a {kind}, not a regular file; the file tools read and write regular files only")


def open_regular(root: RootDir, ctx: ToolContext, path: str, flags: int, directory: str = NOT_A_FILE) -> int:
    """A descriptor of the regular file `path`, opened with `flags` (non-blocking, so a FIFO cannot hang it).

    The object is looked at (O_PATH) before it is opened for I/O, so opening a device has no effect;
    the descriptor is checked again after, in case the name was swapped in between.

    Raises:
        ToolError: outside, missing, a directory (`directory` is the message), not a regular file.
    """
    fd = -1
    try:
        for open_flags in (ANY, flags | os.O_NONBLOCK):
            if fd >= 0:
                os.close(fd)
            fd = open_path(root, ctx, path, open_flags)
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise ToolError(f"{path!r} {directory}")
            if not stat.S_ISREG(mode):
                raise _special(path, mode)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise ToolError(f"file {path!r} does not exist; use glob or list_directory to find the right path") from exc
    except IsADirectoryError as exc:
        raise ToolError(f"{path!r} {directory}") from exc
    except ToolError:
        if fd >= 0:
            os.close(fd)
        raise
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        raise ToolError(f"cannot open {path!r}: {exc.strerror or exc}") from exc
    return fd


def open_directory(root: RootDir, ctx: ToolContext, path: str) -> int:
    """A readable descriptor of the directory `path` beneath the working directory."""
    try:
        return open_path(root, ctx, path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
    except PermissionError as exc:
        raise ToolError(f"permission denied: directory {path!r} cannot be read; give a directory you can read") from exc
    except OSError as exc:
        raise ToolError(f"{path!r} is not a directory of the working directory; give a directory path") from exc


def read_all(fd: int, cap: int) -> bytes:
    """Everything from `fd`'s current offset to the end.

    Raises:
        ToolError: more than `cap` bytes (the file grew since it was measured).
    """
    chunks, total = [], 0
    while chunk := os.read(fd, 1024 * 1024):
        chunks.append(chunk)
        total += len(chunk)
        if total > cap:
            raise ToolError(f"the file grew past {cap:,} bytes while it was read; try again")
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` (os.write may write less)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def clip(line: str, limit: int) -> str:
    """`line` cut to `limit` characters, with a marker saying how much was cut (line ending kept)."""
    body = line.rstrip("\r\n")
    if len(body) <= limit:
        return line
    return f"{body[:limit]}[... line truncated: {len(body) - limit} chars omitted ...]{line[len(body) :]}"


def bounded(items: list[str], cap: int, hint: str) -> str:
    """The first `cap` items, one a line, with a marker naming how many more there are."""
    shown = "\n".join(items[:cap])
    if len(items) <= cap:
        return shown
    return f"{shown}\n[... {len(items) - cap} more not shown; {hint} ...]"


# ── read-only tools ────────────────────────────────────────────────────────────────────────────


def _clipped_lines(stream: IO[str]) -> Iterator[str]:
    """The lines of `stream`, each clipped to LINE_MAX_CHARS; a huge line is never held whole."""
    while line := stream.readline(LINE_MAX_CHARS + 2):  # room for the line ending
        if line.endswith(("\n", "\r")) or len(line) < LINE_MAX_CHARS + 2:
            yield clip(line, LINE_MAX_CHARS)
            continue
        length, ending = len(line), ""
        while more := stream.readline(READ_SKIP_CHARS):
            body = more.rstrip("\r\n")
            length += len(body)
            if len(body) < len(more):
                ending = more[len(body) :]
                break
        yield f"{line[:LINE_MAX_CHARS]}[... line truncated: {length - LINE_MAX_CHARS} chars omitted ...]{ending}"


def _take_lines(stream: IO[str], offset: int, limit: int) -> tuple[list[str], int, bool]:
    """Up to `limit` lines after the first `offset`, within READ_MAX_CHARS; lines seen; whether more follow."""
    taken: list[str] = []
    size = seen = 0
    for seen, clipped in enumerate(_clipped_lines(stream), start=1):
        if seen <= offset:
            continue
        if len(taken) >= limit or size >= READ_MAX_CHARS:
            return taken, seen, True
        taken.append(clipped)
        size += len(clipped)
    return taken, seen, False


def read_file(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """The text of a file, from line `offset` (0-based), at most `limit` lines, with a marker when more follow."""
    path = str(args["path"])
    offset, limit = int(args.get("offset", 0)), int(args.get("limit", READ_MAX_LINES))
    with root_of(ctx) as root:
        fd = open_regular(root, ctx, path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as raw:
        if b"\0" in raw.read(BINARY_SNIFF_BYTES):
            raise ToolError(f"{path!r} is a binary file; read_file reads text files only")
        raw.seek(0)
        stream = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="")
        lines, seen, more = _take_lines(stream, offset, limit)
        stream.detach()
    if not lines:
        if offset > 0:
            raise ToolError(f"offset {offset} is past the end of {path!r}, which has {seen} lines")
        return "(empty file)"
    text = "".join(lines)
    if not more:
        return text
    end = offset + len(lines)
    separator = "" if text.endswith("\n") else "\n"
    return (
        f"{text}{separator}[... truncated: showing lines {offset + 1}-{end}; "
        f"call read_file with offset={end} to read on ...]"
    )


def list_directory(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """The entries of a directory, sorted, directories marked with a trailing `/`."""
    path = str(args.get("path", "."))
    with root_of(ctx) as root:
        fd = open_directory(root, ctx, path)
    try:
        with os.scandir(fd) as entries:
            # a symlink is listed by its own name, not followed: one to a directory (even outside) gets no `/`
            names = sorted(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else "") for entry in entries)
    finally:
        os.close(fd)
    if not names:
        return f"(directory {path!r} is empty)"
    return bounded(names, LIST_MAX_ENTRIES, "list a subdirectory, or use glob with a narrower pattern")


# ── file edits ─────────────────────────────────────────────────────────────────────────────────


def _make_parents(root: RootDir, ctx: ToolContext, path: str, parent: str) -> None:
    """Create the missing directories of `parent`, each from a descriptor of the one above it."""
    parts = [part for part in parent.split("/") if part not in ("", ".")]
    for depth in range(1, len(parts) + 1):
        try:
            os.close(open_path(root, ctx, "/".join(parts[:depth]), DIRECTORY))
            continue
        except FileNotFoundError:
            pass
        above = open_path(root, ctx, "/".join(parts[: depth - 1]), DIRECTORY)
        try:
            os.mkdir(parts[depth - 1], dir_fd=above)
        except FileExistsError:  # made meanwhile, or a symlink: the next open resolves it, confined
            pass
        finally:
            os.close(above)


def _open_for_write(root: RootDir, ctx: ToolContext, path: str, rel: str) -> tuple[int, bool]:
    """A writable descriptor of the regular file `path`, created if missing; and whether it existed."""
    directory = "is a directory; give the path of a file to write"
    try:
        os.close(open_path(root, ctx, rel, ANY))
    except FileNotFoundError:  # missing (a dangling symlink inside too: its target is created, confined)
        fd = open_path(root, ctx, rel, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # something else appeared meanwhile
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise ToolError(f"{path!r} {directory}") from None
            raise _special(path, mode) from None
        return fd, False
    return open_regular(root, ctx, path, os.O_WRONLY, directory), True


def write_file(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Write `content` to a file (created or replaced), creating its parent directories inside the cwd."""
    path, content = str(args["path"]), str(args["content"])
    data = content.encode("utf-8")
    with root_of(ctx) as root:
        rel = relative(root, ctx, path)
        parent, _, leaf = rel.rpartition("/")
        if leaf in ("", ".", ".."):
            raise ToolError(f"{path!r} is a directory; give the path of a file to write")
        try:
            if parent:
                _make_parents(root, ctx, path, parent)
            fd, existed = _open_for_write(root, ctx, path, rel)
        except OSError as exc:
            raise ToolError(f"cannot write {path!r}: {exc.strerror or exc}") from exc
        try:
            os.ftruncate(fd, 0)
            write_all(fd, data)
            shown = root.relative(fd, rel)
        except OSError as exc:
            raise ToolError(f"cannot write {path!r}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
    return f"{'overwrote' if existed else 'created'} {shown} ({len(data)} bytes)"


def _text_of(data: bytes, path: str) -> str:
    if b"\0" in data[:BINARY_SNIFF_BYTES]:
        raise ToolError(f"{path!r} is a binary file; edit changes text files only")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ToolError(f"{path!r} is not UTF-8 text; edit changes UTF-8 files only, use write_file") from exc


def _occurrences(text: str, old: str, cap: int = 100) -> list[int]:
    """Start offsets of `old` in `text`, overlapping ones included (both count against uniqueness)."""
    starts: list[int] = []
    at = text.find(old)
    while at >= 0 and len(starts) < cap:
        starts.append(at)
        at = text.find(old, at + 1)
    return starts


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _replacement(text: str, old: str, new: str, path: str) -> tuple[str, int]:
    """`text` with its one occurrence of `old` replaced; and the line it was on."""
    if old not in text and "\r\n" in text and "\r\n" not in old:  # the model writes \n; the file uses \r\n
        old, new = old.replace("\n", "\r\n"), new.replace("\n", "\r\n")
    starts = _occurrences(text, old)
    if not starts:
        raise ToolError(
            f"old_string was not found in {path!r}; it must match the file exactly, including whitespace and "
            "indentation. Read the file again and copy the text to replace"
        )
    if len(starts) > 1:
        lines = ", ".join(str(_line_of(text, s)) for s in starts[:10])
        count = f"{len(starts)}+" if len(starts) >= 100 else str(len(starts))
        raise ToolError(
            f"old_string occurs {count} times in {path!r} (starting at lines {lines}); it must match exactly once. "
            "Include more surrounding context (lines before or after) in old_string so it matches one place"
        )
    at = starts[0]
    return text[:at] + new + text[at + len(old) :], _line_of(text, at)


def edit(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Replace the one exact occurrence of `old_string` with `new_string`; none or several is an error."""
    path, old, new = str(args["path"]), str(args["old_string"]), str(args["new_string"])
    if not old:
        raise ToolError("old_string is empty; give the exact text to replace (to create a file, use write_file)")
    if old == new:
        raise ToolError("old_string and new_string are the same; there is nothing to change")
    with root_of(ctx) as root:
        fd = open_regular(root, ctx, path, os.O_RDWR)
        try:
            if (size := os.fstat(fd).st_size) > EDIT_MAX_BYTES:
                raise ToolError(
                    f"{path!r} is {size:,} bytes, larger than edit changes (at most {EDIT_MAX_BYTES:,}); "
                    "replace its whole content with write_file, or use run_shell_command (sed) for a local change"
                )
            text = _text_of(read_all(fd, EDIT_MAX_BYTES), path)
            changed, line = _replacement(text, old, new, path)
            data = changed.encode("utf-8")
            os.lseek(fd, 0, os.SEEK_SET)
            write_all(fd, data)
            os.ftruncate(fd, len(data))
            shown = root.relative(fd, path)
        except OSError as exc:
            raise ToolError(f"cannot edit {path!r}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
    return f"edited {shown}: replaced 1 occurrence at line {line}"

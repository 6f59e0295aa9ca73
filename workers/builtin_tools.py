"""The built-in tools of a coding fork: read, list, glob and grep files, write and edit them (shell: `workers.shell`).

Every path argument resolves against the fork's working directory and is refused when it escapes it
(`..`, an absolute path elsewhere, a symlink pointing out). Every result is bounded: the model's
context is the scarce resource, and each result is journaled in Redis.

Flags. The read-only tools are idempotent. `write_file` is idempotent too: writing the same content
twice leaves the file as writing it once, so a write interrupted by a worker's death is simply run
again on revival. `edit` is not: once applied, a second run no longer finds `old_string` (or, when
`new_string` contains it, replaces again). `run_shell_command` is mutating and not idempotent: a
command can do anything. `write_file` and `edit` are the file-edit tools that the `auto-edit`
approval mode approves; a shell command is not an edit.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from pathlib import Path, PurePosixPath
from typing import IO, Any

from workers.tools import ToolContext, ToolError, resolve_inside

READ_MAX_LINES = 2000  # read_file's default and largest `limit`
READ_MAX_CHARS = 256 * 1024  # a read stops at this many characters even before `limit` lines
LINE_MAX_CHARS = 2000  # a longer line (minified code, data) is clipped
LIST_MAX_ENTRIES = 1000
GLOB_MAX_RESULTS = 1000
GLOB_MAX_SCANNED = 50_000  # matches collected before sorting; past this the walk stops
GREP_MAX_MATCHES = 500
GREP_LINE_MAX_CHARS = 500
GREP_MAX_FILE_BYTES = 16 * 1024 * 1024  # larger files are data, not source: skipped
BINARY_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a file as binary
MAX_BRACE_ALTERNATIVES = 64
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn"})  # version-control internals: noise for glob and grep

# ── paths ──────────────────────────────────────────────────────────────────────────────────────


def _root(ctx: ToolContext) -> Path:
    root = ctx.cwd.resolve()
    if not root.is_dir():
        raise ToolError(f"the fork's working directory {str(root)!r} does not exist or is not a directory")
    return root


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _inside(root: Path, path: Path) -> bool:
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        return False
    return resolved == root or root in resolved.parents


def _existing_file(ctx: ToolContext, path: str) -> Path:
    target = resolve_inside(_root(ctx), path)
    if not target.exists():
        raise ToolError(f"file {path!r} does not exist; use glob or list_directory to find the right path")
    if not target.is_file():
        raise ToolError(f"{path!r} is a directory, not a file; use list_directory to see what it holds")
    return target


def _existing_dir(root: Path, path: str) -> Path:
    target = resolve_inside(root, path)
    if not target.is_dir():
        raise ToolError(f"{path!r} is not a directory of the working directory; give a directory path")
    return target


def _is_binary(path: Path) -> bool:
    with path.open("rb") as stream:
        return b"\0" in stream.read(BINARY_SNIFF_BYTES)


def _clip(line: str, limit: int) -> str:
    """`line` cut to `limit` characters, with a marker saying how much was cut (line ending kept)."""
    body = line.rstrip("\r\n")
    if len(body) <= limit:
        return line
    return f"{body[:limit]}[... line truncated: {len(body) - limit} chars omitted ...]{line[len(body) :]}"


def _bounded(items: list[str], cap: int, hint: str) -> str:
    shown = "\n".join(items[:cap])
    if len(items) <= cap:
        return shown
    return f"{shown}\n[... {len(items) - cap} more not shown; {hint} ...]"


def expand_braces(pattern: str) -> list[str]:
    """`*.{ts,tsx}` → `["*.ts", "*.tsx"]`: the brace alternatives glob users expect (innermost first)."""
    expanded, done = [pattern], []
    while expanded:
        current = expanded.pop()
        group = re.search(r"\{([^{}]*,[^{}]*)\}", current)
        if group is None:
            done.append(current)
            continue
        head, tail = current[: group.start()], current[group.end() :]
        expanded.extend(head + alternative + tail for alternative in reversed(group.group(1).split(",")))
        if len(expanded) + len(done) > MAX_BRACE_ALTERNATIVES:
            raise ToolError(f"pattern {pattern!r} expands to more than {MAX_BRACE_ALTERNATIVES} alternatives")
    return done


# ── read-only tools ────────────────────────────────────────────────────────────────────────────


def _take_lines(stream: IO[str], offset: int, limit: int) -> tuple[list[str], int, bool]:
    """Up to `limit` lines after the first `offset`, within READ_MAX_CHARS; lines seen; whether more follow."""
    taken: list[str] = []
    size = seen = 0
    for seen, line in enumerate(stream, start=1):
        if seen <= offset:
            continue
        if len(taken) >= limit or size >= READ_MAX_CHARS:
            return taken, seen, True
        clipped = _clip(line, LINE_MAX_CHARS)
        taken.append(clipped)
        size += len(clipped)
    return taken, seen, False


def read_file(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """The text of a file, from line `offset` (0-based), at most `limit` lines, with a marker when more follow."""
    path = str(args["path"])
    target = _existing_file(ctx, path)
    if _is_binary(target):
        raise ToolError(f"{path!r} is a binary file; read_file reads text files only")
    offset, limit = int(args.get("offset", 0)), int(args.get("limit", READ_MAX_LINES))
    with target.open(encoding="utf-8", errors="replace", newline="") as stream:
        lines, seen, more = _take_lines(stream, offset, limit)
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
    target = _existing_dir(_root(ctx), path)
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in target.iterdir())
    if not names:
        return f"(directory {path!r} is empty)"
    return _bounded(names, LIST_MAX_ENTRIES, "list a subdirectory, or use glob with a narrower pattern")


def _check_pattern(pattern: str) -> None:
    pure = PurePosixPath(pattern)
    if not pattern or pure.is_absolute() or ".." in pure.parts:
        raise ToolError(
            f"glob pattern {pattern!r} must be relative and without '..'; "
            "give the directory to search as `path` and a pattern like '**/*.py'"
        )


def _glob_matches(root: Path, base: Path, pattern: str) -> Iterator[str]:
    for alternative in expand_braces(pattern):
        try:
            matches = base.glob(alternative)
            for match in matches:
                if SKIPPED_DIRS.isdisjoint(match.relative_to(base).parts) and _inside(root, match):
                    yield _rel(root, match) + ("/" if match.is_dir() else "")
        except (ValueError, NotImplementedError) as exc:
            raise ToolError(f"glob pattern {pattern!r} is not valid: {exc}") from exc


def glob(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Paths matching a glob pattern (`**` recurses), sorted, relative to the working directory."""
    root = _root(ctx)
    pattern, path = str(args["pattern"]), str(args.get("path", "."))
    _check_pattern(pattern)
    base = _existing_dir(root, path)
    found = set(islice(_glob_matches(root, base, pattern), GLOB_MAX_SCANNED))
    if not found:
        return f"no paths match {pattern!r} under {path!r}"
    listing = _bounded(sorted(found), GLOB_MAX_RESULTS, "use a narrower pattern or path")
    if len(found) >= GLOB_MAX_SCANNED:
        listing += f"\n[... the search stopped after {GLOB_MAX_SCANNED} matches; use a narrower pattern or path ...]"
    return listing


def _include_filter(include: str | None) -> Callable[[str, str], bool]:
    """A test of (file name, path relative to the search base); a pattern with `/` is matched against the path."""
    if not include:
        return lambda name, relative: True
    patterns = expand_braces(include)
    if "/" in include:
        return lambda name, relative: any(fnmatch.fnmatchcase(relative, p) for p in patterns)
    return lambda name, relative: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _walk_files(root: Path, base: Path, include: str | None) -> Iterator[Path]:
    """The files under `base` in sorted order, VCS internals pruned, symlinks out of `root` skipped."""
    wanted = _include_filter(include)
    for directory, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            path = Path(directory, name)
            if wanted(name, path.relative_to(base).as_posix()) and (not path.is_symlink() or _inside(root, path)):
                yield path


def _search_file(path: Path, regex: re.Pattern[str]) -> Iterator[tuple[int, str]]:
    """(line number, line) of every matching line of a text file; binary, huge and unreadable files yield none."""
    try:
        if path.stat().st_size > GREP_MAX_FILE_BYTES or _is_binary(path):
            return
        with path.open(encoding="utf-8", errors="replace", newline="") as stream:
            for number, line in enumerate(stream, start=1):
                if regex.search(line):
                    yield number, line.rstrip("\r\n")
    except OSError:  # unreadable (permissions, vanished mid-walk): nothing to report from it
        return


def grep_search(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """`path:line:text` for every line matching a Python regular expression, files in sorted order."""
    root = _root(ctx)
    pattern, path, include = str(args["pattern"]), str(args.get("path", ".")), args.get("include")
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ToolError(f"pattern {pattern!r} is not a valid Python regular expression: {exc}") from exc
    base = resolve_inside(root, path)
    if not base.exists():
        raise ToolError(f"{path!r} does not exist; give a file or directory inside the working directory")
    files = iter([base]) if base.is_file() else _walk_files(root, base, include)
    hits = (
        f"{_rel(root, file)}:{number}:{_clip(text, GREP_LINE_MAX_CHARS)}"
        for file in files
        for number, text in _search_file(file, regex)
    )
    found = list(islice(hits, GREP_MAX_MATCHES + 1))
    if not found:
        where = f" in files matching {include!r}" if include else ""
        return f"no matches for {pattern!r} under {path!r}{where}"
    if len(found) <= GREP_MAX_MATCHES:
        return "\n".join(found)
    shown = "\n".join(found[:GREP_MAX_MATCHES])
    return f"{shown}\n[... stopped after {GREP_MAX_MATCHES} matches; narrow the pattern, path or include ...]"


# ── file edits ─────────────────────────────────────────────────────────────────────────────────


def write_file(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Write `content` to a file (created or replaced), creating its parent directories inside the cwd."""
    root = _root(ctx)
    path, content = str(args["path"]), str(args["content"])
    target = resolve_inside(root, path)
    if target.is_dir():
        raise ToolError(f"{path!r} is a directory; give the path of a file to write")
    existed = target.exists()
    data = content.encode("utf-8")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    except OSError as exc:
        raise ToolError(f"cannot write {path!r}: {exc.strerror or exc}") from exc
    return f"{'overwrote' if existed else 'created'} {_rel(root, target)} ({len(data)} bytes)"


def _read_text(target: Path, path: str) -> str:
    data = target.read_bytes()
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


def edit(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Replace the one exact occurrence of `old_string` with `new_string`; none or several is an error."""
    path, old, new = str(args["path"]), str(args["old_string"]), str(args["new_string"])
    if not old:
        raise ToolError("old_string is empty; give the exact text to replace (to create a file, use write_file)")
    if old == new:
        raise ToolError("old_string and new_string are the same; there is nothing to change")
    target = _existing_file(ctx, path)
    text = _read_text(target, path)
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
    target.write_bytes((text[:at] + new + text[at + len(old) :]).encode("utf-8"))
    return f"edited {_rel(_root(ctx), target)}: replaced 1 occurrence at line {_line_of(text, at)}"

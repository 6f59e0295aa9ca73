"""The search tools of a coding fork: `glob` (paths by pattern) and `grep_search` (file contents by regular expression).

`grep_search` matches with the `regex` module rather than `re`: `re` holds the GIL for the whole of
a match, so one catastrophic pattern (`(a|a)+$` over a line of `a`s) stopped every thread of the
worker, its heartbeat included, and other forks lost their leases. `regex` releases the GIL while
it matches (`concurrent=True`) and gives up at a timeout, so a search has a time budget
(`GREP_TIME_LIMIT_S`, never past the call's deadline) and a pattern that exhausts it gets an error
response naming the limit and how to fix the pattern, while other forks see nothing. Its syntax is
`re`'s (the `regex` module's version 0 is compatible with it).

Both walk the tree from descriptors: grep opens each directory with `O_DIRECTORY | O_NOFOLLOW` from
its parent's descriptor and each file with `O_NONBLOCK | O_NOFOLLOW` from its directory's, so a
swapped-in symlink is not followed out and a FIFO, socket or device is skipped without blocking;
a symlinked file is read only while it resolves inside the working directory. glob walks the
same way (a symlinked directory is never entered, the deadline and a cancel are checked at every
directory), matches names only, and reports a match only after opening it beneath the working
directory.

`OutOfTime` is a private control-flow exception, not part of `workers.errors`: it never leaves
this module (grep_search turns it into the ToolError the model reads).
"""

from __future__ import annotations

import fnmatch
import os
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from pathlib import PurePosixPath
from typing import Any

import regex

from workers.tools.beneath import ANY, RootDir
from workers.tools.files import (
    BINARY_SNIFF_BYTES,
    bounded,
    clip,
    open_directory,
    open_path,
    relative,
    root_of,
)
from workers.tools.pattern_size import GREP_MAX_PATTERN_SIZE, expanded_size
from workers.tools.registry import ToolContext, ToolError

GLOB_MAX_RESULTS = 1000
GLOB_MAX_SCANNED = 50_000  # matches collected before sorting; past this the walk stops
GREP_MAX_MATCHES = 500
GREP_LINE_MAX_CHARS = 500
GREP_MAX_FILE_BYTES = 16 * 1024 * 1024  # larger files are data, not source: skipped
GREP_TIME_LIMIT_S = 30.0  # one search's budget, walk and matching together (and never past the call's deadline)
GREP_MAX_PATTERN_CHARS = 2000
GREP_MAX_DEPTH = 64  # directories deeper than this are not searched (each level holds a descriptor)
GREP_CHUNK_BYTES = 1024 * 1024  # a file is searched this much (in whole lines) at a time
MAX_BRACE_ALTERNATIVES = 64
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn"})  # version-control internals: noise for glob and grep
WALK_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
WALK_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def expand_braces(pattern: str) -> list[str]:
    """`*.{ts,tsx}` → `["*.ts", "*.tsx"]`: the brace alternatives glob users expect (innermost first)."""
    expanded, done = [pattern], []
    while expanded:
        current = expanded.pop()
        group = regex.search(r"\{([^{}]*,[^{}]*)\}", current)
        if group is None:
            done.append(current)
            continue
        head, tail = current[: group.start()], current[group.end() :]
        expanded.extend(head + alternative + tail for alternative in reversed(group.group(1).split(",")))
        if len(expanded) + len(done) > MAX_BRACE_ALTERNATIVES:
            raise ToolError(f"pattern {pattern!r} expands to more than {MAX_BRACE_ALTERNATIVES} alternatives")
    return done


class OutOfTime(Exception):
    """The search used up its time budget (or the fork was cancelled)."""


# a pattern with any of these can match a line searched by itself but not inside a chunk of lines: the
# start or end of the string, lookaround (it sees the neighbouring lines), atomic or possessive repeats
# (they swallow the following lines), inline flags (`(?s)`, `(?m)`)
_CHUNK_UNSAFE = regex.compile(r"\\[AZzGK]|\(\?[^:P]|\(\?P[>&]|[*+?}]\+")


# ── glob ───────────────────────────────────────────────────────────────────────────────────────


def _check_pattern(pattern: str) -> None:
    pure = PurePosixPath(pattern)
    if not pattern or pure.is_absolute() or ".." in pure.parts:
        raise ToolError(
            f"glob pattern {pattern!r} must be relative and without '..'; "
            "give the directory to search as `path` and a pattern like '**/*.py'"
        )


def _confirmed(root: RootDir, rel: str) -> str | None:
    """`rel` (relative to the working directory; `/` added for a directory) if it opens beneath it; else None."""
    try:
        fd = root.open_beneath(rel, ANY)
    except (OSError, ValueError):  # outside (a symlink pointing out), vanished
        return None
    try:
        return rel + ("/" if stat.S_ISDIR(os.fstat(fd).st_mode) else "")
    finally:
        os.close(fd)


def _segments_match(segments: list[str], parts: list[str]) -> bool:
    """Whether path `parts` match glob `segments` (`**`: any number of directories, none included)."""
    reach = [True] + [False] * len(parts)  # reach[j]: the segments so far match parts[:j]
    for segment in segments:
        if segment == "**":
            for j in range(1, len(reach)):
                reach[j] = reach[j] or reach[j - 1]
            continue
        reach = [False] + [reach[j] and fnmatch.fnmatchcase(parts[j], segment) for j in range(len(parts))]
    return reach[-1]


class Glob:
    """The alternatives of one glob pattern, matched against paths below the search base."""

    def __init__(self, pattern: str, ctx: ToolContext) -> None:
        self.pattern, self.ctx = pattern, ctx
        self.alternatives = [[s for s in alt.split("/") if s not in ("", ".")] for alt in expand_braces(pattern)]
        deep = any("**" in segments for segments in self.alternatives)
        self.max_depth = GREP_MAX_DEPTH if deep else max(len(segments) for segments in self.alternatives)

    def matches(self, below: str, is_dir: bool) -> bool:
        """Whether the path `below` (relative to the base) matches; a trailing `**` matches directories only."""
        parts = below.split("/")
        return any(
            _segments_match(segments, parts) and (is_dir or segments[-1:] != ["**"]) for segments in self.alternatives
        )

    def check_time(self) -> None:
        """Refuse to go on past the call's deadline or a cancel (checked at every directory)."""
        if self.ctx.seconds_left() <= 0 or self.ctx.cancelled():
            raise ToolError(
                f"glob {self.pattern!r} did not finish within its time limit; use a narrower pattern or path"
            )

    def walk(self, dir_fd: int, below: str = "", depth: int = 1) -> Iterator[tuple[str, bool]]:
        """(path below the base, is a directory) of every entry, by descriptor: symlinks are never entered."""
        self.check_time()
        dirs, files = _entries(dir_fd)
        for name in files:
            yield f"{below}{name}", False
        for name in dirs:
            yield f"{below}{name}", True
            if depth >= self.max_depth:
                continue
            try:
                sub = os.open(name, WALK_DIR_FLAGS, dir_fd=dir_fd)  # O_NOFOLLOW: a symlink swapped in is not entered
            except OSError:
                continue
            try:
                yield from self.walk(sub, f"{below}{name}/", depth + 1)
            finally:
                os.close(sub)


def _glob_matches(root: RootDir, base_fd: int, base: str, pattern: Glob) -> Iterator[str]:
    prefix = "" if base == "." else f"{base}/"
    for below, is_dir in pattern.walk(base_fd):
        if pattern.matches(below, is_dir) and (shown := _confirmed(root, prefix + below)):
            yield shown


def glob(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Paths matching a glob pattern (`**` recurses), sorted, relative to the working directory."""
    pattern, path = str(args["pattern"]), str(args.get("path", "."))
    _check_pattern(pattern)
    compiled = Glob(pattern, ctx)
    with root_of(ctx) as root:
        fd = open_directory(root, ctx, path)
        try:
            base = root.relative(fd, relative(root, ctx, path))
            found = set(islice(_glob_matches(root, fd, base, compiled), GLOB_MAX_SCANNED))
        finally:
            os.close(fd)
    if not found:
        return f"no paths match {pattern!r} under {path!r}"
    listing = bounded(sorted(found), GLOB_MAX_RESULTS, "use a narrower pattern or path")
    if len(found) >= GLOB_MAX_SCANNED:
        listing += f"\n[... the search stopped after {GLOB_MAX_SCANNED} matches; use a narrower pattern or path ...]"
    return listing


# ── grep_search ────────────────────────────────────────────────────────────────────────────────


def _lines(text: str) -> Iterator[str]:
    """The lines of `text`, each with its `\\n` (only `\\n` ends a line, as in the chunks' line numbers)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start) + 1 or len(text)
        yield text[start:end]
        start = end


@dataclass
class Search:
    """One search's pattern and time budget.

    A line matches when the pattern matches it searched by itself, its line ending included (as `re`
    per line did). To be fast, a file is searched a chunk of whole lines at a time: the pattern,
    compiled once more with MULTILINE (so `^` and `$` match at every line), finds the next candidate
    line in one call, and the original pattern confirms it on that line alone. That pre-filter finds
    every line that matches by itself only when the pattern does not look past its line (`\\A`,
    `\\Z`, lookaround, atomic or possessive repeats, inline flags): such a pattern is searched line
    by line (about 2 µs a line).
    """

    pattern: regex.Pattern[str]
    deadline: float
    cancelled: Callable[[], bool]
    lines_pattern: regex.Pattern[str] | None = field(init=False)  # None: search line by line
    where: str = ""  # the file being searched, for the message at the time limit

    def __post_init__(self) -> None:
        chunked = _CHUNK_UNSAFE.search(self.pattern.pattern) is None
        # compiled once more: the size bound checked before the first compile covers this copy too
        self.lines_pattern = (
            regex.compile(self.pattern.pattern, self.pattern.flags | regex.MULTILINE) if chunked else None
        )

    def _find(self, pattern: regex.Pattern[str], text: str, pos: int) -> regex.Match[str] | None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise OutOfTime
        try:
            # concurrent: the GIL is released while it matches, so other forks' threads (the heartbeat) run
            return pattern.search(text, pos, concurrent=True, timeout=left)
        except TimeoutError as exc:
            raise OutOfTime from exc

    def _matching(self, text: str, first: int) -> Iterator[tuple[int, str]]:
        """(line number, line) of the matching lines of `text`, whole lines whose first is line `first`."""
        if self.lines_pattern is None:
            for number, line in enumerate(_lines(text), first):
                if self._find(self.pattern, line, 0) is not None:
                    yield number, line.rstrip("\r\n")
            return
        pos = counted = 0
        number = first
        while pos < len(text) and (found := self._find(self.lines_pattern, text, pos)) is not None:
            start = text.rfind("\n", 0, found.start()) + 1
            if start >= len(text):  # an empty match after the last line ending: no line there
                return
            end = text.find("\n", found.start()) + 1 or len(text)
            number += text.count("\n", counted, start)
            counted = start
            line = text[start:end]
            if self._find(self.pattern, line, 0) is not None:
                yield number, line.rstrip("\r\n")
            pos = end

    def lines_of(self, fd: int, where: str) -> Iterator[tuple[int, str]]:
        """(line number, line) of every matching line of the text file open on `fd` (closed after)."""
        self.where = where
        try:
            with os.fdopen(fd, "rb") as raw:
                pending = raw.read(BINARY_SNIFF_BYTES)
                if b"\0" in pending:
                    return
                number, total = 1, len(pending)
                while True:
                    more = raw.read(GREP_CHUNK_BYTES) if total < GREP_MAX_FILE_BYTES else b""
                    total += len(more)
                    data = pending + more
                    cut = data.rfind(b"\n") + 1 if more else len(data)
                    if more and not cut:  # no line ending yet: a long line, read on
                        pending = data
                        continue
                    if self.cancelled():
                        raise OutOfTime
                    yield from self._matching(data[:cut].decode("utf-8", "replace"), number)
                    number += data.count(b"\n", 0, cut)
                    pending = data[cut:]
                    if not more:
                        return
        except OSError:  # unreadable midway: nothing more to report from it
            return


def _include_filter(include: str | None) -> Callable[[str, str], bool]:
    """A test of (file name, path relative to the search base); a pattern with `/` is matched against the path."""
    if not include:
        return lambda name, relative: True
    patterns = expand_braces(include)
    if "/" in include:
        return lambda name, relative: any(fnmatch.fnmatchcase(relative, p) for p in patterns)
    return lambda name, relative: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _entries(dir_fd: int) -> tuple[list[str], list[str]]:
    """(subdirectories, other names) of a directory, sorted; symlinks count as files, never as directories."""
    dirs: list[str] = []
    files: list[str] = []
    try:
        with os.scandir(dir_fd) as listing:
            for entry in listing:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:  # vanished meanwhile
                    continue
                (dirs if is_dir else files).append(entry.name)
    except OSError:  # unreadable directory: nothing in it to search
        return [], []
    return sorted(d for d in dirs if d not in SKIPPED_DIRS), sorted(files)


def _tree(dir_fd: int, below: str, depth: int = 0) -> Iterator[tuple[int, str, str]]:
    """(directory descriptor, file name, path below the base) of every file, in sorted order, top first."""
    dirs, files = _entries(dir_fd)
    for name in files:
        yield dir_fd, name, f"{below}{name}"
    if depth >= GREP_MAX_DEPTH:
        return
    for name in dirs:
        try:
            sub = os.open(name, WALK_DIR_FLAGS, dir_fd=dir_fd)  # O_NOFOLLOW: a symlink swapped in is not entered
        except OSError:
            continue
        try:
            yield from _tree(sub, f"{below}{name}/", depth + 1)
        finally:
            os.close(sub)


def _reopen(fd: int, flags: int) -> int:
    """The object of the O_PATH descriptor `fd` opened for I/O (the very object: no name is resolved again)."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_NONBLOCK | os.O_CLOEXEC)


def _searchable(fd: int) -> bool:
    info = os.fstat(fd)
    return stat.S_ISREG(info.st_mode) and info.st_size <= GREP_MAX_FILE_BYTES


def _open_entry(root: RootDir, dir_fd: int, name: str, shown: str) -> int | None:
    """A descriptor of a regular, small enough file to search; None to skip it (special, huge, outside).

    The name's object is looked at (O_PATH) before it is opened for reading, as `open_regular` does:
    opening a device or FIFO for I/O can itself have an effect (a FIFO's writer is let through).
    """
    try:
        fd = os.open(name, ANY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:  # vanished
        return None
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):  # a symlink: followed only while it resolves inside
            link, fd = fd, -1
            os.close(link)
            fd = root.open_beneath(shown, ANY)
        if not _searchable(fd):
            return None
        opened = _reopen(fd, os.O_RDONLY)
    except (OSError, ValueError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    if not _searchable(opened):  # swapped meanwhile
        os.close(opened)
        return None
    return opened


def _hits(root: RootDir, base_fd: int, base: str, include: str | None, search: Search) -> Iterator[str]:
    """`path:line:text` of every match under the directory `base` (relative to the working directory)."""
    wanted = _include_filter(include)
    prefix = "" if base == "." else f"{base}/"
    for dir_fd, name, below in _tree(base_fd, ""):
        if search.cancelled():
            raise OutOfTime
        if not wanted(name, below):
            continue
        shown = prefix + below
        fd = _open_entry(root, dir_fd, name, shown)
        if fd is not None:
            for number, text in search.lines_of(fd, shown):
                yield f"{shown}:{number}:{clip(text, GREP_LINE_MAX_CHARS)}"


def _compile(pattern: str) -> regex.Pattern[str]:
    if len(pattern) > GREP_MAX_PATTERN_CHARS:
        raise ToolError(f"pattern of {len(pattern)} characters is too long (at most {GREP_MAX_PATTERN_CHARS})")
    if (size := expanded_size(pattern)) > GREP_MAX_PATTERN_SIZE:
        raise ToolError(
            f"pattern {pattern!r} is too large once its counted repeats are expanded (about {size:,} "
            f"elements, at most {GREP_MAX_PATTERN_SIZE:,}): nested repeats such as (a{{100}}){{100}} multiply; "
            "use smaller counts or `+` / `*` instead of large {m,n} bounds"
        )
    try:
        return regex.compile(pattern)
    except (regex.error, ValueError, OverflowError) as exc:
        raise ToolError(f"pattern {pattern!r} is not a valid Python regular expression: {exc}") from exc


def _found(root: RootDir, ctx: ToolContext, path: str, include: Any, search: Search) -> list[str]:
    """Up to GREP_MAX_MATCHES + 1 hits for a file or directory `path`."""
    try:
        fd = open_path(root, ctx, path, ANY)  # looked at before it is opened for I/O: a device is not opened
    except PermissionError as exc:
        raise ToolError(
            f"permission denied: {path!r} cannot be searched; give a file or directory you can read"
        ) from exc
    except OSError as exc:
        raise ToolError(f"{path!r} does not exist; give a file or directory inside the working directory") from exc
    try:
        mode = os.fstat(fd).st_mode
        base = root.relative(fd, relative(root, ctx, path))
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise ToolError(f"{path!r} is not a regular file or a directory; give a file or directory to search")
        try:
            opened = _reopen(fd, os.O_RDONLY | (os.O_DIRECTORY if stat.S_ISDIR(mode) else 0))
        except OSError as exc:
            raise ToolError(
                f"cannot read {path!r}: {exc.strerror or exc}; give a file or directory you can read"
            ) from exc
    finally:
        os.close(fd)
    if stat.S_ISDIR(mode):
        try:
            return list(islice(_hits(root, opened, base, include, search), GREP_MAX_MATCHES + 1))
        finally:
            os.close(opened)
    lines = search.lines_of(opened, base)  # closes it
    return [f"{base}:{n}:{clip(text, GREP_LINE_MAX_CHARS)}" for n, text in islice(lines, GREP_MAX_MATCHES + 1)]


def grep_search(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """`path:line:text` for every line matching a Python regular expression, files in sorted order."""
    pattern, path, include = str(args["pattern"]), str(args.get("path", ".")), args.get("include")
    # asked first: it also tells the registry this handler watches `cancelled`, so at the deadline it waits
    # the short grace for the search's own answer (which names the pattern) instead of abandoning it
    if ctx.cancelled():
        raise ToolError("the fork was cancelled; the search was not run")
    compiled = _compile(pattern)
    started = time.monotonic()
    # the call's own deadline, to the instant: a caller that stops waiting at it (`ToolRegistry.run`) makes
    # `cancelled()` true at a time this search then reads as its limit, not as a cancel
    search = Search(compiled, min(started + GREP_TIME_LIMIT_S, ctx.deadline), ctx.cancelled)
    budget = max(0.0, search.deadline - started)
    with root_of(ctx) as root:
        try:
            found = _found(root, ctx, path, include, search)
        except OutOfTime:
            # a cancel stopped it only if the fork was cancelled with time left: the regex engine's own
            # timeout can fire a little before `time.monotonic()` reaches the deadline
            if time.monotonic() < search.deadline and ctx.cancelled():
                raise ToolError("the fork was cancelled; the search was stopped") from None
            raise ToolError(
                f"grep_search stopped after {round(budget, 1):g} s, its time limit, in {search.where!r}: the "
                f"pattern {pattern!r} is too slow here (nested repetition such as (a+)+ or (a|a)+ backtracks "
                "exponentially on long lines). Simplify the pattern (no nested or overlapping repetition, anchor "
                "it), or narrow `path` or `include`"
            ) from None
    if not found:
        where = f" in files matching {include!r}" if include else ""
        return f"no matches for {pattern!r} under {path!r}{where}"
    if len(found) <= GREP_MAX_MATCHES:
        return "\n".join(found)
    shown = "\n".join(found[:GREP_MAX_MATCHES])
    return f"{shown}\n[... stopped after {GREP_MAX_MATCHES} matches; narrow the pattern, path or include ...]"

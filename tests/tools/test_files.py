"""The file tools (workers/tools/files.py): read_file, list_directory, write_file and edit.

Every test uses its own `tmp_path` as the fork's working directory (`work/`), with a sibling
`outside/` directory the tools must never reach; a FIFO or socket is refused at once, never opened.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.tools_support import context, error, output, run, run_bounded
from workers.history.messages import FunctionCall
from workers.tools import files as builtin_tools
from workers.tools.registry import ToolContext, ToolRegistry
from workers.workspace.sandbox import Confinement

# ── confinement to the working directory ───────────────────────────────────────────────────────

ESCAPES = ["dotdot", "absolute", "symlink"]


def escape_path(work: Path, kind: str, leaf: str) -> str:
    """A path naming `outside/<leaf>` by `..`, as an absolute path, or through a symlink inside `work`."""
    outside = work.parent / "outside"
    if kind == "dotdot":
        return f"../outside/{leaf}".rstrip("/")
    if kind == "absolute":
        return str(outside / leaf).rstrip("/")
    (work / "link").symlink_to(outside, target_is_directory=True)
    return f"link/{leaf}".rstrip("/")


ESCAPE_CALLS: dict[str, Callable[[str], dict[str, Any]]] = {
    "read_file": lambda p: {"path": f"{p}/secret.txt"},
    "list_directory": lambda p: {"path": p},
    "glob": lambda p: {"pattern": "*", "path": p},
    "grep_search": lambda p: {"pattern": "secret", "path": p},
    "write_file": lambda p: {"path": f"{p}/secret.txt", "content": "overwritten"},
    "edit": lambda p: {"path": f"{p}/secret.txt", "old_string": "42", "new_string": "43"},
}


@pytest.mark.parametrize("kind", ESCAPES)
@pytest.mark.parametrize("tool", sorted(ESCAPE_CALLS))
def test_path_taking_tools_refuse_paths_outside_the_working_directory(
    registry: ToolRegistry, work: Path, tool: str, kind: str
) -> None:
    args = ESCAPE_CALLS[tool](escape_path(work, kind, ""))
    message = error(run(registry, work, tool, **args))
    assert "is outside the working directory" in message and "use a path inside it" in message
    assert (work.parent / "outside" / "secret.txt").read_text(encoding="utf-8") == "secret: the key is 42\n"


@pytest.mark.parametrize("tool", ["write_file", "edit"])
def test_writes_through_a_dangling_symlink_out_are_refused(registry: ToolRegistry, work: Path, tool: str) -> None:
    (work / "new.txt").symlink_to(work.parent / "outside" / "created.txt")
    args = {"path": "new.txt", "content": "x"} if tool == "write_file" else {"path": "new.txt"}
    if tool == "edit":
        args |= {"old_string": "a", "new_string": "b"}
    assert "outside the working directory" in error(run(registry, work, tool, **args))
    assert not (work.parent / "outside" / "created.txt").exists()


def test_an_absolute_path_inside_the_working_directory_is_accepted(registry: ToolRegistry, work: Path) -> None:
    (work / "a.txt").write_text("hello\n", encoding="utf-8")
    assert output(run(registry, work, "read_file", path=str(work / "a.txt"))) == "hello\n"


# ── read_file and list_directory ───────────────────────────────────────────────────────────────


def test_read_file_returns_the_text_and_pages_with_offset_and_limit(registry: ToolRegistry, work: Path) -> None:
    (work / "lines.txt").write_text("".join(f"line {n}\n" for n in range(1, 11)), encoding="utf-8")
    assert output(run(registry, work, "read_file", path="lines.txt")).count("\n") == 10
    page = output(run(registry, work, "read_file", path="lines.txt", offset=2, limit=3))
    assert page == (
        "line 3\nline 4\nline 5\n[... truncated: showing lines 3-5; call read_file with offset=5 to read on ...]"
    )
    assert output(run(registry, work, "read_file", path="lines.txt", offset=8)) == "line 9\nline 10\n"


def test_read_file_explains_missing_files_directories_binaries_and_offsets(registry: ToolRegistry, work: Path) -> None:
    (work / "dir").mkdir()
    (work / "blob.bin").write_bytes(b"\x89PNG\0\0\0")
    (work / "short.txt").write_text("one\ntwo\n", encoding="utf-8")
    (work / "empty.txt").write_text("", encoding="utf-8")
    assert "does not exist; use glob" in error(run(registry, work, "read_file", path="nope.txt"))
    assert "is a directory, not a file" in error(run(registry, work, "read_file", path="dir"))
    assert "is a binary file" in error(run(registry, work, "read_file", path="blob.bin"))
    assert "past the end of 'short.txt', which has 2 lines" in error(
        run(registry, work, "read_file", path="short.txt", offset=5)
    )
    assert output(run(registry, work, "read_file", path="empty.txt")) == "(empty file)"
    assert "maximum of 2000" in error(run(registry, work, "read_file", path="short.txt", limit=10_000))


def test_read_file_is_bounded_in_characters_and_clips_long_lines(registry: ToolRegistry, work: Path) -> None:
    (work / "wide.txt").write_text("x" * 5000 + "\nshort\n", encoding="utf-8")
    text = output(run(registry, work, "read_file", path="wide.txt"))
    assert text == "x" * 2000 + "[... line truncated: 3000 chars omitted ...]\nshort\n"
    (work / "big.txt").write_text(("y" * 1999 + "\n") * 1000, encoding="utf-8")  # 2 MB in 1000 lines
    page = output(run(registry, work, "read_file", path="big.txt"))
    assert len(page) <= builtin_tools.READ_MAX_CHARS + 2100
    assert "call read_file with offset=" in page


def test_read_file_never_holds_a_huge_line_whole(work: Path) -> None:
    (work / "minified.js").write_bytes(b"first\n" + b"x" * (32 * 1024 * 1024) + b"\nlast\n")
    tracemalloc.start()
    try:
        text = builtin_tools.read_file({"path": "minified.js"}, context(work))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    lines = text.splitlines()
    assert lines[0] == "first" and lines[2] == "last"
    assert lines[1] == "x" * 2000 + f"[... line truncated: {32 * 1024 * 1024 - 2000} chars omitted ...]"
    assert peak < 4 * 1024 * 1024  # the 32 MiB line was read past, never held (it was: 96 MiB and more)


def test_list_directory_does_not_follow_a_symlink_to_a_directory(registry: ToolRegistry, work: Path) -> None:
    (work / "link").symlink_to(work.parent / "outside")
    (work / "own").mkdir()
    assert output(run(registry, work, "list_directory")) == "link\nown/"


def test_list_directory_sorts_entries_and_marks_directories(registry: ToolRegistry, work: Path) -> None:
    (work / "b.txt").write_text("", encoding="utf-8")
    (work / "a").mkdir()
    (work / "c.py").write_text("", encoding="utf-8")
    (work / "a" / "inner.txt").write_text("", encoding="utf-8")
    assert output(run(registry, work, "list_directory")) == "a/\nb.txt\nc.py"
    assert output(run(registry, work, "list_directory", path="a")) == "inner.txt"
    (work / "empty").mkdir()
    assert output(run(registry, work, "list_directory", path="empty")) == "(directory 'empty' is empty)"
    assert "is not a directory" in error(run(registry, work, "list_directory", path="b.txt"))


def test_list_directory_is_bounded(registry: ToolRegistry, work: Path) -> None:
    for n in range(builtin_tools.LIST_MAX_ENTRIES + 7):
        (work / f"f{n:05}").touch()
    listing = output(run(registry, work, "list_directory"))
    assert listing.count("\n") == builtin_tools.LIST_MAX_ENTRIES
    assert listing.endswith("[... 7 more not shown; list a subdirectory, or use glob with a narrower pattern ...]")


# ── write_file and edit ────────────────────────────────────────────────────────────────────────


def test_write_file_creates_parent_directories_and_overwrites(registry: ToolRegistry, work: Path) -> None:
    assert output(run(registry, work, "write_file", path="a/b/c.txt", content="one\n")) == "created a/b/c.txt (4 bytes)"
    assert output(run(registry, work, "write_file", path="a/b/c.txt", content="two\n")) == (
        "overwrote a/b/c.txt (4 bytes)"
    )
    assert (work / "a" / "b" / "c.txt").read_text(encoding="utf-8") == "two\n"


def test_write_file_twice_with_the_same_content_is_the_same_file(registry: ToolRegistry, work: Path) -> None:
    for _ in range(2):
        output(run(registry, work, "write_file", path="x.txt", content="même contenu\r\n"))
    assert (work / "x.txt").read_bytes() == "même contenu\r\n".encode()


def test_write_file_refuses_a_directory_and_missing_content(registry: ToolRegistry, work: Path) -> None:
    (work / "d").mkdir()
    assert "is a directory" in error(run(registry, work, "write_file", path="d", content="x"))
    assert "'content' is a required property" in error(run(registry, work, "write_file", path="new.txt"))
    assert not (work / "new.txt").exists()


def test_edit_replaces_the_one_exact_occurrence(registry: ToolRegistry, work: Path) -> None:
    (work / "m.py").write_text("a = 1\nb = 2\nc = 3\n", encoding="utf-8")
    result = output(run(registry, work, "edit", path="m.py", old_string="b = 2\n", new_string="b = 20\n"))
    assert result == "edited m.py: replaced 1 occurrence at line 2"
    assert (work / "m.py").read_text(encoding="utf-8") == "a = 1\nb = 20\nc = 3\n"


def test_edit_with_no_match_says_to_copy_the_exact_text(registry: ToolRegistry, work: Path) -> None:
    (work / "m.py").write_text("def f():\n    return 1\n", encoding="utf-8")
    message = error(run(registry, work, "edit", path="m.py", old_string="def f():\n  return 1", new_string="x"))
    assert "old_string was not found in 'm.py'" in message and "including whitespace and indentation" in message
    assert (work / "m.py").read_text(encoding="utf-8") == "def f():\n    return 1\n"


def test_edit_with_several_matches_says_to_include_more_context(registry: ToolRegistry, work: Path) -> None:
    (work / "m.py").write_text("x = 0\ny = 1\nx = 0\n", encoding="utf-8")
    message = error(run(registry, work, "edit", path="m.py", old_string="x = 0", new_string="x = 9"))
    assert "occurs 2 times in 'm.py' (starting at lines 1, 3)" in message
    assert "Include more surrounding context" in message
    (work / "o.txt").write_text("aaa", encoding="utf-8")  # overlapping occurrences are ambiguous too
    assert "occurs 2 times" in error(run(registry, work, "edit", path="o.txt", old_string="aa", new_string="b"))
    assert (work / "m.py").read_text(encoding="utf-8") == "x = 0\ny = 1\nx = 0\n"


def test_edit_refuses_a_file_over_its_size_limit_and_points_to_write_file(registry: ToolRegistry, work: Path) -> None:
    big = work / "big.txt"
    with big.open("wb") as f:
        f.write(b"needle\n")
        f.truncate(builtin_tools.EDIT_MAX_BYTES + 1)
    message = error(run(registry, work, "edit", path="big.txt", old_string="needle", new_string="pin"))
    assert message == (
        "'big.txt' is 16,777,217 bytes, larger than edit changes (at most 16,777,216); replace its whole "
        "content with write_file, or use run_shell_command (sed) for a local change"
    )
    assert big.read_bytes()[:7] == b"needle\n"


def test_edit_matches_newlines_in_a_crlf_file(registry: ToolRegistry, work: Path) -> None:
    (work / "w.txt").write_bytes(b"one\r\ntwo\r\nthree\r\n")
    output(run(registry, work, "edit", path="w.txt", old_string="one\ntwo", new_string="1\n2"))
    assert (work / "w.txt").read_bytes() == b"1\r\n2\r\nthree\r\n"


def test_edit_refuses_empty_or_unchanged_strings_and_non_text_files(registry: ToolRegistry, work: Path) -> None:
    (work / "t.txt").write_text("text\n", encoding="utf-8")
    (work / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert "old_string is empty" in error(run(registry, work, "edit", path="t.txt", old_string="", new_string="x"))
    assert "the same" in error(run(registry, work, "edit", path="t.txt", old_string="text", new_string="text"))
    assert "not UTF-8 text" in error(run(registry, work, "edit", path="latin1.txt", old_string="caf", new_string="x"))
    assert "does not exist" in error(run(registry, work, "edit", path="none.txt", old_string="a", new_string="b"))


# ── special files: a FIFO or socket never hangs a call (issue 11, item 6) ───────────────────────

FILE_CALLS: dict[str, dict[str, Any]] = {
    "read_file": {"path": "pipe"},
    "write_file": {"path": "pipe", "content": "x"},
    "edit": {"path": "pipe", "old_string": "a", "new_string": "b"},
}


@pytest.mark.parametrize("tool", sorted(FILE_CALLS))
def test_a_fifo_is_refused_at_once_by_the_tools_that_open_files(
    registry: ToolRegistry, work: Path, fifo: Path, tool: str
) -> None:
    started = time.monotonic()
    message = error(run_bounded(registry, work, fifo, tool, **FILE_CALLS[tool]))
    assert message == "'pipe' is a FIFO, not a regular file; the file tools read and write regular files only"
    assert time.monotonic() - started < 2


# ── a snapshot fork: the parent's path leads into the workspace ───────────────────────────────────

PARENT = "/home/alice/proj"  # the parent's cwd, which this machine does not have


def confined(work: Path) -> ToolContext:
    """The context of a snapshot fork whose workspace is `work`, seen by the parent at PARENT."""
    tmp = work.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    return replace(context(work), confinement=Confinement(work, PARENT, tmp))


def test_a_write_to_the_parents_path_lands_in_the_workspace(registry: ToolRegistry, work: Path) -> None:
    call = FunctionCall(id="c1", name="write_file", args={"path": f"{PARENT}/src/x.py", "content": "x = 1\n"})
    output(registry.run(call, confined(work)))
    assert (work / "src" / "x.py").read_text(encoding="utf-8") == "x = 1\n"


@pytest.mark.parametrize(
    ("tool", "args", "expected"),
    [
        ("read_file", {"path": f"{PARENT}/a.txt"}, "from the parent"),
        ("list_directory", {"path": PARENT}, "a.txt"),
        ("glob", {"pattern": "*.txt", "path": PARENT}, "a.txt"),
        ("grep_search", {"pattern": "parent", "path": f"{PARENT}/a.txt"}, "a.txt:1:from the parent"),
    ],
)
def test_the_parents_paths_are_read_from_the_workspace(
    registry: ToolRegistry, work: Path, tool: str, args: dict[str, Any], expected: str
) -> None:
    (work / "a.txt").write_text("from the parent\n", encoding="utf-8")
    assert expected in output(registry.run(FunctionCall(id="c1", name=tool, args=args), confined(work)))


def test_other_absolute_paths_stay_refused_in_a_snapshot_fork(registry: ToolRegistry, work: Path) -> None:
    outside = work.parent / "outside" / "secret.txt"
    call = FunctionCall(id="c1", name="read_file", args={"path": str(outside)})
    message = error(registry.run(call, confined(work)))
    # the working directory is named as the model knows it: the parent's path
    assert f"is outside the working directory {PARENT!r}" in message
    # and `..` out of the parent's path leads out of the workspace: refused the same way
    call = FunctionCall(id="c1", name="read_file", args={"path": f"{PARENT}/../outside/secret.txt"})
    assert "is outside the working directory" in error(registry.run(call, confined(work)))

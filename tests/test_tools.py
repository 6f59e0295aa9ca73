"""The tool registry and the built-in coding tools, run through `ToolRegistry.run` as the child loop runs them.

Every test uses its own `tmp_path` as the fork's working directory (`work/`), with a sibling
`outside/` directory the tools must never reach. Shell tests run real bash processes and check
through /proc that the processes a command started are really gone. The tests at the end run forks
through real Celery workers (in-process, or `forkq worker` processes) on the private Redis: a
poisonous pattern beside bystander forks, a call stuck on a FIFO, a symlink swapped mid-fork.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun
from conftest import TEST_NAMESPACE, WorkerProcess
from live import wait_until
from loop_support import FORK, call, parent_for, step, tool_results, workdir, write_script
from prometheus_client import CollectorRegistry

from broker_config.settings import Settings
from workers.app import make_app, runtime_of
from workers.client import ForkClient
from workers.errors import ConfigurationError
from workers.history.messages import FunctionCall
from workers.keys import Keys
from workers.records.fork import Status
from workers.service.metrics import Metrics
from workers.service.runner import WorkerRuntime
from workers.tools import files as builtin_tools
from workers.tools import search, shell, shell_supervisor
from workers.tools.builtins import ENTRY_POINT_GROUP, load_tools
from workers.tools.builtins import builtin_tools as make_builtin_registry
from workers.tools.registry import (
    TOOL_MAX_ABANDONED,
    TOOL_STOP_GRACE_S,
    TOOL_WAIT_POLL_S,
    Tool,
    ToolContext,
    ToolError,
    ToolRegistry,
    resolve_inside,
)

# ── helpers ────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """The fork's working directory; `tmp_path/outside` holds a secret beside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret: the key is 42\n", encoding="utf-8")
    cwd = tmp_path / "work"
    cwd.mkdir()
    return cwd


@pytest.fixture
def registry() -> ToolRegistry:
    return make_builtin_registry()


def context(cwd: Path, cancelled: Callable[[], bool] | None = None, within_s: float | None = None) -> ToolContext:
    """The context of call c1 of fork f-tools; `within_s`: the fork's wall-clock limit is that far away."""
    extra: dict[str, Any] = {} if cancelled is None else {"cancelled": cancelled}
    if within_s is not None:
        extra["deadline"] = time.monotonic() + within_s
    return ToolContext(fork_id="f-tools", cwd=cwd, call_id="c1", idempotency_key="f-tools:0:c1", **extra)


def run(registry: ToolRegistry, cwd: Path, name: str, **args: Any) -> dict[str, Any]:
    return registry.run(FunctionCall(id="c1", name=name, args=args), context(cwd))


def output(response: dict[str, Any]) -> str:
    assert "error" not in response, response
    text = response["output"]
    assert isinstance(text, str)
    return text


def error(response: dict[str, Any]) -> str:
    assert "output" not in response, response
    text = response["error"]
    assert isinstance(text, str)
    return text


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def all_gone(pids: list[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def pids_in(text: str) -> list[int]:
    return [int(found) for found in re.findall(r"pid=(\d+)", text)]


# ── the registry ───────────────────────────────────────────────────────────────────────────────


def test_the_builtins_are_declared_with_their_flags(registry: ToolRegistry) -> None:
    flags = {name: (t.mutating, t.idempotent, t.edit) for name, t in registry.tools.items()}
    assert flags == {
        "read_file": (False, True, False),
        "list_directory": (False, True, False),
        "glob": (False, True, False),
        "grep_search": (False, True, False),
        "write_file": (True, True, True),
        "edit": (True, False, True),
        "run_shell_command": (True, False, False),
    }
    for tool in registry.tools.values():
        declaration = tool.declaration
        assert declaration["name"] == tool.name and declaration["description"]
        assert declaration["parameters"]["additionalProperties"] is False


def test_a_tool_context_is_never_cancelled_by_default(work: Path) -> None:
    assert context(work).cancelled() is False


def test_an_unknown_tool_is_answered_with_the_available_ones(registry: ToolRegistry, work: Path) -> None:
    message = error(run(registry, work, "rm_rf"))
    assert "'rm_rf' is not available" in message and "read_file" in message


def recording_tool(calls: list[Mapping[str, Any]], parameters: Mapping[str, Any]) -> Tool:
    def handler(args: Mapping[str, Any], ctx: ToolContext) -> str:
        calls.append(args)
        return "ran"

    return Tool("record", "Records its arguments.", parameters, handler)


STRICT = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "count": {"type": "integer", "minimum": 1}},
    "required": ["path"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({}, "'path' is a required property"),
        ({"path": 3}, "argument 'path': 3 is not of type 'string'"),
        ({"path": "a", "count": "two"}, "argument 'count': 'two' is not of type 'integer'"),
        ({"path": "a", "count": 0}, "argument 'count': 0 is less than the minimum of 1"),
        ({"path": "a", "file_path": "b"}, "('file_path' was unexpected)"),
    ],
)
def test_arguments_breaking_the_schema_are_refused_before_the_handler_runs(
    work: Path, args: dict[str, Any], expected: str
) -> None:
    calls: list[Mapping[str, Any]] = []
    registry = ToolRegistry()
    registry.register(recording_tool(calls, STRICT))
    message = error(run(registry, work, "record", **args))
    assert expected in message
    assert "Nothing was run" in message and "path (string, required), count (integer)" in message
    assert calls == []


def test_valid_arguments_reach_the_handler(work: Path) -> None:
    calls: list[Mapping[str, Any]] = []
    registry = ToolRegistry()
    registry.register(recording_tool(calls, STRICT))
    assert run(registry, work, "record", path="a", count=2) == {"output": "ran"}
    assert calls == [{"path": "a", "count": 2}]


def test_a_huge_bad_argument_is_clipped_in_the_error(work: Path) -> None:
    registry = ToolRegistry()
    registry.register(recording_tool([], {"type": "object", "properties": {"n": {"type": "integer"}}}))
    message = error(run(registry, work, "record", n="x" * 100_000))
    assert len(message) < 1000 and "…" in message


def test_a_schema_that_is_not_json_schema_is_refused_at_registration() -> None:
    bad = recording_tool([], {"type": "object", "properties": {"n": {"type": "integr"}}})
    with pytest.raises(ConfigurationError, match="'record': its parameters are not a valid JSON schema") as caught:
        ToolRegistry().register(bad)
    assert caught.value.field == "record"


def test_the_declared_schema_draft_is_the_one_validated_against(work: Path) -> None:
    # draft-04's boolean exclusiveMinimum is invalid in 2020-12: registering proves the draft was honoured
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {"n": {"type": "number", "minimum": 0, "exclusiveMinimum": True}},
    }
    registry = ToolRegistry()
    registry.register(recording_tool([], draft4))
    assert "less than or equal to the minimum of 0" in error(run(registry, work, "record", n=0))
    assert run(registry, work, "record", n=1) == {"output": "ran"}


def test_a_tool_put_into_the_dict_directly_is_still_validated(work: Path) -> None:
    calls: list[Mapping[str, Any]] = []
    registry = ToolRegistry()
    registry.tools["record"] = recording_tool(calls, STRICT)
    assert "'path' is a required property" in error(run(registry, work, "record"))
    assert calls == []


def test_handler_failures_become_error_responses(work: Path) -> None:
    def refuse(args: Mapping[str, Any], ctx: ToolContext) -> str:
        raise ToolError("refused: reason given")

    def crash(args: Mapping[str, Any], ctx: ToolContext) -> str:
        raise KeyError("boom")

    registry = ToolRegistry()
    registry.register(Tool("refuse", "Refuses.", {"type": "object"}, refuse))
    registry.register(Tool("crash", "Crashes.", {"type": "object"}, crash))
    assert run(registry, work, "refuse") == {"error": "refused: reason given"}
    assert error(run(registry, work, "crash")) == "tool 'crash' failed: KeyError: 'boom'"


PLUGIN = """
from workers.tools.registry import Tool

def _effect(args, ctx):
    with open(args["target"], "a", encoding="utf-8") as out:
        out.write("ran\\n")
    return "effect"

SCHEMA = {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"],
          "additionalProperties": False}

def tools():
    return [Tool("plugin_effect", "Appends a line.", SCHEMA, _effect, mutating=True)]

BROKEN = Tool("plugin_broken", "Bad schema.", {"type": "objekt"}, _effect)
"""


def test_entry_point_tools_are_loaded_and_validated_like_builtins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: an installed distribution declaring a good and a broken tool in the forkq.tools group
    module = f"forkq_plugin_{uuid.uuid4().hex}"
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{module}.py").write_text(PLUGIN, encoding="utf-8")
    dist = site / f"{module}-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.0\n", encoding="utf-8")
    entries = f"[{ENTRY_POINT_GROUP}]\ngood = {module}:tools\nbroken = {module}:BROKEN\n"
    (dist / "entry_points.txt").write_text(entries, encoding="utf-8")
    monkeypatch.syspath_prepend(str(site))
    target = tmp_path / "effects.txt"

    # When: the worker loads its tools
    with caplog.at_level(logging.ERROR, logger="forkq.tools"):
        registry = load_tools()

    # Then: the good tool is there beside the built-ins, validated; the broken one was logged and skipped
    assert {"plugin_effect", "read_file", "run_shell_command"} <= set(registry.tools)
    assert "plugin_broken" not in registry.tools
    assert "plugin_broken" in caplog.text and "not a valid JSON schema" in caplog.text
    assert "'target' is a required property" in error(run(registry, tmp_path, "plugin_effect"))
    assert "was unexpected" in error(run(registry, tmp_path, "plugin_effect", target=str(target), extra=1))
    assert not target.exists()
    assert run(registry, tmp_path, "plugin_effect", target=str(target)) == {"output": "effect"}
    assert target.read_text(encoding="utf-8") == "ran\n"


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


def test_glob_and_grep_skip_symlinks_that_point_out(registry: ToolRegistry, work: Path) -> None:
    (work / "link").symlink_to(work.parent / "outside", target_is_directory=True)
    (work / "leak.txt").symlink_to(work.parent / "outside" / "secret.txt")
    (work / "own.txt").write_text("secret of our own\n", encoding="utf-8")
    assert output(run(registry, work, "glob", pattern="*/*.txt")).startswith("no paths match")
    assert output(run(registry, work, "glob", pattern="*.txt")) == "own.txt"
    assert output(run(registry, work, "grep_search", pattern="secret")) == "own.txt:1:secret of our own"


def test_an_absolute_path_inside_the_working_directory_is_accepted(registry: ToolRegistry, work: Path) -> None:
    (work / "a.txt").write_text("hello\n", encoding="utf-8")
    assert output(run(registry, work, "read_file", path=str(work / "a.txt"))) == "hello\n"


def test_resolve_inside_refuses_an_unresolvable_path(work: Path) -> None:
    with pytest.raises(ToolError, match="cannot be resolved"):
        resolve_inside(work, "bad\0name")


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


# ── glob and grep_search ───────────────────────────────────────────────────────────────────────


def source_tree(work: Path) -> None:
    files = {
        "src/app.py": "import os\ndef main():\n    return os.getcwd()\n",
        "src/util.py": "def helper():\n    return 1\n",
        "src/web/page.ts": "export const main = 1;\n",
        "src/web/view.tsx": "export function main() {}\n",
        "README.md": "call main() to start\n",
        ".git/config": "def main in git internals\n",
    }
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text, encoding="utf-8")
    (work / "src" / "logo.bin").write_bytes(b"def main\0binary")


def test_glob_returns_sorted_paths_relative_to_the_working_directory(registry: ToolRegistry, work: Path) -> None:
    source_tree(work)
    assert output(run(registry, work, "glob", pattern="**/*.py")) == "src/app.py\nsrc/util.py"
    assert output(run(registry, work, "glob", pattern="*.{ts,tsx}", path="src/web")) == (
        "src/web/page.ts\nsrc/web/view.tsx"
    )
    assert output(run(registry, work, "glob", pattern="src/*")) == "src/app.py\nsrc/logo.bin\nsrc/util.py\nsrc/web/"
    assert ".git" not in output(run(registry, work, "glob", pattern="**/*"))
    assert output(run(registry, work, "glob", pattern="*.rs")) == "no paths match '*.rs' under '.'"


def test_glob_refuses_absolute_and_parent_patterns(registry: ToolRegistry, work: Path) -> None:
    for pattern in ["../outside/*", "/etc/*", "src/../../outside/*"]:
        assert "must be relative and without '..'" in error(run(registry, work, "glob", pattern=pattern))


def test_glob_results_are_bounded(registry: ToolRegistry, work: Path) -> None:
    for n in range(search.GLOB_MAX_RESULTS + 3):
        (work / f"m{n:05}.txt").touch()
    listing = output(run(registry, work, "glob", pattern="*.txt"))
    assert listing.splitlines()[0] == "m00000.txt"
    assert listing.endswith("[... 3 more not shown; use a narrower pattern or path ...]")


def test_glob_does_not_walk_a_symlink_to_a_directory_outside(registry: ToolRegistry, work: Path) -> None:
    outside = work.parent / "outside"
    for n in range(20):
        (outside / f"d{n}").mkdir()
        (outside / f"d{n}" / "f.txt").touch()
    (work / "link").symlink_to(outside)
    (work / "own").mkdir()
    asked: list[bool] = []

    def cancelled() -> bool:  # asked at every directory the walk enters
        asked.append(True)
        return False

    ctx = context(work, cancelled=cancelled)
    assert search.glob({"pattern": "link/**/*"}, ctx) == "no paths match 'link/**/*' under '.'"
    assert search.glob({"pattern": "**/*"}, ctx) == "own/"  # the link points out: neither entered nor listed
    assert len(asked) <= 4  # the working directory and own/, twice: none of the 21 outside


def test_glob_stops_at_its_deadline_even_when_nothing_matches(work: Path) -> None:
    for n in range(50):
        (work / f"d{n}" / "deeper").mkdir(parents=True)
    with pytest.raises(ToolError, match="did not finish within its time limit; use a narrower pattern or path"):
        search.glob({"pattern": "**/*.nomatch"}, context(work, within_s=-0.1))
    with pytest.raises(ToolError, match="did not finish within its time limit"):
        search.glob({"pattern": "**/*.nomatch"}, context(work, cancelled=lambda: True))


def test_grep_search_prints_path_line_text_and_skips_binaries_and_git(registry: ToolRegistry, work: Path) -> None:
    source_tree(work)
    assert output(run(registry, work, "grep_search", pattern=r"def \w+\(")).splitlines() == [
        "src/app.py:2:def main():",
        "src/util.py:1:def helper():",
    ]


def test_grep_search_include_filters_file_names(registry: ToolRegistry, work: Path) -> None:
    source_tree(work)
    assert output(run(registry, work, "grep_search", pattern="main", include="*.tsx")) == (
        "src/web/view.tsx:1:export function main() {}"
    )
    assert output(run(registry, work, "grep_search", pattern="main", include="*.{ts,md}")).splitlines() == [
        "README.md:1:call main() to start",
        "src/web/page.ts:1:export const main = 1;",
    ]
    # with a '/', include is matched against the path below the searched directory
    assert output(run(registry, work, "grep_search", pattern="main", path="src", include="web/*")).splitlines() == [
        "src/web/page.ts:1:export const main = 1;",
        "src/web/view.tsx:1:export function main() {}",
    ]


def test_grep_search_searches_one_file_or_says_nothing_matched(registry: ToolRegistry, work: Path) -> None:
    source_tree(work)
    assert output(run(registry, work, "grep_search", pattern="(?i)RETURN", path="src/util.py")) == (
        "src/util.py:2:    return 1"
    )
    assert output(run(registry, work, "grep_search", pattern="zebra", include="*.py")) == (
        "no matches for 'zebra' under '.' in files matching '*.py'"
    )
    assert "does not exist" in error(run(registry, work, "grep_search", pattern="x", path="nope"))


def test_grep_search_explains_an_invalid_regular_expression(registry: ToolRegistry, work: Path) -> None:
    assert "not a valid Python regular expression" in error(run(registry, work, "grep_search", pattern="(unclosed"))


def test_grep_search_is_bounded(registry: ToolRegistry, work: Path) -> None:
    (work / "many.txt").write_text("hit " + "z" * 1000 + "\n" * 1 + "hit\n" * 600, encoding="utf-8")
    lines = output(run(registry, work, "grep_search", pattern="hit")).splitlines()
    assert len(lines) == search.GREP_MAX_MATCHES + 1
    assert lines[0].endswith("[... line truncated: 504 chars omitted ...]")
    assert lines[-1] == "[... stopped after 500 matches; narrow the pattern, path or include ...]"


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


# ── run_shell_command ──────────────────────────────────────────────────────────────────────────


def test_a_command_runs_in_the_working_directory_with_its_exit_code(registry: ToolRegistry, work: Path) -> None:
    (work / "here.txt").touch()
    assert output(run(registry, work, "run_shell_command", command="pwd; ls")) == (
        f"{work.resolve()}\nhere.txt\n[exit code: 0]"
    )


def test_a_non_zero_exit_is_reported_with_stderr_not_raised(registry: ToolRegistry, work: Path) -> None:
    result = run(registry, work, "run_shell_command", command="echo out; echo err >&2; exit 3")
    assert result == {"output": "out\nerr\n[exit code: 3]"}
    assert output(run(registry, work, "run_shell_command", command="kill -9 $$")) == (
        "(no output)\n[killed by signal SIGKILL]"
    )


def test_long_output_keeps_head_and_tail_around_a_truncation_marker(registry: ToolRegistry, work: Path) -> None:
    command = "echo START; head -c 200000 /dev/zero | tr '\\0' a; echo; echo END"
    text = output(run(registry, work, "run_shell_command", command=command))
    cap = shell.SHELL_OUTPUT_CAP
    total = len("START\n") + 200_000 + len("\nEND\n")
    assert text.startswith("START\naaa")
    assert f"\n[... output truncated: {total - cap} bytes omitted ...]\n" in text
    assert text.endswith("a\nEND\n[exit code: 0]")


def test_a_timeout_kills_the_whole_process_group(registry: ToolRegistry, work: Path) -> None:
    command = "sleep 30 & echo pid=$!; sleep 30 & echo pid=$!; echo pid=$$; wait"
    started = time.monotonic()
    message = error(run(registry, work, "run_shell_command", command=command, timeout_s=1))
    assert time.monotonic() - started < 10
    assert "timed out after 1 s" in message and "every process it started was killed" in message
    pids = pids_in(message)
    assert len(pids) == 3
    assert all_gone(pids)


def test_background_processes_do_not_outlive_the_command(registry: ToolRegistry, work: Path) -> None:
    started = time.monotonic()
    text = output(run(registry, work, "run_shell_command", command="sleep 30 & echo pid=$!"))
    assert time.monotonic() - started < 10
    assert text.endswith("[exit code: 0]")
    assert all_gone(pids_in(text))


def test_cancelling_the_fork_stops_a_running_command(work: Path) -> None:
    # Given: a fork cancelled 0.3 s into a command that would run for 30 s
    cancel = threading.Event()
    timer = threading.Timer(0.3, cancel.set)
    ctx = context(work, cancelled=cancel.is_set)
    call = FunctionCall(
        id="c1", name="run_shell_command", args={"command": "echo pid=$$; sleep 30 & echo pid=$!; wait"}
    )
    started = time.monotonic()
    timer.start()
    try:
        # When: the command runs
        result = make_builtin_registry().run(call, ctx)
    finally:
        timer.cancel()
    # Then: it ends soon after the cancel, as an error saying why, with its processes gone
    assert time.monotonic() - started < 10
    message = error(result)
    assert message.startswith("the fork was cancelled; the command was stopped")
    pids = pids_in(message)
    assert len(pids) == 2 and all_gone(pids)


def test_a_command_of_an_already_cancelled_fork_never_starts(work: Path) -> None:
    call = FunctionCall(id="c1", name="run_shell_command", args={"command": "touch ran.txt"})
    result = make_builtin_registry().run(call, context(work, cancelled=lambda: True))
    assert error(result) == "the fork was cancelled; the command was not run"
    assert not (work / "ran.txt").exists()


def test_the_worker_credentials_are_not_in_the_command_environment(
    registry: ToolRegistry, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given credentials in the worker's environment, under forkq's names and a deployer's own
    monkeypatch.setenv("FORKQ_REDIS_URL", "redis://:hunter2@redis:6379/0")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("REDIS_PASSWORD", "hunter2")
    monkeypatch.setenv("LC_TOOLS_TEST", "kept")
    command = 'echo "${FORKQ_REDIS_URL:-none} ${OPENAI_API_KEY:-none} ${REDIS_PASSWORD:-none} $LC_TOOLS_TEST $PATH"'
    # When a command prints them, Then only the allowlisted ones (PATH, locale, ...) are there
    text = output(run(registry, work, "run_shell_command", command=command))
    assert text == f"none none none kept {os.environ['PATH']}\n[exit code: 0]"


def test_shell_timeouts_are_bounded_by_the_schema(registry: ToolRegistry, work: Path) -> None:
    message = error(run(registry, work, "run_shell_command", command="true", timeout_s=3600))
    assert "argument 'timeout_s': 3600 is greater than the maximum of 600" in message


def test_a_missing_working_directory_is_reported(registry: ToolRegistry, tmp_path: Path) -> None:
    message = error(run(registry, tmp_path / "gone", "run_shell_command", command="true"))
    assert "working directory" in message and "does not exist" in message
    assert os.path.exists(tmp_path)


# ── a deadline for every call, and cancellation (issue 11, item 6) ─────────────────────────────


def blocking_tool(release: threading.Event) -> Tool:
    """A handler blocked where it never looks at its deadline, as a plugin's stuck call may be."""

    def handler(args: Mapping[str, Any], ctx: ToolContext) -> str:
        release.wait()
        return "released"

    return Tool("stuck", "Blocks until released.", {"type": "object"}, handler)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set after the test, so the abandoned handler threads end with it."""
    event = threading.Event()
    yield event
    event.set()


STUCK = FunctionCall(id="c1", name="stuck", args={})
MARGIN_S = 1.5  # scheduling slack on a busy machine


def test_a_handler_that_never_returns_is_answered_with_an_error_at_its_time_limit(
    work: Path, release: threading.Event
) -> None:
    registry = ToolRegistry(default_timeout_s=0.5)
    registry.register(blocking_tool(release))
    started = time.monotonic()
    message = error(registry.run(STUCK, context(work)))
    elapsed = time.monotonic() - started
    assert "tool 'stuck' did not finish within its time limit of 0.5 s" in message and "abandoned" in message
    assert 0.5 <= elapsed < 0.5 + TOOL_STOP_GRACE_S + MARGIN_S


def test_the_forks_wall_clock_limit_cuts_a_call_its_tool_would_allow_longer(
    work: Path, release: threading.Event
) -> None:
    registry = ToolRegistry(default_timeout_s=600)
    registry.register(blocking_tool(release))
    started = time.monotonic()
    message = error(registry.run(STUCK, context(work, within_s=0.5)))
    assert "did not finish within its time limit of 0.5 s" in message
    assert time.monotonic() - started < 0.5 + TOOL_STOP_GRACE_S + MARGIN_S
    assert "no time left" in error(registry.run(STUCK, context(work, within_s=-1)))


def test_a_cancelled_fork_stops_waiting_for_a_stuck_handler(work: Path, release: threading.Event) -> None:
    registry = ToolRegistry(default_timeout_s=600)
    registry.register(blocking_tool(release))
    cancel = threading.Event()
    timer = threading.Timer(0.3, cancel.set)
    started = time.monotonic()
    timer.start()
    try:
        message = error(registry.run(STUCK, context(work, cancelled=cancel.is_set)))
    finally:
        timer.cancel()
    assert message == "the fork was cancelled or stopped while tool 'stuck' ran; the call was abandoned"
    assert time.monotonic() - started < 0.3 + TOOL_WAIT_POLL_S + TOOL_STOP_GRACE_S + MARGIN_S


def test_a_handler_that_watches_its_context_stops_at_the_deadline_with_its_own_answer(work: Path) -> None:
    def patient(args: Mapping[str, Any], ctx: ToolContext) -> str:
        while not ctx.cancelled():  # turns true once the caller stops waiting
            time.sleep(0.01)
        raise ToolError(f"stopped {'past' if ctx.seconds_left() <= 0 else 'before'} the deadline")

    registry = ToolRegistry(default_timeout_s=0.3)
    registry.register(Tool("patient", "Waits.", {"type": "object"}, patient))
    assert run(registry, work, "patient") == {"error": "stopped past the deadline"}


def test_a_tool_with_four_abandoned_calls_still_running_is_refused_until_they_end(work: Path) -> None:
    release = threading.Event()
    registry = ToolRegistry(default_timeout_s=0.2)
    registry.register(dataclasses.replace(blocking_tool(release), name="stuck_plugin"))
    metrics = Metrics(CollectorRegistry())
    call = FunctionCall(id="c1", name="stuck_plugin", args={})

    def abandoned() -> float | None:
        return metrics.registry.get_sample_value("forkq_tool_calls_abandoned", {"tool": "stuck_plugin"})

    try:
        for _ in range(TOOL_MAX_ABANDONED):
            assert "did not finish within its time limit" in error(registry.run(call, context(work)))
        assert abandoned() == TOOL_MAX_ABANDONED
        started = time.monotonic()
        message = error(registry.run(call, context(work)))
        assert message.startswith("tool 'stuck_plugin' was not run: 4 earlier calls of it did not finish"), message
        assert "Continue without it" in message and time.monotonic() - started < 0.1
    finally:
        release.set()
    wait_until(lambda: abandoned() is None, timeout=5.0, what="the abandoned threads to end")
    release.clear()
    threading.Timer(0.05, release.set).start()
    assert output(registry.run(call, context(work))) == "released"


# ── special files: a FIFO or socket never hangs a call (issue 11, item 6) ───────────────────────


def unblock(path: Path) -> None:
    """Give a reader or writer blocked opening the FIFO its other end, then close it."""
    for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
        with contextlib.suppress(OSError):
            os.close(os.open(path, flags))


@pytest.fixture
def fifo(work: Path) -> Iterator[Path]:
    """A FIFO named `pipe` in the working directory, with no writer."""
    path = work / "pipe"
    os.mkfifo(path)
    yield path
    unblock(path)


def run_bounded(registry: ToolRegistry, work: Path, fifo: Path, name: str, **args: Any) -> dict[str, Any]:
    """`run`, failing the test (rather than hanging it) if the call is still blocked after 10 s."""
    box: dict[str, dict[str, Any]] = {}
    thread = threading.Thread(target=lambda: box.update(result=run(registry, work, name, **args)), daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        unblock(fifo)
        thread.join(5)
        pytest.fail(f"{name} was still blocked on the FIFO after 10 s")
    return box["result"]


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


def test_grep_search_skips_fifos_and_sockets_and_searches_the_rest(
    registry: ToolRegistry, work: Path, fifo: Path
) -> None:
    (work / "a.txt").write_text("needle\n", encoding="utf-8")
    (work / "sub").mkdir()
    (work / "sub" / "b.txt").write_text("a needle too\n", encoding="utf-8")
    os.mkfifo(work / "sub" / "pipe2")
    with contextlib.closing(socket.socket(socket.AF_UNIX)) as sock:
        sock.bind(str(work / "sock"))
        started = time.monotonic()
        found = output(run_bounded(registry, work, fifo, "grep_search", pattern="needle"))
        assert found.splitlines() == ["a.txt:1:needle", "sub/b.txt:1:a needle too"]
        assert time.monotonic() - started < 2
        assert "'sock' is a socket" in error(run(registry, work, "read_file", path="sock"))


def test_grep_search_does_not_open_a_special_file_it_skips(registry: ToolRegistry, work: Path) -> None:
    # opening a FIFO for reading lets a writer blocked in open(2) through: an effect of merely looking
    (work / "a.txt").write_text("needle\n", encoding="utf-8")
    pipe = work / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: os.close(os.open(pipe, os.O_WRONLY)), daemon=True)
    writer.start()
    try:
        assert output(run(registry, work, "grep_search", pattern="needle")) == "a.txt:1:needle"
        assert "is not a regular file or a directory" in error(
            run(registry, work, "grep_search", pattern="x", path="pipe")
        )
        writer.join(0.5)
        assert writer.is_alive()  # still waiting for a reader: grep never opened the FIFO
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(5)


# ── catastrophic patterns (issue 11, item 5) ───────────────────────────────────────────────────

POISON_LINE = "a" * 28 + "!\n"  # `re` takes minutes on (a|a)+$ over it, holding the GIL all along
POISON = "(a|a)+$"  # backtracks exponentially in the `regex` module too


def longest_gap_while(action: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """`action()`'s result, and the longest a thread waking every 10 ms (a heartbeat) waited meanwhile."""
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.wait(0.01):
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        result = action()
    finally:
        stop.set()
        ticker.join()
    return result, max(gaps, default=0.0)


def test_a_catastrophic_pattern_is_stopped_at_its_time_limit_without_stalling_other_threads(
    registry: ToolRegistry, work: Path
) -> None:
    (work / "poison.txt").write_text(POISON_LINE, encoding="utf-8")
    call = FunctionCall(id="c1", name="grep_search", args={"pattern": POISON})
    started = time.monotonic()
    result, gap = longest_gap_while(lambda: registry.run(call, context(work, within_s=1.0)))
    message = error(result)
    # the budget is what was left of the call's 1 s when the search began (a little less on a busy machine)
    assert re.match(r"grep_search stopped after (1|0\.\d) s, its time limit, in 'poison\.txt'", message), message
    assert "Simplify the pattern" in message and "'(a|a)+$'" in message
    assert time.monotonic() - started < 1 + MARGIN_S
    assert gap < 0.5  # the GIL stayed free: the worker's heartbeat thread would have run on time


def test_the_pattern_of_the_field_report_now_finishes_at_once(registry: ToolRegistry, work: Path) -> None:
    (work / "poison.txt").write_text(POISON_LINE, encoding="utf-8")
    started = time.monotonic()
    result, gap = longest_gap_while(lambda: run(registry, work, "grep_search", pattern="(a+)+$"))
    assert output(result) == "no matches for '(a+)+$' under '.'"
    assert time.monotonic() - started < 2 and gap < 0.5


def test_grep_search_refuses_an_overlong_pattern(registry: ToolRegistry, work: Path) -> None:
    assert "is too long (at most 2000)" in error(run(registry, work, "grep_search", pattern="a" * 2001))


COMPILE_BOMBS = ["((a{200}){200}){200}", "(((a{100}){100}){100}){100}", "(a*){20000}", "a{1000000}"]


@pytest.mark.parametrize("bomb", COMPILE_BOMBS)
def test_a_pattern_too_large_to_compile_is_refused_at_once_without_stalling_other_threads(
    registry: ToolRegistry, work: Path, bomb: str
) -> None:
    # unbounded, compiling the first held the GIL 6.5 s and the second grew to 24 GB
    (work / "a.txt").write_text("aaaa\n", encoding="utf-8")
    started = time.monotonic()
    result, gap = longest_gap_while(lambda: run(registry, work, "grep_search", pattern=bomb))
    message = error(result)
    assert "too large once its counted repeats are expanded" in message and "at most 10,000" in message, message
    assert time.monotonic() - started < 0.5 and gap < 0.5


def test_grep_search_still_finds_patterns_with_counted_repeats_of_ordinary_size(
    registry: ToolRegistry, work: Path
) -> None:
    (work / "ip.txt").write_text("at 10.0.0.1 now\nnone here\n", encoding="utf-8")
    found = output(run(registry, work, "grep_search", pattern=r"\d{1,3}(\.\d{1,3}){3}"))
    assert found == "ip.txt:1:at 10.0.0.1 now"


LINE_SENSITIVE = [
    r"\Aimport",
    r"import b\Z",
    r"b\n\Z",
    r"(?<![a-z ])import",
    r"(?<=^)import",
    r"^(?!import)\w+",
    r"(?s)import.",
    r"(?m)^import",
    r"x$",
    r"\s*+import",
    r"(?>\s*)import",
    r"(?<=\n)x",
    r"\Z",
]


@pytest.mark.parametrize("pattern", LINE_SENSITIVE)
def test_grep_search_matches_each_line_as_if_searched_by_itself(
    registry: ToolRegistry, work: Path, pattern: str
) -> None:
    text = "import a\nimport b\n  import c\nimport d\nxx\nx\nimport b"
    (work / "m.py").write_text(text, encoding="utf-8")
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    expected = [f"m.py:{n}:{line.rstrip()}" for n, line in enumerate(lines, 1) if re.search(pattern, line)]
    found = run(registry, work, "grep_search", pattern=pattern)
    assert (output(found).splitlines() if expected else [output(found)]) == (
        expected or [f"no matches for {pattern!r} under '.'"]
    )


# ── nothing a command starts outlives it (issue 11, item 9) ────────────────────────────────────

LEFTOVERS = (
    "setsid sleep 600 & echo $! >> pids; "
    "nohup sleep 600 > /dev/null 2>&1 & echo $! >> pids; "
    "(sleep 600 & echo $! >> pids); "  # the subshell exits at once: its child is an orphan
    "(setsid sh -c 'sleep 600 & echo $! >> pids' &); "  # a daemon's double fork into a new session
    "env -i /bin/sh -c 'setsid sleep 600 & echo $! >> pids'; "  # ... and with an empty environment
    "while [ $(wc -l < pids) -lt 5 ]; do sleep 0.05; done; echo started"
)


def zombie_children() -> list[int]:
    """Children of this process that exited and were never reaped."""
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError):
            if entry.isdigit():
                fields = Path(f"/proc/{entry}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
                if fields[0] == "Z" and int(fields[1]) == os.getpid():
                    found.append(int(entry))
    return found


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def killed_afterwards(pids_file: Path) -> Iterator[None]:
    """Kill whatever the pids file names once the test is over (a failing run must not leave sleepers)."""
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            for pid in pids_file.read_text(encoding="utf-8").split():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)


def test_no_process_a_command_starts_outlives_it_setsid_nohup_or_double_forked(
    registry: ToolRegistry, work: Path
) -> None:
    with killed_afterwards(work / "pids"):
        text = output(run(registry, work, "run_shell_command", command=LEFTOVERS, timeout_s=60))
        pids = [int(pid) for pid in (work / "pids").read_text(encoding="utf-8").split()]
        assert text == "started\n[exit code: 0]"
        assert len(pids) == 5
        assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []  # gone, and reaped
        assert zombie_children() == []


def test_a_timed_out_command_takes_its_setsid_processes_with_it(registry: ToolRegistry, work: Path) -> None:
    with killed_afterwards(work / "pids"):
        command = "setsid sleep 600 & echo $! >> pids; (setsid sleep 600 &); sleep 600"
        assert "timed out after 1 s" in error(run(registry, work, "run_shell_command", command=command, timeout_s=1))
        [pid] = [int(pid) for pid in (work / "pids").read_text(encoding="utf-8").split()]
        assert not Path(f"/proc/{pid}").exists()
        assert zombie_children() == []


def test_a_command_that_kills_its_parent_still_takes_its_setsid_processes_with_it(
    registry: ToolRegistry, work: Path
) -> None:
    with killed_afterwards(work / "pids"):
        command = "setsid sleep 77 & echo $! >> pids; sleep 77 & echo $! >> pids; kill -9 $PPID; sleep 77"
        text = output(run(registry, work, "run_shell_command", command=command, timeout_s=60))
        assert text.endswith("[killed by signal SIGKILL]"), text
        pids = [int(pid) for pid in (work / "pids").read_text(encoding="utf-8").split()]
        assert len(pids) == 2 and [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
        assert zombie_children() == []


def test_a_command_that_kills_its_supervisor_takes_the_processes_of_its_session_with_it(
    registry: ToolRegistry, work: Path
) -> None:
    with killed_afterwards(work / "pids"):
        supervisor = "$(cut -d' ' -f4 /proc/$PPID/stat)"  # the shell's parent's parent
        command = f"sleep 77 & echo $! >> pids; (sleep 77 &); kill -9 {supervisor}; sleep 77"
        text = output(run(registry, work, "run_shell_command", command=command, timeout_s=60))
        assert text.endswith("[killed by signal SIGKILL]"), text
        [pid] = [int(pid) for pid in (work / "pids").read_text(encoding="utf-8").split()]
        # killed: its parent, killed too, may take a moment to go, and then init reaps it, not us
        wait_until(lambda: not running(pid), timeout=5.0)
        assert zombie_children() == []


def test_a_command_is_not_started_when_the_fork_has_under_a_second_left_for_it(work: Path) -> None:
    left = shell.SHELL_STOP_S + shell.SHELL_DRAIN_S + 0.5  # half a second for the command itself
    with pytest.raises(ToolError, match=r"the command was not run: \d+\.\d s are left of the fork's wall-clock limit"):
        shell.run_shell_command({"command": "touch ran"}, context(work, within_s=left))
    assert not (work / "ran").exists()


def test_the_supervisor_gets_longer_than_its_sweep_before_it_is_killed() -> None:
    # killed mid-sweep, the supervisor orphaned whatever it had not killed yet
    assert shell.SHELL_STOP_S >= shell_supervisor.SWEEP_MAX_S + 1.0


# ── symlink races: resolve and open in one step (issue 11, item 8) ─────────────────────────────

# swaps work/dir (a real directory) and work/swap (a symlink to outside/) atomically, as fast as it can,
# in a process of its own (truly in parallel with the tools), until SIGTERM; it ends with dir real again
SWAPPER = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
swaps = 0
open("swapping", "w").close()
while not stop or swaps % 2:
    if libc.renameat2(-100, b"dir", -100, b"swap", 2) != 0:
        sys.exit(os.strerror(ctypes.get_errno()))
    swaps += 1
print(swaps)
"""


@contextlib.contextmanager
def swapping(work: Path) -> Iterator[list[int]]:
    """work/dir swapped with a symlink to outside/ meanwhile; yields a list that gets the number of swaps."""
    (work / "swap").symlink_to(work.parent / "outside", target_is_directory=True)
    proc = subprocess.Popen([sys.executable, "-c", SWAPPER, str(work)], stdout=subprocess.PIPE)
    counted: list[int] = []
    try:
        wait_until((work / "swapping").exists, what="the swapper to start")
        yield counted
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        counted.append(int(out or 0))
    assert proc.returncode == 0 and (work / "dir").is_dir() and not (work / "dir").is_symlink()


RACE_ATTEMPTS = 3000


RACING_CALLS: list[Callable[[int], tuple[str, dict[str, Any]]]] = [
    lambda i: ("write_file", {"path": f"dir/w{i}.txt", "content": "escaped?"}),
    lambda i: ("write_file", {"path": f"dir/made{i}/w.txt", "content": "escaped?"}),
    lambda i: ("read_file", {"path": "dir/secret.txt"}),
    lambda i: ("edit", {"path": "dir/secret.txt", "old_string": "secret: the key is 42", "new_string": "stolen"}),
    lambda i: ("list_directory", {"path": "dir"}),
    lambda i: ("glob", {"pattern": "only-*", "path": "dir"}),
    lambda i: ("glob", {"pattern": "dir/only-*"}),
    lambda i: ("grep_search", {"pattern": "key is", "path": "dir/secret.txt"}),
    lambda i: ("grep_search", {"pattern": "key is", "path": "dir", "include": "secret.txt"}),
]


def racing_calls(index: int) -> tuple[str, dict[str, Any]]:
    """Attempt `index`: a write (one making a parent directory too), read, edit, listing, glob or grep in dir."""
    return RACING_CALLS[index % len(RACING_CALLS)](index)


def escaped(response: dict[str, Any]) -> bool:
    """Whether a call read, listed or changed something of outside/ (it holds secret.txt and only-outside.txt)."""
    text = str(response.get("output") or response.get("error"))
    return "the key is 42" in text or "only-outside" in text or text.startswith("edited")


@pytest.mark.parametrize("implementation", ["openat2", "walk"])
def test_no_write_or_read_escapes_while_a_directory_is_swapped_for_a_symlink_out(
    work: Path, monkeypatch: pytest.MonkeyPatch, implementation: str
) -> None:
    # Given a directory inside, with a file named like the secret outside, swapped with a symlink out
    if implementation == "walk":
        monkeypatch.setattr("workers.tools.beneath.use_openat2", False)
    outside = work.parent / "outside"
    (outside / "only-outside.txt").touch()
    (work / "dir").mkdir()
    (work / "dir" / "secret.txt").write_text("inside\n", encoding="utf-8")
    before = sorted(os.listdir(outside))
    registry = make_builtin_registry()
    attempts = iter(range(RACE_ATTEMPTS))
    outcomes: list[str] = []
    lock = threading.Lock()

    def attempt() -> None:
        while True:
            with lock:
                index = next(attempts, None)
            if index is None:
                return
            name, args = racing_calls(index)
            response = run(registry, work, name, **args)
            with lock:
                outcomes.append("leak" if escaped(response) else "ok" if "output" in response else "refused")

    # When 4 threads make 3000 calls meanwhile
    with swapping(work) as swaps:
        threads = [threading.Thread(target=attempt) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # Then nothing appeared outside, nothing there was read, listed or edited, while calls did land inside
    assert sorted(os.listdir(outside)) == before
    assert (outside / "secret.txt").read_text(encoding="utf-8") == "secret: the key is 42\n"
    assert outcomes.count("leak") == 0
    assert len(outcomes) == RACE_ATTEMPTS and outcomes.count("ok") > 0
    assert swaps[0] > 100  # the race was on


# ── through real workers: the fork's view of all this ──────────────────────────────────────────


def fifo_read(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """A plugin reading a file the naive way: open() of a FIFO without a writer blocks in the kernel."""
    with open(ctx.cwd / str(args["path"]), encoding="utf-8") as stream:
        return stream.read()


FIFO_READ = Tool(
    "fifo_read",
    "Reads a file.",
    {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    fifo_read,
)


@pytest.fixture
def live(make_settings: Callable[..., Settings], tmp_path: Path) -> Iterator[Callable[..., ForkClient]]:
    """An in-process worker (threads pool) on a script, with extra tools; returns a client of its app."""
    with contextlib.ExitStack() as stack:

        def start(
            steps: list[dict[str, Any]], tools: tuple[Tool, ...] = (), concurrency: int = 4, **overrides: Any
        ) -> ForkClient:
            settings = make_settings(script=write_script(tmp_path, steps), **overrides)
            app = make_app(settings)
            stack.callback(app.close)
            registry = load_tools(default_timeout_s=settings.tool_timeout_s)
            for tool in tools:
                registry.register(tool)
            runtime_of(app).tools = registry  # a cached property: the instance attribute replaces it
            client = stack.enter_context(ForkClient(settings, app=app))
            stack.enter_context(
                start_worker(
                    app,
                    pool="threads",
                    concurrency=concurrency,
                    perform_ping_check=False,
                    loglevel="WARNING",
                    shutdown_timeout=30,
                )
            )
            return client

        yield start


@pytest.fixture
def finished() -> Iterator[dict[str, Any]]:
    """Return values of the deliveries in-process workers finish during the test, by task id."""
    seen: dict[str, Any] = {}
    lock = threading.Lock()

    def record(task_id: str, retval: Any = None, **_: Any) -> None:
        with lock:
            seen[task_id] = retval

    task_postrun.connect(record, weak=False)
    yield seen
    task_postrun.disconnect(record)


def with_tools(parent: dict[str, Any], work: Path, *tools: Tool, mode: str = "yolo") -> dict[str, Any]:
    """The parent snapshot for `work`, declaring `tools` besides its own."""
    declared = [*parent["tools"], *(tool.declaration for tool in tools)]
    return parent_for(parent, work, mode, tools=declared)


def journal_of(settings: Settings, fork_id: str) -> list[Any]:
    return WorkerRuntime(settings).leases.journal(fork_id)


def test_a_call_stuck_on_a_fifo_is_answered_at_its_time_limit_and_the_fork_goes_on(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a worker whose tool calls have 1 s, and a fork that reads a FIFO with a plugin, read_file and grep
    work = workdir(tmp_path)
    os.mkfifo(work / "pipe")
    steps = [
        step(
            call("p1", "fifo_read", path="pipe"),
            call("r1", "read_file", path="pipe"),
            call("g1", "grep_search", pattern="limiter"),
        ),
        step("done"),
    ]
    client = live(steps, tools=(FIFO_READ,), tool_timeout_s=1.0)

    # When the fork runs
    handle = client.launch(with_tools(parent, work, FIFO_READ), FORK)
    try:
        result = handle.wait(timeout=30)
    finally:
        unblock(work / "pipe")

    # Then the stuck call got an error at its limit, read_file refused the FIFO, grep skipped it: the fork went on
    assert result.status is Status.SUCCEEDED and result.output == "done", result.error
    responses = tool_results(journal_of(client.settings, handle.fork_id))
    assert "tool 'fifo_read' did not finish within its time limit of 1 s" in responses["p1"]["error"]
    assert responses["r1"]["error"].startswith("'pipe' is a FIFO, not a regular file")
    assert responses["g1"] == {"output": "notes.txt:1:the limiter uses INCR then EXPIRE"}


def test_the_wall_clock_limit_ends_a_fork_stuck_in_a_tool_call(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    work = workdir(tmp_path)
    os.mkfifo(work / "pipe")
    client = live([step(call("p1", "fifo_read", path="pipe")), step("never")], tools=(FIFO_READ,))
    started = time.monotonic()
    handle = client.launch(with_tools(parent, work, FIFO_READ), FORK, max_wall_s=1.5)
    try:
        result = handle.wait(timeout=30)
    finally:
        unblock(work / "pipe")
    assert result.status is Status.FAILED and (result.error or "").startswith("wall_clock:")
    assert time.monotonic() - started < 1.5 + TOOL_STOP_GRACE_S + 5  # launch and worker pickup included


def test_cancelling_a_fork_stuck_on_a_fifo_frees_its_worker_slot_within_one_heartbeat(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path, finished: dict[str, Any]
) -> None:
    # Given a one-slot worker with a 1 s heartbeat, whose fork is stuck opening a FIFO
    work = workdir(tmp_path)
    os.mkfifo(work / "pipe")
    steps = [step(call("p1", "fifo_read", path="pipe")), step("done")]
    client = live(steps, tools=(FIFO_READ,), concurrency=1, heartbeat_s=1.0, lease_ttl_s=3.0)
    stuck = client.launch(with_tools(parent, work, FIFO_READ), FORK)
    try:
        wait_until(
            lambda: any(e.kind == "tool_started" for e in journal_of(client.settings, stuck.fork_id)),
            what="the call to start",
        )

        # When it is cancelled
        began = time.monotonic()
        assert stuck.cancel() is Status.CANCELLED
        wait_until(lambda: f"{stuck.fork_id}.1" in finished, timeout=15, what="the delivery to end")
        freed_after = time.monotonic() - began
    finally:
        unblock(work / "pipe")

    # Then the delivery ended within a heartbeat (the stuck handler is not waited for), and the slot runs the next fork
    assert finished[f"{stuck.fork_id}.1"] == "cancelled"
    assert freed_after < 1.0 + TOOL_WAIT_POLL_S + MARGIN_S
    other = tmp_path / "other"
    other.mkdir()
    (other / "pipe").write_text("a plain file\n", encoding="utf-8")
    after = client.launch(with_tools(parent, other, FIFO_READ), FORK).wait(timeout=20)
    assert after.status is Status.SUCCEEDED and after.output == "done"


def test_a_fork_writing_while_its_directory_is_swapped_for_a_symlink_writes_nothing_outside(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a fork whose one step writes 150 files below work/dir, while work/dir is swapped with a link out
    work = workdir(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (work / "dir").mkdir()
    writes = [call(f"w{i}", "write_file", path=f"dir/f{i}.txt", content="escaped?") for i in range(150)]
    client = live([step(*writes), step("done")])

    # When it runs meanwhile
    with swapping(work) as swaps:
        result = client.launch(parent_for(parent, work, "yolo"), FORK).wait(timeout=60)

    # Then it finished and not one file escaped, while writes landed inside and the swapper kept swapping
    assert result.status is Status.SUCCEEDED, result.error
    assert os.listdir(outside) == []
    assert len(os.listdir(work / "dir")) > 0 and swaps[0] > 100


@pytest.mark.slow
def test_a_catastrophic_pattern_in_one_fork_costs_the_forks_beside_it_nothing(
    client: ForkClient,
    parent: dict[str, Any],
    tmp_path: Path,
    worker_process: Callable[..., WorkerProcess],
    redis_client: redis.Redis,
) -> None:
    # Given a worker process with a 2 s lease TTL, and four forks greping (a|a)+$, one of them over a poisoned line
    steps = [
        step(call("g1", "grep_search", pattern=POISON)),
        *(step(call(f"l{i}", "list_directory"), delay_s=1.0) for i in range(5)),
        step("done"),
    ]
    env = {
        "FORKQ_SCRIPT": str(write_script(tmp_path, steps)),
        "FORKQ_HEARTBEAT_FILE": str(tmp_path / "hb"),
        "FORKQ_HEARTBEAT_S": "0.5",
        "FORKQ_LEASE_TTL_S": "2",
        "FORKQ_TOOL_TIMEOUT_S": "4",
    }
    worker = worker_process(concurrency=4, **env)
    for name in ("poisoned", "b0", "b1", "b2"):
        (tmp_path / name).mkdir()
    poisoned = workdir(tmp_path / "poisoned")
    (poisoned / "poison.txt").write_text(POISON_LINE, encoding="utf-8")
    poison = client.launch(parent_for(parent, poisoned, "yolo"), FORK)
    bystanders = [client.launch(parent_for(parent, workdir(tmp_path / f"b{i}"), "yolo"), FORK) for i in range(3)]

    # When they run side by side
    results = [handle.wait(timeout=45) for handle in bystanders]

    # Then every bystander succeeded on its first attempt, never losing its lease
    for handle, result in zip(bystanders, results, strict=True):
        assert result.status is Status.SUCCEEDED, (result.error, worker.log())
        assert [e.data["attempt"] for e in client.events(handle.fork_id) if e.type == "started"] == [1]
        assert redis_client.hget(Keys(TEST_NAMESPACE).state(handle.fork_id), "lost") is None
    assert "lease lost" not in worker.log()
    # and the poisoned call got an error naming the time limit, after which that fork went on too
    assert poison.wait(timeout=30).status is Status.SUCCEEDED
    message = tool_results(journal_of(client.settings, poison.fork_id))["g1"]["error"]
    # the budget is what was left of the call's 4 s when the search began (a little less on a busy machine)
    assert re.match(r"grep_search stopped after (4|3\.\d) s, its time limit", message), message


@pytest.mark.slow
def test_a_killed_worker_takes_the_processes_of_its_running_commands_with_it(
    client: ForkClient, parent: dict[str, Any], tmp_path: Path, worker_process: Callable[..., WorkerProcess]
) -> None:
    # Given a worker process running a fork's command that started a process in a session of its own
    command = "setsid sleep 600 & echo $! > pids; sleep 600"
    steps = [step(call("s1", "run_shell_command", command=command, timeout_s=600))]
    worker = worker_process(FORKQ_SCRIPT=str(write_script(tmp_path, steps)), FORKQ_HEARTBEAT_FILE=str(tmp_path / "hb"))
    work = workdir(tmp_path)
    client.launch(parent_for(parent, work, "yolo"), FORK)
    with killed_afterwards(work / "pids"):
        wait_until(
            lambda: (work / "pids").exists() and (work / "pids").stat().st_size > 0, timeout=30, what="the command"
        )
        sleeper = int((work / "pids").read_text(encoding="utf-8"))
        assert Path(f"/proc/{sleeper}").exists()

        # When the worker is killed outright
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait(timeout=10)

        # Then the command's processes die with it, setsid or not
        wait_until(
            lambda: not Path(f"/proc/{sleeper}").exists() or not alive(sleeper), timeout=10, what="the sleeper to end"
        )

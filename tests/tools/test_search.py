"""glob and grep_search (workers/tools/search.py): confined, bounded, and safe from catastrophic patterns.

The last test runs four forks side by side in a `forkq worker` process, one of them greping a
pattern that backtracks exponentially, and checks the others never lose their lease.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import TEST_NAMESPACE, WorkerProcess
from tests.loop_support import FORK, call, parent_for, step, tool_results, workdir, write_script
from tests.tools_support import MARGIN_S, context, error, journal_of, output, run, run_bounded
from workers.base.keys import Keys
from workers.client import ForkClient
from workers.history.messages import FunctionCall
from workers.records.fork import Status
from workers.tools import search
from workers.tools.registry import ToolError, ToolRegistry

# ── confinement to the working directory ───────────────────────────────────────────────────────


def test_glob_and_grep_skip_symlinks_that_point_out(registry: ToolRegistry, work: Path) -> None:
    (work / "link").symlink_to(work.parent / "outside", target_is_directory=True)
    (work / "leak.txt").symlink_to(work.parent / "outside" / "secret.txt")
    (work / "own.txt").write_text("secret of our own\n", encoding="utf-8")
    assert output(run(registry, work, "glob", pattern="*/*.txt")).startswith("no paths match")
    assert output(run(registry, work, "glob", pattern="*.txt")) == "own.txt"
    assert output(run(registry, work, "grep_search", pattern="secret")) == "own.txt:1:secret of our own"


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


# ── special files: a FIFO or socket never hangs a call (issue 11, item 6) ───────────────────────


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


# ── through real workers: the fork's view of all this ──────────────────────────────────────────


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
        assert [e.data.attempt for e in client.events(handle.fork_id) if e.type == "started"] == [1]
        assert redis_client.hget(Keys(TEST_NAMESPACE).state(handle.fork_id), "lost") is None
    assert "lease lost" not in worker.log()
    # and the poisoned call got an error naming the time limit, after which that fork went on too
    assert poison.wait(timeout=30).status is Status.SUCCEEDED
    message = tool_results(journal_of(client.settings, poison.fork_id))["g1"]["error"]
    # the budget is what was left of the call's 4 s when the search began (a little less on a busy machine);
    # on a loaded machine the search's own stop can come after the registry's deadline, which then answers
    stopped = re.match(r"grep_search stopped after (4|3\.\d) s, its time limit", message)
    abandoned = message.startswith("tool 'grep_search' did not finish within its time limit of 4 s")
    assert stopped or abandoned, message

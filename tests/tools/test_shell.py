"""run_shell_command (workers/tools/shell.py and its supervisor) with real bash processes.

The tests check through /proc that the processes a command started are really gone: on exit,
timeout or cancel, setsid or double-forked, and when the worker process itself is killed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WorkerProcess
from tests.live import wait_until
from tests.loop_support import FORK, call, parent_for, step, workdir, write_script
from tests.tools_support import context, error, output, run
from workers.client import ForkClient
from workers.history.messages import FunctionCall
from workers.tools import shell, shell_supervisor
from workers.tools.builtins import builtin_tools as make_builtin_registry
from workers.tools.registry import ToolError, ToolRegistry


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def all_gone(pids: list[int]) -> bool:
    return not any(alive(pid) for pid in pids)


def pids_in(text: str) -> list[int]:
    return [int(found) for found in re.findall(r"pid=(\d+)", text)]


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
    wait_until(lambda: all_gone(pids), 5, f"processes {pids} to end")


def test_background_processes_do_not_outlive_the_command(registry: ToolRegistry, work: Path) -> None:
    started = time.monotonic()
    text = output(run(registry, work, "run_shell_command", command="sleep 30 & echo pid=$!"))
    assert time.monotonic() - started < 10
    assert text.endswith("[exit code: 0]")
    wait_until(lambda: all_gone(pids_in(text)), 5, "the processes to end")


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
    assert len(pids) == 2
    wait_until(lambda: all_gone(pids), 5, f"processes {pids} to end")


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


# ── through real workers: the fork's view of all this ──────────────────────────────────────────


@pytest.mark.slow
def test_a_killed_worker_takes_the_processes_of_its_running_commands_with_it(
    client: ForkClient, parent: dict[str, Any], tmp_path: Path, worker_process: Callable[..., WorkerProcess]
) -> None:
    # Given a worker process running a fork's command that started a process in a session of its own
    command = "setsid sleep 600 & echo $! > pids; sleep 600"
    steps = [step(call("s1", "run_shell_command", command=command, timeout_s=600))]
    worker = worker_process(FORKQ_SCRIPT=str(write_script(tmp_path, steps)), FORKQ_HEARTBEAT_FILE=str(tmp_path / "hb"))
    work = workdir(tmp_path)
    client.launch(parent_for(parent, work, "yolo"), FORK, workspace="shared")
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

"""`run_shell_command`: a bash command in the fork's working directory, whose processes all end with the call.

Without a confinement (a `shared` workspace) the shell is not a sandbox: a command starts in the
working directory but may `cd` anywhere. With one (`ToolContext.confinement`, a `snapshot` fork) the
command's process is sandboxed before it execs the shell (`workers.workspace.sandbox`: Landlock,
seccomp, and the workspace at the parent's path where a mount namespace can be made), and its HOME
and TMPDIR are the run's temp folder. What this module always guarantees is that nothing a command
starts outlives the call, and that the worker's own credentials are not in its environment.

Each call runs under its own supervisor process (`workers.tools.shell_supervisor`), in a session of its
own. The supervisor is a child subreaper: whatever the command leaves behind (a `cmd &` still
running, `setsid`, `nohup`, a daemon's double fork, a process that cleared its environment) is
reparented to it, and it kills all of it when the shell ends, when the call times out or the fork
is cancelled (it is sent SIGTERM), and when the worker thread that started it ends, the worker's
death included (`PR_SET_PDEATHSIG`). The worker process itself is never a subreaper, so no orphan
of a call (or of anything else the worker runs) waits on it to be reaped.

The limits: an unconfined command (or a confined one on a kernel before Landlock ABI 6, whose
signals are not scoped) can find its supervisor in the process table (it runs as the same user) and
SIGKILL it; the worker then kills every process left in the call's session, but one that moved to
a session of its own before escapes. Processes handed to another service (`at`, `systemd-run`) are
not the call's descendants, and one in uninterruptible sleep past the sweep (`SWEEP_MAX_S`) is left.
"""

from __future__ import annotations

import contextlib
import enum
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.tools.registry import ToolContext, ToolError
from workers.tools.shell_supervisor import SWEEP_MAX_S
from workers.workspace.sandbox import Confinement

SHELL_DEFAULT_TIMEOUT_S = 120
SHELL_MAX_TIMEOUT_S = 600
SHELL_MIN_TIMEOUT_S = 1.0  # less left on the fork's clock than this (after the time to stop it): not run
SHELL_OUTPUT_CAP = 64 * 1024  # bytes of combined stdout/stderr kept: the first and the last half
SHELL_POLL_S = 0.05  # how often the command's exit is checked while its output is read
SHELL_CANCEL_POLL_S = 0.1  # how often ctx.cancelled is asked (it may be a Redis round trip)
# after SIGTERM: how long the supervisor gets to kill the command's processes; longer than its sweep
# may take, so it is never killed mid-sweep (that orphaned the rest)
SHELL_STOP_S = SWEEP_MAX_S + 1.0
SHELL_DRAIN_S = 1.0  # after the supervisor ended: how long to wait for the pipe's end of file
# the registry's time limit of a call: the longest command plus the time its stop may take
SHELL_CALL_LIMIT_S = SHELL_MAX_TIMEOUT_S + SHELL_STOP_S + SHELL_DRAIN_S + 5
READ_CHUNK = 64 * 1024
SUPERVISOR = Path(__file__).with_name("shell_supervisor.py")
# a command the model writes gets only these of the worker's variables: never its credentials (API
# keys, FORKQ_* URLs with passwords, REDIS_PASSWORD from a Secret, anything a deployer adds)
CHILD_ENV_NAMES = frozenset({"PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TERM", "USER", "LOGNAME", "SHELL", "TMPDIR"})
CHILD_ENV_PREFIXES = ("LC_",)


class CappedOutput:
    """The head and tail of a byte stream, at most `cap` bytes in all; the middle is counted, not kept."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.omitted = 0

    def add(self, chunk: bytes) -> None:
        """Keep `chunk` while the head has room, then as the newest part of the tail."""
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        excess = len(self.tail) - self.tail_cap
        if excess > 0:
            del self.tail[:excess]
            self.omitted += excess

    def text(self) -> str:
        """The kept output, with a marker where bytes were dropped."""
        head, tail = self.head.decode("utf-8", "replace"), self.tail.decode("utf-8", "replace")
        if not self.omitted:
            return (self.head + self.tail).decode("utf-8", "replace")
        return f"{head}\n[... output truncated: {self.omitted} bytes omitted ...]\n{tail}"


def _child_env(confinement: Confinement | None) -> dict[str, str]:
    # os.environ here is not configuration (that is Settings' alone): it is the process's own
    # environment, of which an allowlist is handed on to the command, as any shell would inherit it
    env = {
        name: value
        for name, value in os.environ.items()
        if name in CHILD_ENV_NAMES or name.startswith(CHILD_ENV_PREFIXES)
    }
    if confinement is not None:  # the worker's home is out of the sandbox's reach: the run's temp folder instead
        env["HOME"] = env["TMPDIR"] = str(confinement.tmp)
    return env


def _spawn(command: str, cwd: Path, confinement: Confinement | None) -> subprocess.Popen[bytes]:
    shell = shutil.which("bash") or "/bin/sh"
    # -I: no PYTHON* variables, no user site; -S: no site-packages (the supervisor needs the stdlib only)
    argv = [sys.executable, "-I", "-S", str(SUPERVISOR), str(os.getpid()), shell, command]
    if confinement is not None:
        argv.append(confinement.to_json())
    try:
        # a session of its own: no terminal signal of the worker reaches the command
        return subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=_child_env(confinement),
        )
    except OSError as exc:
        raise ToolError(f"cannot start the shell {shell!r}: {exc}") from exc


def _exited(pid: int) -> bool:
    """Whether the supervisor has exited, without reaping it: its pid (and so its group id) stays reserved."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killed(pid: int) -> bool:
    """Whether the exited (unreaped) supervisor was killed by SIGKILL, so its sweep never ran."""
    with contextlib.suppress(ChildProcessError):
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return info is not None and info.si_code == os.CLD_KILLED and info.si_status == signal.SIGKILL
    return False


def _read_until(fd: int, output: CappedOutput, seconds: float) -> bool:
    """Read what `fd` yields for up to `seconds`; True once it reaches end of file."""
    poller = select.poll()  # not select.select: a busy worker's fds can pass FD_SETSIZE
    poller.register(fd, select.POLLIN)
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if poller.poll(left * 1000):
            chunk = os.read(fd, READ_CHUNK)
            if not chunk:
                return True
            output.add(chunk)
    return False


class PumpEnd(enum.Enum):
    """What ended the collection of a command's output: it exited, the fork was cancelled, or the timeout passed."""

    EXIT = enum.auto()
    CANCELLED = enum.auto()
    TIMEOUT = enum.auto()


def _pump(proc: subprocess.Popen[bytes], fd: int, output: CappedOutput, timeout_s: float, ctx: ToolContext) -> PumpEnd:
    """Collect output until the command is over, the timeout passes or the fork is cancelled."""
    deadline = time.monotonic() + timeout_s
    next_cancel_check = 0.0
    eof = False
    while True:
        if eof:
            time.sleep(SHELL_POLL_S)
        else:
            eof = _read_until(fd, output, SHELL_POLL_S)
        if _exited(proc.pid):
            return PumpEnd.EXIT
        now = time.monotonic()
        if now >= next_cancel_check:
            if ctx.cancelled():
                return PumpEnd.CANCELLED
            next_cancel_check = now + SHELL_CANCEL_POLL_S
        if now >= deadline:
            return PumpEnd.TIMEOUT


def _wait_exit(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not _exited(pid):
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)
    return True


def _session_members(sid: int) -> list[int]:
    """The processes of the session `sid` (the supervisor's: each call's processes start in it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with (
                contextlib.suppress(OSError, IndexError, ValueError),
                open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat,
            ):
                if int(stat.read().rsplit(")", 1)[1].split()[3]) == sid:  # field 6, the session
                    found.append(int(entry))
    return found


def _kill_session(sid: int) -> None:
    """SIGKILL every process left in the session `sid`: the supervisor is gone without its sweep."""
    for pid in _session_members(sid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _stop(proc: subprocess.Popen[bytes], fd: int, output: CappedOutput) -> None:
    """Have the supervisor kill what is left of the command, take the last output, reap the supervisor."""
    if not _exited(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        _wait_exit(proc.pid, SHELL_STOP_S)
    if not _exited(proc.pid) or _killed(proc.pid):
        # a supervisor that does not answer, or was killed (by the command): what is left in its session
        # (the supervisor still unreaped, so its pid cannot name another session meanwhile)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        _kill_session(proc.pid)
    _read_until(fd, output, SHELL_DRAIN_S)
    proc.wait()


def _exit_status(returncode: int) -> str:
    if returncode < 0:
        return f"[killed by signal {signal.Signals(-returncode).name}]"
    return f"[exit code: {returncode}]"


def run_shell_command(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Run `command` with bash in the working directory; its output (capped) and exit code, never raised."""
    command = str(args["command"])
    timeout_s = float(args.get("timeout_s", SHELL_DEFAULT_TIMEOUT_S))
    root = ctx.cwd.resolve()
    if not root.is_dir():
        raise ToolError(f"the fork's working directory {str(root)!r} does not exist or is not a directory")
    if ctx.cancelled():
        raise ToolError("the fork was cancelled; the command was not run")
    # stop before the call's deadline (the fork's wall-clock limit), leaving time to stop and drain
    left = ctx.seconds_left()
    timeout_s = min(timeout_s, left - SHELL_STOP_S - SHELL_DRAIN_S)
    if timeout_s < SHELL_MIN_TIMEOUT_S:  # spawned with less, a command got ~50 ms: refuse, and run nothing
        raise ToolError(
            f"the command was not run: {max(left, 0.0):.1f} s are left of the fork's wall-clock limit "
            f"(max_wall_s), and a command needs {SHELL_MIN_TIMEOUT_S:g} s plus {SHELL_STOP_S + SHELL_DRAIN_S:g} s "
            "to be stopped; finish without it, or launch the fork with a larger max_wall_s"
        )
    proc = _spawn(command, root, ctx.confinement)
    stdout = proc.stdout
    if stdout is None:  # pragma: no cover - stdout=PIPE always gives a pipe
        raise ToolError("the shell's output pipe is missing")
    output = CappedOutput(SHELL_OUTPUT_CAP)
    try:
        ending = _pump(proc, stdout.fileno(), output, timeout_s, ctx)
    finally:
        _stop(proc, stdout.fileno(), output)
        stdout.close()
    text = output.text() or "(no output)"
    if ending is PumpEnd.CANCELLED:
        raise ToolError(
            f"the fork was cancelled; the command was stopped (every process it started was killed). "
            f"Output so far:\n{text}"
        )
    if ending is PumpEnd.TIMEOUT:
        raise ToolError(
            f"the command timed out after {timeout_s:g} s and was stopped (every process it started was killed); "
            f"give a larger timeout_s (at most {SHELL_MAX_TIMEOUT_S}) or a quicker command. Output so far:\n{text}"
        )
    separator = "" if text.endswith("\n") else "\n"
    return f"{text}{separator}{_exit_status(proc.returncode)}"

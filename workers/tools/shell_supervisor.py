"""The supervisor of one `run_shell_command` call: runs the command, then ends every process it left behind.

`workers.tools.shell` starts it as `python -I -S shell_supervisor.py PARENT_PID SHELL COMMAND` (standard
library only, nothing of forkq imported: it starts in 20 to 35 ms). It makes itself a child
subreaper (`PR_SET_CHILD_SUBREAPER`), so every process the command orphans (a `cmd &` left running,
`setsid`, `nohup`, a daemon's double fork, with or without its environment) is reparented to it
rather than to init, and it reaps them as they exit. When the shell ends, or the supervisor gets
SIGTERM (the call's timeout or cancellation, or the worker thread that started it ending:
`PR_SET_PDEATHSIG`), it kills its children with SIGKILL until it has none left: each killed
process's own children are reparented to it in turn. It exits with the shell's status (a shell
killed by a signal: the same signal).

The shell does not run as the supervisor's child but as its grandchild, under a small "shell
parent" process: the shell's `$PPID` is that parent, so `kill -9 $PPID` orphans the shell to the
supervisor, which then sweeps it like any other orphan.

A snapshot fork's command comes with its sandbox (`Confinement.to_json`, a fifth argument): the
shell's parent confines itself before it starts the shell (`workers.workspace.sandbox.confine_self`:
namespaces where they can be made, Landlock, seccomp), so the supervisor stays outside the sandbox and
keeps its power to kill everything the command starts, while the command, from Landlock ABI 6 on, can
no longer signal or trace the supervisor. A sandbox that cannot be applied is not run around: the
command is not run, and its output says why (exit code 126).

What escapes it: processes that are not descendants of the call (a job handed to another service,
such as `at`, `systemd-run` or a container runtime); processes stuck in uninterruptible sleep for
longer than the sweep waits (`SWEEP_MAX_S`); and a command that searches the process table for the
supervisor (it runs as the same user) and kills it with SIGKILL: the worker then kills what is
left in the call's session, but a process that moved to a session of its own before is not found.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from types import FrameType

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SWEEP_MAX_S = 2.0  # a process that does not die this long after SIGKILL is left (it is in uninterruptible sleep)


class Stop(Exception):
    """SIGTERM: the call is over (timeout, cancel, the worker's thread gone)."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stop


def _children() -> list[int]:
    """This process's children, zombies included: /proc/self/task/*/children, else a scan of /proc."""
    me = os.getpid()
    try:
        with open(f"/proc/self/task/{me}/children", encoding="ascii") as listing:
            return [int(pid) for pid in listing.read().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN
        pass
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with (
                contextlib.suppress(OSError, IndexError, ValueError),
                open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat,
            ):
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(entry))
    return found


def _reap() -> None:
    """Reap every child that has exited."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def sweep() -> None:
    """Kill every child until none is left: each round's orphans are reparented here for the next."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second stop must not cut the sweep short
    end = time.monotonic() + SWEEP_MAX_S
    while time.monotonic() < end:
        _reap()
        children = _children()
        if not children:
            return
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)  # bounded rounds, never a blocking wait: a process in D state must not hold us


def _wait_for(shell: int) -> int:
    """The shell's wait status; orphans that exit meanwhile are reaped on the way."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == shell:
            return status


def _confine(confinement: str, command: str) -> str:
    """Confine this process (the shell's parent) as the JSON `confinement` says; the command's text to run.

    The sandbox module is loaded from forkq's own folder (this script runs with neither site-packages
    nor forkq on its path), in this process and not the supervisor: the supervisor stays outside the
    sandbox, so it can still kill everything the command starts.
    """
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from workers.workspace.sandbox import Confinement, command_for, confine_self  # noqa: PLC0415 - only when asked

    spec = Confinement.from_json(confinement)
    return command_for(spec, command, confine_self(spec))


def _run_shell(shell: str, command: str, confinement: str | None) -> None:
    """The shell's parent: confine itself (when asked), run the shell, then end as it ended. Never returns."""
    try:
        if confinement is not None:
            try:
                command = _confine(confinement, command)
            except Exception as exc:
                os.write(2, f"the command was not run: {exc}\n".encode())
                os._exit(126)
        # Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec
        for signum in (signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        os.setpgid(0, 0)
        pid = os.fork()
        if pid == 0:
            os.execv(shell, [shell, "-c", command])
        status = os.waitpid(pid, 0)[1]
        if os.WIFSIGNALED(status):
            with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
                signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status))
    except BaseException as exc:
        os.write(2, f"cannot start the shell {shell!r}: {exc}\n".encode())
    finally:
        os._exit(127)


def _start(shell: str, command: str, confinement: str | None) -> int:
    """The pid of the shell's parent, a process between the supervisor and the shell.

    The shell's `$PPID` is that process, not the supervisor: a command that kills its parent
    (`kill -9 $PPID`) only orphans the shell and what it started, and they are reparented to the
    supervisor, which sees the parent die and sweeps them.
    """
    pid = os.fork()
    if pid == 0:  # a process group of its own, default signal handling
        _run_shell(shell, command, confinement)
    return pid


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}) failed: {os.strerror(errno)}; the command was not run")


def main(argv: list[str]) -> int:
    """Run `argv[3]` with the shell `argv[2]` for the worker process `argv[1]`; the shell's exit code.

    `argv[4]`, when given, is the sandbox of the command (`Confinement.to_json`).
    """
    parent, shell, command = int(argv[1]), argv[2], argv[3]
    confinement = argv[4] if len(argv) > 4 else None
    signal.signal(signal.SIGTERM, _stop)
    try:  # without them, what the command leaves behind would outlive it: refuse rather than run it
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError as exc:
        os.write(2, f"{exc.strerror}\n".encode())
        return 126
    if os.getppid() != parent:  # the worker was gone before the death signal was set up
        return 128 + signal.SIGTERM
    status = None
    try:
        pid = _start(shell, command, confinement)
        status = _wait_for(pid)
    except Stop:
        pass
    finally:
        sweep()
    if status is None:
        return 128 + signal.SIGTERM
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

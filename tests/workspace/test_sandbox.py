"""The sandbox of a snapshot fork's shell commands (workers/workspace/sandbox.py and mountns.py), with real processes.

Every confined command runs in each mode of `sandbox_support` (this process's user, root in CI here;
uid 65534 with no capability; the same with a read-only root; and with no user namespace either).
Each escape is also run with `enforce=False` where that makes it succeed, so each refusal is the
sandbox's and not the test's: the same command reads the secret when nothing confines it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import missing_tool
from tests.workspace.sandbox_support import ALIAS, SECRET, Layout, Mode, modes, unprivileged_reason
from tests.workspace.sandbox_support import SYSTEM_PYTHON as PY
from workers.errors import SandboxUnavailable
from workers.workspace import sandbox
from workers.workspace.sandbox import Confinement, command_for, probe, require, sandbox_problems

MODES = modes()
ABI = sandbox.landlock_abi()[0]


@pytest.fixture(autouse=True)
def _landlock() -> None:
    """These tests need a kernel with Landlock: skipped without one, failed when the CI variable is set."""
    if ABI < sandbox.MIN_LANDLOCK_ABI:
        missing_tool("Landlock", f"the kernel offers Landlock ABI {ABI}; the sandbox needs {sandbox.MIN_LANDLOCK_ABI}")


@pytest.fixture(params=MODES, ids=[m.name for m in MODES])
def mode(request: pytest.FixtureRequest) -> Mode:
    """A setting the command runs in."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def layout(mode: Mode) -> Iterator[Layout]:
    """The workspace, its temp folder and the secrets beside them, owned by the mode's user."""
    made = Layout.make(mode.uid)
    yield made
    shutil.rmtree(made.base, ignore_errors=True)


@pytest.fixture
def outsider(mode: Mode, layout: Layout) -> Iterator[tuple[int, int, int, int, str]]:
    """A process of the command's user outside the sandbox: pid, secret's fd, TCP port, UDP port, abstract name."""
    proc, (pid, fd, tcp, udp), name = mode.outsider(layout)
    yield pid, fd, tcp, udp, name
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_a_confined_command_works_in_its_workspace_and_temp_folder(mode: Mode, layout: Layout) -> None:
    command = "cat a.txt && echo made > new.txt && echo temp > $TMPDIR/t && echo HOME=$HOME"
    out = mode.run(layout, command, layout.confinement())
    assert "parent's file" in out
    assert f"HOME={layout.tmp}" in out
    assert out.endswith("[exit code: 0]")
    assert (layout.root / "new.txt").read_text() == "made\n"
    assert (layout.tmp / "t").read_text() == "temp\n"


def test_the_parent_path_leads_into_the_workspace(mode: Mode, layout: Layout) -> None:
    # Given a command that names files by the parent's absolute path, as the inherited history does
    out = mode.run(layout, f"pwd; cat {ALIAS}/a.txt; echo w > {ALIAS}/by-alias.txt", layout.confinement())
    # Then it reads and writes the workspace: by a mount namespace, else by replacing the path in its text
    assert "parent's file" in out
    assert (layout.root / "by-alias.txt").read_text() == "w\n"
    assert out.splitlines()[0] == (ALIAS if mode.namespaces else str(layout.root))


def escapes(layout: Layout, pid: int, fd: int) -> dict[str, str]:
    """Commands that print the secret if they get past the sandbox, by name."""
    sib = layout.sibling
    return {
        "absolute path": f"cat {sib}",
        "worker home": f"cat {layout.home}",
        "cache": f"cat {layout.cache}",
        "a file in /tmp": f"cat {layout.outside}",
        "cd ..": "cd ..; cat sibling/secret.txt",
        "symlink": f"ln -s {sib} link; cat link",
        "hardlink": f"ln {sib} hard; cat hard",
        "copy": f"cp {sib} copy; cat copy",
        "python open": f"{PY} -c 'print(open(\"{sib}\").read())'",
        "redirect": f"exec 3<{sib}; cat <&3",
        "dev fd": f"cat /dev/fd/3 3<{sib}",
        "proc self cwd": f"cat /proc/self/cwd/../sibling/secret.txt /proc/self/root{sib}",
        "proc root of the worker": f"cat /proc/{pid}/root{sib}",
        "proc fd of the worker": f"cat /proc/{pid}/fd/{fd}",
        "proc environ of the worker": f"tr '\\0' '\\n' < /proc/{pid}/environ",
        "mount": f"unshare -Urm sh -c 'mount --bind {sib.parent} $TMPDIR && cat $TMPDIR/secret.txt'",
    }


ESCAPE_NAMES = list(escapes(Layout(Path("/x"), 0), 1, 3))


@pytest.mark.parametrize("escape", ESCAPE_NAMES)
def test_a_confined_command_cannot_read_what_lies_outside(
    mode: Mode, layout: Layout, outsider: tuple[int, int, int, int, str], escape: str
) -> None:
    pid, fd = outsider[0], outsider[1]
    command = escapes(layout, pid, fd)[escape]
    out = mode.run(layout, command, layout.confinement())
    assert SECRET not in out, out


def without_namespaces(layout: Layout, *, enforce: bool) -> Confinement:
    """The workspace's confinement with the alias `/`, which no namespace can give: Landlock and seccomp alone."""
    return Confinement(layout.root, "/", layout.tmp, enforce=enforce)


# the controls need the command in the outsider's user namespace: the read-only modes add one around it
SAME_NAMESPACE = [m for m in MODES if m.name in ("tool", "nobody")]
in_same_namespace = pytest.mark.parametrize("mode", SAME_NAMESPACE, ids=[m.name for m in SAME_NAMESPACE])


CONTROLLED = ["absolute path", "worker home", "a file in /tmp", "python open", "proc root of the worker", "mount"]


@in_same_namespace
@pytest.mark.parametrize("escape", [*CONTROLLED, "proc fd of the worker"])
def test_the_same_escapes_read_the_secret_without_the_sandbox(
    mode: Mode, layout: Layout, outsider: tuple[int, int, int, int, str], escape: str
) -> None:
    # the control of the test above (FORKQ_SANDBOX=off, no namespace): the refusals there are the sandbox's
    command = escapes(layout, outsider[0], outsider[1])[escape]
    assert SECRET in mode.run(layout, command, without_namespaces(layout, enforce=False))
    # and Landlock alone refuses them, without the namespaces' help
    assert SECRET not in mode.run(layout, command, without_namespaces(layout, enforce=True))


def test_a_confined_command_cannot_write_outside(mode: Mode, layout: Layout) -> None:
    command = f"echo pwned >> {layout.outside}; echo pwned > {layout.sibling.parent}/new; touch /tmp/forkq-pwned-$$"
    out = mode.run(layout, command, layout.confinement())
    assert layout.outside.read_text() == f"{SECRET}\n", out
    assert not (layout.sibling.parent / "new").exists()
    assert "Permission denied" in out


def test_a_confined_command_cannot_trace_or_signal_its_users_processes(
    mode: Mode, layout: Layout, outsider: tuple[int, int, int, int, str]
) -> None:
    pid = outsider[0]
    trace = f'import ctypes; l = ctypes.CDLL(None, use_errno=True); print("PTRACE", l.ptrace(16, {pid}, 0, 0))'
    command = f"{PY} -c '{trace}'; kill -0 {pid} && echo SIGNALLED"
    out = mode.run(layout, command, layout.confinement())
    assert "PTRACE -1" in out
    assert "SIGNALLED" not in out


@in_same_namespace
def test_landlock_alone_refuses_tracing_and_signals_which_succeed_unconfined(
    mode: Mode, layout: Layout, outsider: tuple[int, int, int, int, str]
) -> None:
    pid = outsider[0]
    trace = f'import ctypes; l = ctypes.CDLL(None, use_errno=True); print("PTRACE", l.ptrace(16, {pid}, 0, 0))'
    command = f"{PY} -c '{trace}'; kill -0 {pid} && echo SIGNALLED"
    # Landlock alone (ptrace since ABI 1, signals since ABI 6), and the control: nothing stops them unconfined
    alone = mode.run(layout, command, without_namespaces(layout, enforce=True))
    assert "PTRACE -1" in alone
    if ABI >= 6:
        assert "SIGNALLED" not in alone
    control = mode.run(layout, command, without_namespaces(layout, enforce=False))
    assert "PTRACE 0" in control
    assert "SIGNALLED" in control


def _connect_abstract(name: str) -> str:
    return (
        "import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); "
        f"s.connect(b'\\0{name}'); print('UNIX_CONNECTED')"
    )


@pytest.mark.skipif(ABI < 6, reason="abstract unix socket scoping needs Landlock ABI 6")
def test_a_confined_command_cannot_reach_an_abstract_unix_socket_outside(
    mode: Mode, layout: Layout, outsider: tuple[int, int, int, int, str]
) -> None:
    command = f'{PY} -c "{_connect_abstract(outsider[4])}" 2>&1 | tail -1'
    assert "UNIX_CONNECTED" not in mode.run(layout, command, layout.confinement())


@in_same_namespace
@pytest.mark.skipif(ABI < 6, reason="abstract unix socket scoping needs Landlock ABI 6")
def test_landlock_alone_refuses_an_abstract_unix_socket_outside_which_connects_unconfined(
    mode: Mode, layout: Layout, outsider: tuple[int, int, int, int, str]
) -> None:
    command = f'{PY} -c "{_connect_abstract(outsider[4])}" 2>&1 | tail -1'
    assert "UNIX_CONNECTED" not in mode.run(layout, command, without_namespaces(layout, enforce=True))
    assert "UNIX_CONNECTED" in mode.run(layout, command, without_namespaces(layout, enforce=False))


def _network(tcp: int, udp: int, unix: Path) -> str:
    return (
        f'{PY} -c "import socket\n'
        "try:\n"
        f"    socket.socket(socket.AF_UNIX).connect('{unix}'); print('UNIX_OK')\n"
        "except OSError as e: print('UNIX', e)\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {tcp}), timeout=5).close(); print('TCP_OK')\n"
        "except OSError as e: print('TCP', e)\n"
        "try:\n"
        f"    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {udp})); print('UDP_OK')\n"
        "except OSError as e: print('UDP', e)\n"
        "try:\n"
        "    socket.socket(socket.AF_INET6, socket.SOCK_STREAM); print('TCP6_OK')\n"
        "except OSError as e: print('TCP6', e)\""
    )


def test_the_network_is_cut_when_asked(mode: Mode, layout: Layout, outsider: tuple[int, int, int, int, str]) -> None:
    out = mode.run(layout, _network(outsider[2], outsider[3], layout.socket), layout.confinement(network=False))
    assert "TCP_OK" not in out
    assert "UDP_OK" not in out
    assert "TCP6_OK" not in out
    assert "UNIX_OK" not in out  # a service's socket file is a way out too
    assert "Permission denied" in out


def test_the_network_is_there_by_default(mode: Mode, layout: Layout, outsider: tuple[int, int, int, int, str]) -> None:
    out = mode.run(layout, _network(outsider[2], outsider[3], layout.socket), layout.confinement())
    assert "TCP_OK" in out
    assert "UDP_OK" in out
    assert "UNIX_OK" in out  # as a TCP port on localhost is: the documented limit of an open network


def test_a_command_gets_none_of_the_workers_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    mode = MODES[0]
    monkeypatch.setenv("FORKQ_REDIS_URL", f"redis://:{SECRET}@redis:6379/0")
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    made = Layout.make(os.geteuid())
    try:
        out = mode.run(made, "env", made.confinement())
    finally:
        shutil.rmtree(made.base, ignore_errors=True)
    assert SECRET not in out
    assert f"TMPDIR={made.tmp}" in out


def test_the_probe_reports_what_this_machine_can_do() -> None:
    report = probe()
    assert report.landlock_abi == ABI
    assert report.line().startswith(f"landlock ABI {ABI}, mount namespace ")
    assert report.usable
    assert require() == report
    assert sandbox_problems("on") == []


def test_a_machine_without_a_way_to_cut_udp_is_refused() -> None:
    report = sandbox.SandboxReport(7, "", False, "unshare: Operation not permitted", False, "no filter")
    assert not report.usable
    assert "network cut: none" in report.line()


@pytest.mark.skipif(unprivileged_reason() is not None, reason=str(unprivileged_reason()))
def test_the_probe_says_when_no_user_namespace_can_be_made() -> None:
    # Given a user namespace in which no other can be made (as in a container whose runtime refuses unshare)
    code = "import sys; sys.path.insert(0, sys.argv[1]); from workers.workspace.sandbox import probe; "
    code += "print(probe().line())"
    helper = 'echo 0 > /proc/sys/user/max_user_namespaces && exec /usr/bin/python3 -I -S -c "$0" "$1"'
    root = str(Path(sandbox.__file__).resolve().parents[2])
    out = subprocess.run(["unshare", "-Ur", "sh", "-c", helper, code, root], capture_output=True, text=True, check=True)
    # Then the probe says so, and the network is still cut by seccomp
    assert "mount namespace no (" in out.stdout
    assert "network cut: landlock tcp + seccomp" in out.stdout


def test_the_sandbox_can_be_turned_off_by_the_operator() -> None:
    assert sandbox_problems("off") == []


def test_the_alias_is_replaced_in_a_command_only_without_a_namespace() -> None:
    c = Confinement(Path("/w/tree"), "/home/alice/proj/", Path("/w/tmp"))
    assert command_for(c, "cat /home/alice/proj/a.py", namespaced=False) == "cat /w/tree/a.py"
    assert command_for(c, "cat /home/alice/proj/a.py", namespaced=True) == "cat /home/alice/proj/a.py"
    assert command_for(c, "cd /home/alice/proj; ls /home/alice/project", False) == "cd /w/tree; ls /home/alice/project"
    assert command_for(c, "x='/home/alice/proj'", namespaced=False) == "x='/w/tree'"


def test_a_confinement_maps_the_parent_path_both_ways() -> None:
    c = Confinement(Path("/w/tree"), "/home/alice/proj", Path("/w/tmp"))
    assert c.inside("/home/alice/proj/src/a.py") == "/w/tree/src/a.py"
    assert c.inside("/home/alice/proj") == "/w/tree"
    assert c.inside("/home/alice/project/a.py") is None
    assert c.shown("/w/tree/src/a.py") == "/home/alice/proj/src/a.py"
    assert Confinement.from_json(c.to_json()) == c


def test_a_command_is_not_run_when_its_confinement_cannot_be_applied(tmp_path: Path) -> None:
    # Given a temp folder that does not exist: the sandbox cannot be built
    (tmp_path / "tree").mkdir()
    c = Confinement(tmp_path / "tree", ALIAS, tmp_path / "missing")
    out = MODES[0].run(Layout(tmp_path, os.geteuid()), "echo RAN", c)
    # Then nothing runs, and the output says why
    assert "RAN" not in out
    assert "the command was not run" in out
    assert out.endswith("[exit code: 126]")


def test_require_names_the_fix_when_landlock_is_missing() -> None:
    # the error a worker without Landlock stops with (what `forkq worker` prints)
    error = SandboxUnavailable("cannot sandbox: no Landlock; set FORKQ_SANDBOX=off", reason="no Landlock")
    assert "FORKQ_SANDBOX=off" in str(error)
    assert error.field == "sandbox"


def _without_landlock() -> None:
    """In the child before exec: a seccomp filter that makes the Landlock calls fail as on a kernel without it."""
    libc = ctypes.CDLL(None, use_errno=True)
    deny, allow = 0x00050000 | errno.ENOSYS, 0x7FFF0000
    program = [(0x20, 0, 0, 0)]  # the syscall number
    for number in (444, 445, 446):
        program += [(0x15, 0, 1, number), (0x06, 0, 0, deny)]
    program.append((0x06, 0, 0, allow))
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *insn) for insn in program))
    fprog = ctypes.create_string_buffer(struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(filters)))
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs
    assert libc.prctl(22, 2, fprog, 0, 0) == 0  # seccomp filter


def test_a_worker_that_cannot_sandbox_refuses_to_start_unless_the_operator_turns_it_off() -> None:
    # Given a machine where Landlock is missing (its calls fail with ENOSYS) and no Redis to reach
    def worker(sandbox_mode: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "FORKQ_PROVIDER": "scripted", "FORKQ_REDIS_URL": "redis://127.0.0.1:1/0"}
        env["FORKQ_SANDBOX"] = sandbox_mode
        code = "import sys; from workers.cli import main; sys.exit(main(['worker']))"
        return subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            preexec_fn=_without_landlock,
            check=False,
        )

    refused, allowed = worker("on"), worker("off")
    # Then with the sandbox on it refuses at once (exit 2), naming what is missing and the fix
    assert refused.returncode == 2, refused.stderr
    assert "cannot sandbox snapshot forks' commands" in refused.stderr
    assert "the kernel has no Landlock" in refused.stderr and "FORKQ_SANDBOX=off" in refused.stderr
    # and with FORKQ_SANDBOX=off it goes on, to the next thing it lacks (Redis: exit 1)
    assert allowed.returncode == 1 and "cannot sandbox" not in allowed.stderr, allowed.stderr


@pytest.mark.skipif(ABI < 6, reason="signal scoping needs Landlock ABI 6")
def test_a_confined_command_cannot_kill_its_supervisor(mode: Mode, layout: Layout) -> None:
    # the shell's parent is inside the sandbox; its parent, the supervisor that sweeps the call, is not
    command = "sup=$(ps -o ppid= -p $PPID | tr -d ' '); kill -9 $sup && echo KILLED; echo still here"
    out = mode.run(layout, command, layout.confinement())
    assert "KILLED" not in out and "Operation not permitted" in out
    assert "still here" in out and out.endswith("[exit code: 0]")  # stdout and stderr interleave in nobody modes


def test_shared_memory_is_the_runs_own(mode: Mode, layout: Layout) -> None:
    # Given a file in the host's /dev/shm, as another fork's semaphore or shared memory would be
    host = Path("/dev/shm") / f"forkq-test-{layout.base.name}"
    host.write_text(SECRET, encoding="utf-8")
    try:
        lock = f"{PY} -c 'import multiprocessing; multiprocessing.Lock(); print(\"LOCK_OK\")'"
        out = mode.run(layout, f"cat {host}; {lock}", layout.confinement())
    finally:
        host.unlink()
    # Then the command cannot read it; with a namespace, /dev/shm is a folder of the run, where locks work
    assert SECRET not in out
    if mode.namespaces:
        assert "LOCK_OK" in out
        assert (layout.tmp / ".shm").is_dir()

"""The sandbox of a snapshot fork's shell command: Landlock, seccomp, and the parent's path where it can be given.

`confine_self(c)` runs in the command's own process, just before it execs the shell, and cannot be
undone by anything the command does:

1. Where a user namespace can be made (`workers.workspace.mountns`), the process enters a new user and
   mount namespace (and a new network namespace when `network` is false) and a root of its own, in
   which the workspace is at the parent's path (`alias`) and the command starts there. Where it
   cannot (the usual case in a container: runtimes refuse `unshare` to unprivileged processes), the
   command starts in the workspace itself, and **every occurrence of `alias` in the command's text (as
   a whole path: not `/parent2`) is replaced by the workspace's path** before it runs (`command_for`):
   a documented heuristic that covers the paths the history names (`cat /parent/src/a.py`,
   `cd /parent && make`), not paths a program builds or reads at run time (a script's own text, a
   Makefile, a config file naming `/parent`). The file tools map those paths themselves (`Confinement.inside`).
2. `PR_SET_NO_NEW_PRIVS`, and every capability is dropped from the bounding set where the process may.
3. A Landlock ruleset (no privilege needed) allows read and execute on the system folders (`/usr`,
   `/bin`, `/sbin`, `/lib*`, `/etc`, `/opt`, and the Python installation the worker runs), read and
   write on the workspace and the run's temp folder, read and write on `/dev/null`, `/dev/zero`,
   `/dev/full`, `/dev/random`, `/dev/urandom` and `/dev/tty`, and read on `/proc`; nothing else: the
   worker's home, other forks' workspaces, the workspace cache, `/tmp` itself and mounted secrets are
   out of reach. Landlock also refuses `ptrace` (and so `/proc/<pid>/root`, `environ`, `mem`) of the
   worker's processes, and from ABI 6 signals to them and connections to their abstract unix sockets.
4. With `network` false: Landlock refuses TCP bind and connect (ABI 4), and a seccomp filter refuses
   `socket()` of the families AF_INET and AF_INET6 (UDP and raw sockets too), AF_UNIX (a service's
   socket file, such as a Redis or container runtime socket, is as much a way out as its TCP port;
   `socketpair()` still works) and AF_VSOCK, and `io_uring_setup` (its socket operation would bypass
   seccomp), with EACCES. Where a namespace is made, the command also has a network namespace of its own.

With `enforce` false (the operator set FORKQ_SANDBOX=off) nothing is confined; the parent's path is
still given where a namespace can be made. With `enforce` true, any step that cannot be applied raises:
a command never runs less confined than asked.

What it does not cover: with the network allowed, pathname unix sockets (a Landlock ABI 7 kernel does
not check `connect` on them: a command that knows a socket's path can reach the service listening on
it, as it can reach a TCP port on localhost); `/proc/<pid>/cmdline` of the host's processes (read, not
their environment or memory); CPU and memory (cgroups are the deployer's); the kernel's own attack surface.

Standard library and ctypes only; the shell's supervisor imports it without site-packages.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import re
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.errors import SandboxUnavailable
from workers.workspace import mountns

# syscall numbers: the generic table's, shared by x86_64 and aarch64 for these
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
MIN_LANDLOCK_ABI = 3  # below 3, truncate(2) is not checked: a command could empty any file the worker can

# Landlock file system rights, by ABI
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ABI1 = (1 << 13) - 1  # execute .. make_sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # the ones a file rule may hold

PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
AF_UNIX, AF_INET, AF_INET6, AF_VSOCK = 1, 2, 10, 40
# (audit arch, socket, io_uring_setup) per machine
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
X32_SYSCALL_BIT = 0x40000000

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/run/systemd/resolve")
SHM = "/dev/shm"  # where a namespaced command finds the run's own folder for POSIX shared memory
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")


@dataclass(frozen=True, slots=True)
class Confinement:
    """Where a snapshot fork's tools may act: its workspace (`root`), seen at the parent's path `alias`."""

    root: Path  # the fork's materialized workspace (the tools' working directory)
    alias: str  # the parent's absolute cwd: paths under it lead into root
    tmp: Path  # the run's private temp folder (TMPDIR and HOME of commands)
    network: bool = True
    enforce: bool = True  # False only when the operator set FORKQ_SANDBOX=off

    def inside(self, path: str) -> str | None:
        """`path` under `alias` as the same path under `root`; None for a path elsewhere."""
        alias = self.alias.rstrip("/") or "/"
        if path == alias:
            return str(self.root)
        prefix = alias if alias.endswith("/") else alias + "/"
        if alias != "/" and path.startswith(prefix):
            return str(self.root / path[len(prefix) :])
        return None

    def shown(self, path: str) -> str:
        """A path under `root` as the model knows it: under `alias`."""
        root = str(self.root)
        if path == root:
            return self.alias
        if path.startswith(root + "/"):
            return self.alias.rstrip("/") + path[len(root) :]
        return path

    def to_json(self) -> str:
        """The confinement as JSON (handed to the shell's supervisor on its command line)."""
        return json.dumps({**asdict(self), "root": str(self.root), "tmp": str(self.tmp)})

    @classmethod
    def from_json(cls, text: str) -> Confinement:
        """The confinement `to_json` gave."""
        data = json.loads(text)
        return cls(Path(data["root"]), data["alias"], Path(data["tmp"]), bool(data["network"]), bool(data["enforce"]))


@dataclass(frozen=True, slots=True)
class SandboxReport:
    """What this process can do to confine a command: each part, or why not."""

    landlock_abi: int  # 0: none
    landlock_reason: str  # why not, or "" when usable
    namespaces: bool  # a user + mount namespace can be made (the parent's path is given)
    namespaces_reason: str
    seccomp: bool
    seccomp_reason: str

    @property
    def usable(self) -> bool:
        """Whether a command can be confined: Landlock at MIN_LANDLOCK_ABI or later, and a way to cut the network."""
        return self.landlock_abi >= MIN_LANDLOCK_ABI and bool(self.network_cut)

    @property
    def network_cut(self) -> list[str]:
        """The means that cut a command's network when asked (each is enough for TCP; UDP needs one of the last two)."""
        means = ["landlock tcp"] if self.landlock_abi >= 4 else []
        means += ["seccomp"] if self.seccomp else []
        means += ["network namespace"] if self.namespaces else []
        return means if ("seccomp" in means or "network namespace" in means) else []

    def line(self) -> str:
        """`landlock ABI 7, mount namespace yes, network cut: landlock tcp + seccomp + network namespace`."""
        landlock = f"landlock ABI {self.landlock_abi}" if self.landlock_abi else f"landlock no ({self.landlock_reason})"
        ns = "yes" if self.namespaces else f"no ({self.namespaces_reason})"
        cut = " + ".join(self.network_cut) or f"none (seccomp: {self.seccomp_reason})"
        return f"{landlock}, mount namespace {ns}, network cut: {cut}"


@functools.cache
def _libc() -> ctypes.CDLL:
    # loaded once, in the parent: the probe's forked children then call into it without loading anything
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> tuple[int, str]:
    """The kernel's Landlock ABI version, or 0 and why not."""
    abi = _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION)
    if abi > 0:
        return abi, ""
    err = ctypes.get_errno()
    why = {
        errno.ENOSYS: "the kernel has no Landlock (Linux 5.13 or later, built with CONFIG_SECURITY_LANDLOCK)",
        errno.EOPNOTSUPP: "Landlock is built but not enabled (add landlock to the kernel's lsm= boot parameter)",
        errno.EPERM: "a seccomp profile of the container runtime refuses the Landlock system calls",
    }
    return 0, why.get(err, os.strerror(err))


def _in_child(action: object) -> tuple[bool, str]:
    """Run `action` (a callable) in a forked child; whether it succeeded, or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(read)
        code, message = 0, b""
        try:
            action()  # type: ignore[operator]
        except BaseException as exc:
            code, message = 1, str(exc).encode()[:500]
        os.write(write, message)
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode(errors="replace")
    status = os.waitpid(pid, 0)[1]
    return os.waitstatus_to_exitcode(status) == 0, said


def _try_namespaces() -> None:
    mountns.enter_namespaces(network=False)
    mountns._mount("tmpfs", "/tmp", "tmpfs", mountns.MS_NOSUID | mountns.MS_NODEV)


def _try_seccomp() -> None:
    _no_new_privs()
    _network_filter()
    import socket  # noqa: PLC0415 - the probe's alone: the supervisor imports this module for every command

    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
    except PermissionError:
        return
    raise OSError("the filter did not refuse socket(AF_INET)")


def probe() -> SandboxReport:
    """What this process can do to confine a command (namespaces and seccomp are tried in forked children)."""
    abi, why = landlock_abi()
    mountns.libc()
    ns_ok, ns_why = _in_child(_try_namespaces)
    sc_ok, sc_why = _in_child(_try_seccomp)
    return SandboxReport(abi, why, ns_ok, "" if ns_ok else ns_why, sc_ok, "" if sc_ok else sc_why)


def require() -> SandboxReport:
    """The probe's report when a command can be confined here.

    Raises:
        SandboxUnavailable: no Landlock at MIN_LANDLOCK_ABI or later, or no way to cut the network.
    """
    report = probe()
    if report.landlock_abi < MIN_LANDLOCK_ABI:
        reason = report.landlock_reason or f"Landlock ABI {report.landlock_abi} (needs {MIN_LANDLOCK_ABI}: Linux 6.2)"
    elif not report.network_cut:
        reason = f"no way to cut a command's UDP traffic: seccomp ({report.seccomp_reason}) and network namespaces "
        reason += f"({report.namespaces_reason}) both fail"
    else:
        return report
    raise SandboxUnavailable(
        f"this worker cannot sandbox snapshot forks' commands: {reason}. Run it on a kernel with Landlock "
        "(Linux 6.2+), or, knowing their commands then reach everything the worker can, set FORKQ_SANDBOX=off",
        reason=reason,
    )


def sandbox_problems(mode: str) -> list[str]:
    """Why a worker with FORKQ_SANDBOX=`mode` must not start: none when `off`, or when commands can be confined."""
    if mode == "off":
        return []
    try:
        require()
    except SandboxUnavailable as exc:
        return [str(exc)]
    return []


def command_for(c: Confinement, command: str, namespaced: bool) -> str:
    """The command's text as it runs: `alias` replaced by `root` when the parent's path could not be given."""
    alias = c.alias.rstrip("/")
    if namespaced or alias in ("", str(c.root)):
        return command
    # the whole path only: `/home/a/proj` in `/home/a/proj/x` or `cd /home/a/proj;`, not in `/home/a/project`
    return re.sub(re.escape(alias) + r"(?![\w.-])", lambda _: str(c.root), command)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _no_new_privs() -> None:
    _check(_libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _drop_bounding_set() -> None:
    """Drop every capability from the bounding set where the process may (a root worker, or in a namespace)."""
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 40
    libc = _libc()
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: nothing to drop then


def _network_filter() -> None:
    """A seccomp filter: socket() of AF_INET, AF_INET6, AF_UNIX, AF_VSOCK and io_uring_setup fail with EACCES."""
    arch = SECCOMP_ARCH.get(os.uname().machine)
    if arch is None:
        raise OSError(errno.ENOSYS, f"no seccomp filter for the {os.uname().machine} architecture")
    audit_arch, nr_socket, nr_uring = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EACCES  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    program = [
        (ld, 0, 0, 4),  # arch
        (jeq, 1, 0, audit_arch),
        (ret, 0, 0, deny),  # another ABI (32-bit calls): refused whole
        (ld, 0, 0, 0),  # syscall number
        (jge, 0, 1, X32_SYSCALL_BIT),
        (ret, 0, 0, deny),
        (jeq, 0, 1, nr_uring),
        (ret, 0, 0, deny),
        (jeq, 0, 6, nr_socket),
        (ld, 0, 0, 16),  # args[0] (low half): the family
        (jeq, 3, 0, AF_INET),
        (jeq, 2, 0, AF_INET6),
        (jeq, 1, 0, AF_UNIX),
        (jeq, 0, 1, AF_VSOCK),
        (ret, 0, 0, deny),
        (ret, 0, 0, allow),
    ]
    raw = b"".join(struct.pack("=HBBI", *insn) for insn in program)
    buf = ctypes.create_string_buffer(raw)
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(buf))
    prog = ctypes.create_string_buffer(fprog)
    _check(_libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, prog, 0, 0), "seccomp(socket filter)")


def _handled(abi: int, network: bool) -> tuple[int, int, int]:
    """The rights the ruleset handles (all it knows, so all are denied but the rules'), network's, scopes."""
    fs = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (FS_IOCTL_DEV if abi >= 5 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if (abi >= 4 and not network) else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    return fs, net, scoped


def system_paths() -> list[str]:
    """The read-and-execute folders: the system's and the Python installation's (a virtualenv may be elsewhere)."""
    found = [p for p in SYSTEM_DIRS if os.path.exists(p)]
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        if not any(prefix == p or prefix.startswith(p + "/") for p in found):
            found.append(prefix)
    return found


class Ruleset:
    """A Landlock ruleset being built; `restrict` applies it to this process (and everything it execs)."""

    def __init__(self, abi: int, network: bool) -> None:
        self.abi = abi
        self.fs, net, scoped = _handled(abi, network)
        attr = struct.pack("=QQQ", self.fs, net, scoped)
        size = 24 if abi >= 6 else 16 if abi >= 4 else 8
        self.fd = _check(
            _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, attr[:size], ctypes.c_size_t(size), 0),
            "landlock_create_ruleset",
        )

    def allow_fd(self, fd: int, rights: int, what: str) -> None:
        """Allow `rights` beneath the open file or folder `fd` (file rules keep only file rights)."""
        is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
        rights &= self.fs if is_dir else self.fs & FILE_RIGHTS
        attr = struct.pack("=Qi", rights, fd)
        _check(
            _libc().syscall(SYS_LANDLOCK_ADD_RULE, self.fd, LANDLOCK_RULE_PATH_BENEATH, attr, 0),
            f"landlock_add_rule({what})",
        )

    def allow(self, path: str, rights: int) -> None:
        """Allow `rights` beneath `path`; a path that does not exist is skipped."""
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            self.allow_fd(fd, rights, path)
        finally:
            os.close(fd)

    def restrict(self) -> None:
        """Confine this process for good."""
        try:
            _check(_libc().syscall(SYS_LANDLOCK_RESTRICT_SELF, self.fd, 0), "landlock_restrict_self")
        finally:
            os.close(self.fd)


def _landlock(c: Confinement, writable: tuple[int, ...], abi: int) -> None:
    """Apply the ruleset; `writable`: the workspace, the temp folder and the shared-memory folder, held open.

    A rule is found by walking up from a mount's root to where it is mounted: a folder bound elsewhere (the
    workspace at the alias, the shared-memory folder at /dev/shm) needs a rule of its own, not its parent's.
    """
    rules = Ruleset(abi, c.network)
    read = FS_READ_FILE | FS_READ_DIR
    for path in system_paths():
        rules.allow(path, read | FS_EXECUTE)
    for device in DEVICES:
        rules.allow(device, FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV)
    rules.allow("/proc", read)
    for fd, what in zip(writable, (c.root, c.tmp, SHM), strict=True):
        rules.allow_fd(fd, rules.fs, str(what))
    rules.restrict()


def enter_alias(c: Confinement, shm: str) -> bool:
    """Give the command the workspace at `alias` in namespaces of its own; whether that could be done.

    `/dev/shm` there is the folder `shm`, private to the run (POSIX semaphores and shared memory, as
    Python's multiprocessing uses, work without a folder every process of the host shares).
    """
    alias = os.path.normpath(c.alias)
    try:
        mountns.plan_for({alias: 0, str(c.tmp): 1, SHM: 2})
    except ValueError:
        return False  # the alias holds the temp folder (or is `/`): the text replacement instead
    try:
        mountns.enter_namespaces(c.network)
    except OSError:
        return False
    # from here on a failure leaves this process half-built: raised, so the command does not run.
    # Opened again in the new namespace: a bind's source must be a mount of the caller's own namespace
    fds = {
        path: os.open(real, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        for path, real in ((alias, c.root), (str(c.tmp), c.tmp), (SHM, shm))
    }
    try:
        mountns.new_root(str(c.tmp), fds)
    finally:
        for fd in fds.values():
            os.close(fd)
    os.chdir(alias)
    return True


def confine_self(c: Confinement) -> bool:
    """Confine this process (single-threaded, about to exec the command); whether the parent's path is given.

    Raises:
        SandboxUnavailable: with `enforce`, a part of the confinement could not be applied.
    """
    root_fd = os.open(c.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    tmp_fd = os.open(c.tmp, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    shm = os.path.join(c.tmp, ".shm")
    os.makedirs(shm, mode=0o700, exist_ok=True)
    shm_fd = os.open(shm, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        namespaced = enter_alias(c, shm)
        if not namespaced:
            os.chdir(c.root)
        if not c.enforce:
            return namespaced
        abi, why = landlock_abi()
        if abi < MIN_LANDLOCK_ABI:
            reason = why or f"Landlock ABI {abi}, {MIN_LANDLOCK_ABI} needed"
            raise SandboxUnavailable(
                f"cannot sandbox the command: {reason}; set FORKQ_SANDBOX=off to run it unconfined", reason=reason
            )
        try:
            _no_new_privs()
            _drop_bounding_set()
            if not c.network:
                _network_filter()
            _landlock(c, (root_fd, tmp_fd, shm_fd), abi)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot sandbox the command: {exc}", reason=str(exc)) from exc
        return namespaced
    finally:
        for fd in (root_fd, tmp_fd, shm_fd):
            os.close(fd)

"""The settings a sandboxed command is tried in, and an outsider process for it to attack.

Each `Mode` runs one command through the shell's supervisor, confined as a `Confinement` says:

- `tool`: `run_shell_command` itself, in this process, as the test's user (root in CI here, so each
  refusal is the sandbox's: root's permissions would allow everything);
- `nobody`: the supervisor as uid 65534 with every capability dropped (`setpriv`), the deploy image's
  situation without its read-only root;
- `nobody-ro`: the same inside a mount namespace whose `/` is read-only;
- `nobody-ro-nouserns`: the same where no user namespace can be made (the limit set to 0 in a user
  namespace around it), the usual container: the parent's path is then given by text replacement.

The `nobody*` modes need root (to switch users and build the namespace) and the system's python3
(3.10 or later: the supervisor and the sandbox need the standard library only).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workers.tools import shell_supervisor
from workers.workspace.sandbox import Confinement

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


def readable_supervisor() -> Path:
    """The supervisor in a copy of the `workers` package that uid 65534 can read: the checkout may lie in a folder
    only its owner may enter (a clone into `mktemp -d`), and the supervisor imports the package beside it."""
    package = Path(shell_supervisor.__file__).resolve().parents[1]
    copy = Path(tempfile.mkdtemp(prefix="forkq-sandbox-code-"))
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    shutil.copytree(package, copy / "workers", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in (copy, *copy.rglob("*")):
        folder.chmod(0o755 if folder.is_dir() else 0o644)
    return copy / "workers" / "tools" / "shell_supervisor.py"


SUPERVISOR = readable_supervisor()
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
SETPRIV += ["--inh-caps=-all", "--bounding-set=-all"]
SECRET = "SECRET-7f3a"  # in every file the command must not read
ALIAS = "/home/alice/proj"  # the parent's cwd: not on this machine

# run argv[2:] in a new user namespace mapping ids 0..65535 to themselves and a new mount namespace whose `/`
# is read-only; argv[1] == "nouserns": no user namespace can be made inside. `{PPID}` in argv: this pid
NAMESPACE_HELPER = r"""
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
r1, w1 = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    assert libc.unshare(0x10000000 | 0x00020000) == 0, ctypes.get_errno()
    os.write(w1, b"x"); os.read(r2, 1)
    os.setresgid(0, 0, 0); os.setresuid(0, 0, 0)
    if sys.argv[1] == "nouserns":
        with open("/proc/sys/user/max_user_namespaces", "w") as f: f.write("0")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    for keep in sys.argv[2].split(":"):  # the test's folders stay writable
        subprocess.run(["mount", "--bind", keep, keep], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", "/"], check=True)
    me = str(os.getpid())
    argv = [a.replace("{PPID}", me) for a in sys.argv[3:]]
    sys.exit(subprocess.run(argv).returncode)
os.read(r1, 1)
for m in ("uid_map", "gid_map"):
    with open(f"/proc/{pid}/{m}", "w") as f: f.write("0 0 65536")
os.write(w2, b"x")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""

# holds the secret open, listens on an abstract and a pathname unix socket and on TCP and UDP ports;
# prints its pid, the secret's fd and its ports
OUTSIDER = r"""
import os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); unix.bind("\0" + sys.argv[2]); unix.listen(8)
path = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); path.bind(sys.argv[3]); path.listen(8)
tcp = socket.create_server(("127.0.0.1", 0))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("127.0.0.1", 0))
print(os.getpid(), fd, tcp.getsockname()[1], udp.getsockname()[1], flush=True)
tcp.settimeout(0.2)
while True:
    try:
        tcp.accept()[0].close()
    except OSError:
        pass
"""


def unprivileged_reason() -> str | None:
    """Why the `nobody*` modes cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to switch to uid 65534 and to build the namespaces"
    if shutil.which("setpriv") is None or shutil.which("mount") is None:
        return "needs setpriv and mount (util-linux)"
    try:
        version = subprocess.run(
            [SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info >= (3, 10))"],
            text=True,
            capture_output=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"needs {SYSTEM_PYTHON}"
    return None if version == "True" else f"needs {SYSTEM_PYTHON} 3.10 or later"


@dataclass
class Layout:
    """The folders of one test: the workspace, its temp folder, and what lies beside them."""

    base: Path
    uid: int

    @property
    def root(self) -> Path:
        return self.base / "tree"

    @property
    def tmp(self) -> Path:
        return self.base / "tmp"

    @property
    def sibling(self) -> Path:
        """Another fork's workspace."""
        return self.base / "sibling" / "secret.txt"

    @property
    def home(self) -> Path:
        """A file in the worker's home."""
        return self.base / "home" / ".config" / "secret.txt"

    @property
    def cache(self) -> Path:
        """A blob in the worker's workspace cache."""
        return self.base / "cache" / "blob"

    @property
    def socket(self) -> Path:
        """A service's unix socket, beside the workspace."""
        return self.base / "service.sock"

    @property
    def outside(self) -> Path:
        """A file in /tmp outside the run's temp folder."""
        return self.base / "outside.txt"

    @classmethod
    def make(cls, uid: int) -> Layout:
        """Every folder and secret, owned by `uid` (so only the sandbox keeps the command from them)."""
        base = Path(tempfile.mkdtemp(prefix="forkq-sandbox-", dir="/tmp"))
        base.chmod(0o755)
        layout = cls(base, uid)
        layout.root.mkdir()
        layout.tmp.mkdir()
        (layout.root / "a.txt").write_text("parent's file\n", encoding="utf-8")
        for secret in (layout.sibling, layout.home, layout.cache, layout.outside):
            secret.parent.mkdir(parents=True, exist_ok=True)
            secret.write_text(f"{SECRET}\n", encoding="utf-8")
        for path in [base, *base.rglob("*")]:
            os.chown(path, uid, uid)
        return layout

    def confinement(self, *, network: bool = True, enforce: bool = True) -> Confinement:
        """The workspace's confinement, at the parent's path ALIAS."""
        return Confinement(self.root, ALIAS, self.tmp, network=network, enforce=enforce)


@dataclass(frozen=True)
class Mode:
    """A setting a confined command runs in (see the module docstring)."""

    name: str
    prefix: tuple[str, ...]  # before the supervisor's python; empty: `run_shell_command` in this process
    namespaces: bool  # whether the parent's path is given by a mount namespace (else by text replacement)

    @property
    def uid(self) -> int:
        return os.geteuid() if not self.prefix else NOBODY

    def outsider(self, layout: Layout) -> tuple[subprocess.Popen[str], list[int], str]:
        """A process of the command's user outside the sandbox; its pid, the fd of the secret it holds, its ports."""
        name = f"forkq-test-{os.getpid()}-{layout.base.name}"
        prefix = list(SETPRIV) if self.prefix else []
        python = SYSTEM_PYTHON if self.prefix else sys.executable
        proc = subprocess.Popen(
            [*prefix, python, "-c", OUTSIDER, str(layout.sibling), name, str(layout.socket)],
            stdout=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/bin:/bin", "FORKQ_REDIS_URL": f"redis://:{SECRET}@redis:6379/0"},
        )
        assert proc.stdout is not None
        return proc, [int(x) for x in proc.stdout.readline().split()], name

    def run(self, layout: Layout, command: str, confinement: Confinement) -> str:
        """The command's output and exit line, confined."""
        if not self.prefix:
            from workers.tools.registry import ToolContext
            from workers.tools.shell import run_shell_command

            ctx = ToolContext("f-sandbox", confinement.root, None, "k", confinement=confinement)
            return run_shell_command({"command": command, "timeout_s": 60}, ctx)
        argv = [*self.prefix, SYSTEM_PYTHON, "-I", "-S", str(SUPERVISOR), "{PPID}", shutil.which("bash") or "/bin/sh"]
        argv += [command, confinement.to_json()]
        if self.prefix[0] != SYSTEM_PYTHON:  # the namespace helper puts its own pid in
            argv = [a.replace("{PPID}", str(os.getpid())) for a in argv]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(layout.tmp), "TMPDIR": str(layout.tmp)}
        done = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=120)
        return f"{done.stdout}{done.stderr}[exit code: {done.returncode}]"


def modes() -> list[Mode]:
    """Every mode; the `nobody*` ones only where they can run."""
    found = [Mode("tool", (), namespaces=True)]
    if unprivileged_reason() is None:
        helper = (SYSTEM_PYTHON, "-c", NAMESPACE_HELPER)
        found += [
            Mode("nobody", tuple(SETPRIV), namespaces=True),
            Mode("nobody-ro", (*helper, "userns", "/tmp", *SETPRIV), namespaces=True),
            Mode("nobody-ro-nouserns", (*helper, "nouserns", "/tmp", *SETPRIV), namespaces=False),
        ]
    return found

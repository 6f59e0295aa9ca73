"""The parent's path in a command's own view of the file system: a user and mount namespace with a new root.

A snapshot fork's workspace lives in a private folder of the worker, yet the inherited history names
files by the parent's absolute paths (`alias`). Where the worker may create a user namespace (no
privilege needed, when the kernel and the container runtime allow it), the shell's process enters a
new user and mount namespace, builds a root of its own on a tmpfs, and `chroot`s into it:

- every entry of the real `/` is bind-mounted (recursively) at its place, except along two paths,
  where the folders are recreated on the tmpfs with their other entries bound one by one;
- at `alias`, the workspace is bound (the parent's folders that the worker does not have are created
  on the tmpfs, and a folder of the worker that is there, such as its home, is hidden);
- at the run's temp folder, the temp folder is bound (the tmpfs is mounted over it first, so the new
  root is out of sight of everything mirrored);
- at `/dev/shm`, a folder of the run's own (the caller says which), so shared memory is private.

Nothing is written to the real file system (a read-only root is fine), and nothing is unmounted:
the namespace ends with its last process. The Landlock rules of `workers.workspace.sandbox` then
confine what the command may touch, whatever path it takes; the namespace only gives the paths.

Standard library only, and nothing of forkq: the shell's supervisor runs it without site-packages.
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat
from pathlib import PurePosixPath

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_NOSUID = 2
MS_NODEV = 4
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429  # the same on x86_64 and aarch64 (Linux 5.2)
OPEN_TREE_CLONE, AT_RECURSIVE, AT_EMPTY_PATH, MOVE_MOUNT_F_EMPTY_PATH = 1, 0x8000, 0x1000, 0x4

# the paths to build, as a tree of names; a leaf (an int) is the descriptor of the folder to bind there
Plan = dict[str, "Plan | int"]


class MountError(OSError):
    """A step of building the namespace failed; the message names the step and the path."""


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, loaded once (before a fork, so the child loads nothing)."""
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"{what}: {os.strerror(err)}")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc().mount(_bytes(source), target.encode(), _bytes(fstype), flags, _bytes(data)), f"mount {target}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_namespaces(network: bool) -> None:
    """Enter a new user and mount namespace (and a network one when `network` is false), as the same ids.

    The caller must be single-threaded. Raises MountError where the kernel or the runtime refuses.
    """
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | (0 if network else CLONE_NEWNET)
    _check(libc().unshare(flags), "unshare(user, mount namespaces)")
    # the same ids inside: the command is not root in the namespace, so exec gives it no capability
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing built here may propagate back to the worker


def plan_for(paths: dict[str, int]) -> Plan:
    """The tree of names to build: each absolute path of `paths` leads to the descriptor bound there.

    Raises ValueError when one path is `/` or lies under another (one bind would hide the other).
    """
    plan: Plan = {}
    for path, fd in sorted(paths.items()):
        parts = PurePosixPath(os.path.normpath(path)).parts[1:]
        if not parts:
            raise ValueError("the root folder cannot be replaced")
        node = plan
        for name in parts[:-1]:
            child = node.setdefault(name, {})
            if isinstance(child, int):
                raise ValueError(f"{path} lies under another bound folder")
            node = child
        if parts[-1] in node:
            raise ValueError(f"{path} holds or repeats another bound folder")
        node[parts[-1]] = fd
    return plan


def _bind(source: str, target: str) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)


def _detached_copy(fd: int) -> int:
    """A detached copy of the mounts at the open folder `fd`: it stays the folder once something is mounted over it."""
    flags = OPEN_TREE_CLONE | AT_RECURSIVE | AT_EMPTY_PATH | os.O_CLOEXEC
    tree = libc().syscall(SYS_OPEN_TREE, fd, b"", flags)
    if tree < 0:
        err = ctypes.get_errno()
        raise MountError(err, f"open_tree (a copy of a bound folder): {os.strerror(err)}")
    return int(tree)


def _attach(tree: int, target: str) -> None:
    _check(libc().syscall(SYS_MOVE_MOUNT, tree, b"", -100, target.encode(), MOVE_MOUNT_F_EMPTY_PATH), f"mount {target}")


def _mirror_entry(real_dir: int, name: str, target: str) -> None:
    """Give `target` the entry `name` of the real folder: a link copied, anything else bound."""
    try:
        st = os.stat(name, dir_fd=real_dir, follow_symlinks=False)
    except OSError:
        return  # gone meanwhile
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=real_dir), target)
        return
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(target, 0o755)
    else:
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=real_dir)
    try:
        _bind(f"/proc/self/fd/{fd}", target)
    except MountError:
        if stat.S_ISDIR(st.st_mode):
            raise
        os.unlink(target)  # a device or socket the namespace may not bind (a console): left out, not fatal
    finally:
        os.close(fd)


def _build(real_dir: int | None, target: str, plan: Plan) -> None:
    """Fill the tmpfs folder `target` from the real folder `real_dir` (None: one the worker does not have)."""
    names = set(plan)
    if real_dir is not None:
        for name in os.listdir(real_dir):
            if name not in names:
                _mirror_entry(real_dir, name, os.path.join(target, name))
    for name, inner in plan.items():
        path = os.path.join(target, name)
        os.mkdir(path, 0o755)
        if isinstance(inner, int):
            _attach(inner, path)
            continue
        below = None
        if real_dir is not None:
            try:
                below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=real_dir)
            except OSError:
                below = None  # missing, or a link or file where the plan needs a folder: recreated empty
        try:
            _build(below, path, inner)
        finally:
            if below is not None:
                os.close(below)


def new_root(scratch: str, binds: dict[str, int]) -> None:
    """Mount a tmpfs on `scratch`, mirror `/` into it with `binds` (path -> descriptor) in place, chroot there.

    `scratch` must be one of the bound paths (the run's temp folder), so the tmpfs hides nothing that is
    mirrored; the bound folders are copied (detached) before it is mounted, so the copy of `scratch` is
    the folder, not the tmpfs. Raises MountError or OSError on any failed step.
    """
    trees: dict[str, int] = {}
    real_root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for path, fd in binds.items():
            trees[path] = _detached_copy(fd)
        plan = plan_for(trees)
        _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        _build(real_root, scratch, plan)
    finally:
        os.close(real_root)
        for tree in trees.values():
            os.close(tree)
    os.chdir(scratch)
    _check(libc().chroot(b"."), "chroot into the new root")
    os.chdir("/")

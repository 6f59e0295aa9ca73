"""Open a path beneath a directory in one step, so that a symlink swapped in meanwhile cannot lead out of it.

Checking a path and opening it later leaves a window in which one of its components can be replaced
by a symlink pointing out of the working directory. The file tools therefore open everything they
touch from a descriptor of the working directory, resolving the whole path in the same step:

- `openat2(2)` with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS` (Linux 5.6 and later): the kernel
  refuses any resolution that leaves the directory (`..` above it, an absolute symlink, a symlink
  pointing out) with EXDEV;
- where the kernel lacks it (or a seccomp profile refuses it), a walk of the path one component at
  a time: each opened with `O_NOFOLLOW` from the descriptor of its parent, a symlink read with
  `readlinkat` on that same descriptor and its target walked the same way, `..` taken from the
  walk's own stack of descriptors (never looked up by the kernel, so it cannot climb out).

The kernel refuses absolute symlinks beneath a directory even when they point back inside it; such a
path is then resolved by the walk, which accepts an absolute target below the directory's own path.
Failures are `OSError`s: EXDEV for a path that leads outside, ELOOP past `MAX_SYMLINKS` symlinks.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import stat
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
# openat2 has one number on every architecture that took it after the syscall table unification
OPENAT2_NUMBERS = {"x86_64": 437, "aarch64": 437, "arm64": 437, "riscv64": 437, "ppc64le": 437, "s390x": 437}
MAX_SYMLINKS = 40  # as the kernel's own limit
DIRECTORY = os.O_PATH | os.O_DIRECTORY  # a directory to open things from: search permission suffices
ANY = os.O_PATH  # a name's object, whatever it is, without opening it for I/O (stat, type)

# None: not probed yet; tests set it to False to exercise the walk on a kernel that has openat2
use_openat2: bool | None = None


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def _load_syscall() -> Any:
    if sys.platform != "linux" or platform.machine() not in OPENAT2_NUMBERS:
        return None
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    syscall.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)
    return syscall


_SYSCALL = _load_syscall()
AT_FDCWD = -100


def _openat2(dir_fd: int, path: str, flags: int, mode: int) -> int:
    if _SYSCALL is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), path)
    number = OPENAT2_NUMBERS[platform.machine()]
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    fd = int(_SYSCALL(number, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how)))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return fd


def openat2_available() -> bool:
    """Whether this process can use `openat2` (probed once; `use_openat2` overrides)."""
    global use_openat2  # noqa: PLW0603 - one probe per process
    if use_openat2 is None:
        try:
            os.close(_openat2(AT_FDCWD, ".", ANY, 0))
            use_openat2 = True
        except OSError:  # ENOSYS (old kernel, other platform), EPERM (seccomp): the walk does the same job
            use_openat2 = False
    return use_openat2


def _symlink_target(dir_fd: int, name: str) -> str | None:
    """The target of `name` when it is a symlink; None when it is not (any longer)."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return None


def _below(root: str, target: str) -> list[str]:
    """The components of absolute `target` below `root`; EXDEV when it is not below it."""
    prefix = root.rstrip("/") + "/"
    if target != root and not target.startswith(prefix):
        raise OSError(errno.EXDEV, "symlink points outside the directory", target)
    return target[len(prefix) :].split("/") if target != root else []


class _Walk:
    """One component-wise resolution beneath `root` (see the module docstring)."""

    def __init__(self, root: RootDir, relative: str) -> None:
        self.root = root
        self.parts = deque(relative.split("/"))
        self.stack: list[int] = []  # descriptors of the directories below the root, deepest last
        self.links = 0

    @property
    def here(self) -> int:
        return self.stack[-1] if self.stack else self.root.fd

    def follow(self, target: str) -> None:
        self.links += 1
        if self.links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        if target.startswith("/"):
            self.close()
            self.parts.extendleft(reversed(_below(self.root.path, target)))
        else:
            self.parts.extendleft(reversed(target.split("/")))

    def open(self, flags: int, mode: int) -> int:
        while self.parts:
            name = self.parts.popleft()
            if name in ("", "."):
                continue
            if name == "..":
                if not self.stack:
                    raise OSError(errno.EXDEV, "path leads above the directory", "..")
                os.close(self.stack.pop())
                continue
            last = not any(part not in ("", ".") for part in self.parts)
            fd = self._component(name, flags if last else DIRECTORY, mode)
            if fd is None:
                continue  # a symlink: its target's components were queued
            if last:
                return fd
            self.stack.append(fd)
        # the path ends at a directory reached by `.` or `..` (or is empty): open it as asked
        return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=self.here)

    def _component(self, name: str, flags: int, mode: int) -> int | None:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.here)
        except OSError as exc:
            # ELOOP: O_NOFOLLOW met a symlink; ENOTDIR: a symlink where a directory was asked for
            target = _symlink_target(self.here, name) if exc.errno in (errno.ELOOP, errno.ENOTDIR) else None
            if target is None:
                raise
            self.follow(target)
            return None
        if flags & os.O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):  # O_PATH|O_NOFOLLOW opens the link itself
            target = _symlink_target(self.here, name)
            os.close(fd)
            if target is None:  # replaced by something else meanwhile: look again (counted as a link)
                target = name
            self.follow(target)
            return None
        return fd

    def close(self) -> None:
        while self.stack:
            os.close(self.stack.pop())


@dataclass
class RootDir:
    """A directory held open by descriptor; `open` resolves paths beneath it (a context manager)."""

    path: str  # its real absolute path, as the descriptor found it
    fd: int

    @classmethod
    def open(cls, directory: Path | str) -> RootDir:
        """Open `directory` (symlinks in it followed: it is the trusted starting point)."""
        fd = os.open(directory, DIRECTORY | os.O_CLOEXEC)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the path as resolved now
            path = os.path.realpath(directory)
        return cls(path, fd)

    def close(self) -> None:
        """Close the directory's descriptor."""
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __enter__(self) -> RootDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def open_beneath(self, relative: str, flags: int, mode: int = 0o666) -> int:
        """A descriptor of `relative` opened with `flags`, resolved without ever leaving this directory.

        Raises:
            OSError: EXDEV when the path leads outside; ELOOP past MAX_SYMLINKS; whatever open(2) says.
            ValueError: the path holds a NUL byte.
        """
        if "\0" in relative or relative.startswith("/"):
            raise ValueError(f"{relative!r}: a relative path without NUL bytes is expected")
        if openat2_available():
            for _ in range(3):  # EAGAIN: the kernel saw a concurrent rename and asks for a retry
                try:
                    return _openat2(self.fd, relative or ".", flags, mode)
                except OSError as exc:
                    if exc.errno == errno.EAGAIN:
                        continue
                    if exc.errno != errno.EXDEV:
                        raise
                    break  # outside, or an absolute symlink back inside: the walk tells which
        walk = _Walk(self, relative)
        try:
            return walk.open(flags, mode)
        finally:
            walk.close()

    def relative(self, fd: int, fallback: str) -> str:
        """The path of what `fd` is open on, relative to this directory (`fallback` when unknown)."""
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return fallback
        if real == self.path:
            return "."
        prefix = self.path.rstrip("/") + "/"
        return real[len(prefix) :] if real.startswith(prefix) else fallback

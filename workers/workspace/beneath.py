"""Reading a tree's files without following a symlink anywhere on the way, so a read never leaves the tree.

`O_NOFOLLOW` guards only a path's last name: if a process swaps a folder of the path for a symlink
between a listing and a read, `open(root/a/b)` reads wherever `a` now points. Here every folder on
the way is opened with `O_NOFOLLOW | O_DIRECTORY` relative to the one before, so a symlink anywhere
fails the open (ELOOP or ENOTDIR) instead of leading out of the tree.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

_FOLDER = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def folder_of(root: str, path: str) -> Iterator[tuple[int, str]]:
    """The descriptor of the folder that holds `path` (relative to `root`) and the last name of `path`.

    Raises:
        OSError: a folder on the way is missing, or is a symlink or no folder (ELOOP, ENOTDIR).
    """
    *folders, name = path.split("/")
    fd = os.open(root, _FOLDER)
    try:
        for folder in folders:
            inner = os.open(folder, _FOLDER, dir_fd=fd)
            os.close(fd)
            fd = inner
        yield fd, name
    finally:
        os.close(fd)


def read_file(root: str, path: str) -> tuple[os.stat_result, bytes] | None:
    """The stat (taken before the read) and bytes of the regular file at `path`; None when it is no regular file.

    Raises:
        OSError: it cannot be opened: missing, a symlink on the way, or no permission.
    """
    with folder_of(root, path) as (parent, name):
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=parent)
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None  # a fifo or a device: not a file of a tree (O_NONBLOCK kept the open from waiting on it)
        return st, file.read()


def read_link(root: str, path: str) -> bytes:
    """The target of the symlink at `path`, as bytes.

    Raises:
        OSError: it is missing or no symlink (EINVAL), or a folder on the way is a symlink.
    """
    with folder_of(root, path) as (parent, name):
        return os.readlink(os.fsencode(name), dir_fd=parent)


def write_fully(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]

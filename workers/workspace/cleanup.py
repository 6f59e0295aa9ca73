"""Remove a run's folder when the run ends, and measure the disk a folder takes (for the workspace metrics).

A run's commands may leave folders read-only or nested deeper than a path can name; removal copes with both,
never follows a symlink, and never recurses on Python's stack.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from workers.errors import WorkspaceError

_FOLDER: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: Path) -> None:
    """Remove a run's folder, even where a command made parts of it read-only or nested folders deeper than any
    path can name; nothing outside it (a symlink is removed, never followed). A folder already gone is fine.

    Raises:
        WorkspaceError: something in it cannot be removed even so.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    try:
        if stat.S_ISDIR(mode):
            _remove_folder(os.path.abspath(path))
        else:
            os.unlink(path)
    except OSError as exc:
        raise WorkspaceError(f"workspace {path}: cannot be removed: {exc}; remove it by hand", cause=exc) from exc


def _remove_folder(root: str) -> None:
    """Remove `root` folder by folder, relative to one open folder at a time: any depth, any path length, each
    folder made writable first (the run is over); going up checks each parent is the folder it came from.
    (shutil.rmtree recurses, so a command could make a tree it cannot remove, and stops at a read-only folder.)"""
    os.chmod(root, 0o700)
    fd = os.open(root, _FOLDER)
    down: list[tuple[str, int, int]] = []  # the folders walked into: name, and its parent's device and inode
    try:
        while True:
            child = _empty_files(fd)
            if child is not None:
                with contextlib.suppress(OSError):
                    os.chmod(child, 0o700, dir_fd=fd)
                parent = os.fstat(fd)
                fd, previous = os.open(child, _FOLDER, dir_fd=fd), fd
                os.close(previous)
                down.append((child, parent.st_dev, parent.st_ino))
                continue
            if not down:
                break
            name, device, inode = down.pop()
            fd, previous = os.open("..", _FOLDER, dir_fd=fd), fd
            os.close(previous)
            found = os.fstat(fd)
            if (found.st_dev, found.st_ino) != (device, inode):
                raise OSError(f"a folder of {root} was moved while it was removed")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(root)


def _empty_files(fd: int) -> str | None:
    """Remove the files and symlinks of the open folder `fd` until a folder is found; its name, or None."""
    with os.scandir(fd) as found:
        for item in found:
            if item.is_dir(follow_symlinks=False):
                return item.name
            with contextlib.suppress(FileNotFoundError):  # gone meanwhile (another remover): as good as removed
                os.unlink(item.name, dir_fd=fd)
    return None


def _folders_under(root: str) -> Iterator[str]:
    """`root` and every folder under it that a path can name, symlinks not followed (no recursion: a command
    can nest folders deeper than Python's stack)."""
    pending = [root]
    while pending:
        folder = pending.pop()
        yield folder
        with contextlib.suppress(OSError), os.scandir(folder) as found:
            pending.extend(item.path for item in found if item.is_dir(follow_symlinks=False))


def disk_usage(path: Path) -> int:
    """The bytes of disk the tree at `path` takes (its blocks; symlinks are not followed)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(info.st_mode):
        return info.st_blocks * 512
    total = 0
    for folder in _folders_under(str(path)):
        with contextlib.suppress(OSError):
            total += os.lstat(folder).st_blocks * 512
        with contextlib.suppress(OSError), os.scandir(folder) as found:
            for item in found:
                if not item.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        total += item.stat(follow_symlinks=False).st_blocks * 512
    return total

"""Linux inotify through libc (ctypes): one instance, watches on folders, and its queued events read without blocking.

The standard library has no inotify binding, and the tracker needs only four calls: `inotify_init1`,
`inotify_add_watch`, `inotify_rm_watch` and `read`. Each `Inotify` owns its descriptor, so trackers in
threads of one worker share nothing. A machine without inotify (another kernel, no libc symbol, the
per-user instance limit reached) raises `InotifyUnavailable`, and the caller falls back to rescans.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from dataclasses import dataclass
from typing import Final

IN_MODIFY: Final = 0x2
IN_ATTRIB: Final = 0x4
IN_CLOSE_WRITE: Final = 0x8
IN_MOVED_FROM: Final = 0x40
IN_MOVED_TO: Final = 0x80
IN_CREATE: Final = 0x100
IN_DELETE: Final = 0x200
IN_DELETE_SELF: Final = 0x400
IN_MOVE_SELF: Final = 0x800
IN_UNMOUNT: Final = 0x2000
IN_Q_OVERFLOW: Final = 0x4000
IN_IGNORED: Final = 0x8000
IN_ONLYDIR: Final = 0x01000000
IN_DONT_FOLLOW: Final = 0x02000000
IN_EXCL_UNLINK: Final = 0x04000000
IN_ISDIR: Final = 0x40000000

# what a folder's watch asks for: every change to a name in it, and its own removal or move
WATCH_MASK: Final = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_CREATE
    | IN_DELETE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR  # a folder replaced by a file between listing and watching is not watched
    | IN_DONT_FOLLOW  # nor a symlink: the tree's links are never followed
    | IN_EXCL_UNLINK  # no events from files already removed but still open
)
_EVENT: Final = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)
_READ_SIZE: Final = 256 * 1024


class InotifyUnavailable(OSError):
    """This process cannot use inotify (no such call, or the instance or watch limit is reached)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One queued event: the watch it came from, its mask, and the name in the watched folder (b"" for itself)."""

    wd: int
    mask: int
    name: bytes


@functools.cache
def _libc() -> ctypes.CDLL:
    # the symbols of the running process, libc's among them; cached once (a read-only handle, no state of ours)
    return ctypes.CDLL(None, use_errno=True)


class Inotify:
    """One inotify instance (non-blocking, close-on-exec) and its watches."""

    def __init__(self) -> None:
        try:
            init1 = _libc().inotify_init1
        except (AttributeError, OSError) as exc:
            raise InotifyUnavailable(errno.ENOSYS, f"inotify is not available in this libc: {exc}") from exc
        fd = int(init1(ctypes.c_int(os.O_NONBLOCK | os.O_CLOEXEC)))
        if fd < 0:
            code = ctypes.get_errno()
            raise InotifyUnavailable(code, f"inotify_init1 failed: {os.strerror(code)}")
        self.fd: int | None = fd

    def add_watch(self, path: bytes) -> int:
        """The watch descriptor of the folder at `path` (the same one if the folder is already watched).

        Raises:
            InotifyUnavailable: the per-user watch limit is reached (ENOSPC) or the kernel is out of memory.
            OSError: the folder is gone or is no folder (ENOENT, ENOTDIR): nothing to watch.
        """
        if self.fd is None:
            raise InotifyUnavailable(errno.EBADF, "inotify instance is closed")
        wd = int(_libc().inotify_add_watch(ctypes.c_int(self.fd), ctypes.c_char_p(path), ctypes.c_uint32(WATCH_MASK)))
        if wd < 0:
            code = ctypes.get_errno()
            if code in (errno.ENOSPC, errno.ENOMEM):
                raise InotifyUnavailable(code, f"inotify watch limit reached at {os.fsdecode(path)!r}")
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        return wd

    def rm_watch(self, wd: int) -> None:
        """Stop watching `wd`; a watch the kernel already dropped (its folder is gone) is no error."""
        if self.fd is not None:
            _libc().inotify_rm_watch(ctypes.c_int(self.fd), ctypes.c_int(wd))

    def read(self) -> list[Event]:
        """Every event queued now, in order; empty when there is none (never blocks)."""
        events: list[Event] = []
        while self.fd is not None:
            try:
                data = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                break
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                events.append(Event(wd, mask, data[start : start + length].rstrip(b"\0")))
                offset = start + length
        return events

    def close(self) -> None:
        """Close the instance (its watches go with it); closing twice is harmless."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

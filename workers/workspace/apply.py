"""Apply a fork's changes to a folder (the parent's tree), all or nothing.

A change applies when the target's file is still the one the fork started from: same kind (file or
symlink), same executable bit, same bytes (a symlink's bytes are its target), or absent where the base had
none. A target file that already is the fork's version counts as applied. Anything else is a conflict, and
one conflict means nothing is written: every file is checked before the first write.

Writing keeps the tree whole at every step that can fail: every new file is first staged beside its
destination (same folder, a fresh name opened with O_EXCL, its mode set), then each file replaced or removed
is moved aside into one backup folder at the target's top, folders left empty are removed, and the staged
files are renamed into place. A failure midway undoes every step taken, in reverse; the backups are deleted
only at the end. (A process killed midway leaves them in `.forkq-apply-*` at the target's top: the replaced
and removed files, numbered, for a person to restore.)

Nothing is ever reached through a symlink inside the target: every path is opened from a descriptor of the
target one component at a time with O_NOFOLLOW, so a folder of the tree that is a symlink (to anywhere) is a
conflict, never a way out. No path with a `.git` component is written, as git itself refuses (a hook there
would run the fork's code in the parent's repository).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from workers.errors import ApplyConflict, WorkspaceError
from workers.workspace.beneath import write_fully
from workers.workspace.manifest import Entry, Manifest, Mode, check_path
from workers.workspace.patch import Read, changed_files

FOLDER: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # to open things from
LISTED: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # to list (an O_PATH one cannot)
BACKUP_PREFIX: Final = ".forkq-apply-"
HASH_CHUNK: Final = 1 << 20


class Kind(enum.Enum):
    """What a path of the target is."""

    ABSENT = "absent"
    FILE = "file"
    SYMLINK = "symlink"
    FOLDER = "folder"
    OTHER = "other"  # a device, FIFO or socket: never a fork's file


@dataclass(frozen=True, slots=True)
class _State:
    """A target path as found: its kind, and for a file or symlink its manifest mode and digest."""

    kind: Kind
    mode: Mode | None = None
    digest: str | None = None

    def matches(self, entry: Entry | None) -> bool:
        if entry is None:
            return self.kind is Kind.ABSENT
        return self.kind in (Kind.FILE, Kind.SYMLINK) and self.mode == entry.mode and self.digest == entry.digest

    def differs(self, path: str, base: Entry | None) -> str:
        """Why this state is not the base version, for a conflict's message."""
        if base is None:
            return f"{path}: the fork adds it, but the target has a {self.kind.value} there"
        if self.kind is Kind.ABSENT:
            return f"{path}: removed in the target since the fork started"
        if self.mode != base.mode:
            found = f"{self.kind.value}" if self.mode is None else f"mode {int(self.mode):o}"
            return f"{path}: {found} in the target, the fork started from mode {int(base.mode):o}"
        return f"{path}: changed in the target since the fork started"


class _Blocked(Exception):
    """A folder of a path cannot be entered: `reason` says why."""

    def __init__(self, prefix: str, reason: str) -> None:
        super().__init__(reason)
        self.prefix = prefix
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Step:
    """One file to change: the base entry the target holds, and the fork's entry (None: remove)."""

    path: str
    old: Entry | None
    new: Entry | None


def _split(path: str) -> tuple[list[str], str]:
    parts = path.split("/")
    return parts[:-1], parts[-1]


def _open_folder(root_fd: int, parts: list[str], *, make: Callable[[int, str], None] | None = None) -> int:
    """A descriptor of the folder `parts` beneath the root, entered without following any symlink.

    Raises:
        _Blocked: a component is a symlink, a file or something else than a folder.
        FileNotFoundError: a component is missing and `make` is None (else `make` creates it).
    """
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            try:
                child = os.open(part, FOLDER, dir_fd=fd)
            except FileNotFoundError:
                if make is None:
                    raise
                make(fd, "/".join(parts[: i + 1]))
                child = os.open(part, FOLDER, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                info = os.stat(part, dir_fd=fd, follow_symlinks=False)
                prefix = "/".join(parts[: i + 1])
                if stat.S_ISLNK(info.st_mode):
                    raise _Blocked(prefix, f"folder {prefix!r} is a symlink in the target") from exc
                raise _Blocked(prefix, f"{prefix!r} is a file in the target") from exc
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _digest_of(folder_fd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=folder_fd)
    with os.fdopen(fd, "rb") as handle:
        digest = hashlib.sha256()
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
        return digest.hexdigest()


def _state_in(folder_fd: int, name: str) -> _State:
    """The state of `name` in an opened folder."""
    try:
        info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return _State(Kind.ABSENT)
    if stat.S_ISLNK(info.st_mode):
        target = os.fsencode(os.readlink(name, dir_fd=folder_fd))
        return _State(Kind.SYMLINK, Mode.SYMLINK, hashlib.sha256(target).hexdigest())
    if stat.S_ISREG(info.st_mode):
        return _State(Kind.FILE, Mode.of(info.st_mode), _digest_of(folder_fd, name))
    return _State(Kind.FOLDER if stat.S_ISDIR(info.st_mode) else Kind.OTHER)


def _files_under(folder_fd: int, name: str, prefix: str) -> Iterator[str]:
    """Every non-folder beneath the folder `name` (symlinks not followed), as paths from the target's top."""
    fd = os.open(name, LISTED, dir_fd=folder_fd)
    try:
        for entry in sorted(os.listdir(fd)):
            if os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode & 0o170000 == stat.S_IFDIR:
                yield from _files_under(fd, entry, f"{prefix}/{entry}")
            else:
                yield f"{prefix}/{entry}"
    finally:
        os.close(fd)


def _current(root_fd: int, path: str, changed: set[str]) -> _State | str:
    """The target's state at `path`, or why it cannot be read there. A file in the way of its folder, or a folder
    in the way of the file, counts as absent when the changes name it (and all the folder holds): each of those
    paths is checked on its own."""
    folders, name = _split(path)
    try:
        fd = _open_folder(root_fd, folders)
    except FileNotFoundError:
        return _State(Kind.ABSENT)
    except _Blocked as exc:
        if exc.prefix in changed:  # the file or symlink in the way is changed too: checked, then moved aside
            return _State(Kind.ABSENT)
        return f"{path}: {exc.reason}; forkq never writes through a symlink or over a file it did not expect"
    try:
        state = _state_in(fd, name)
        if state.kind is Kind.FOLDER and all(p in changed for p in _files_under(fd, name, path)):
            return _State(Kind.ABSENT)
        return state
    finally:
        os.close(fd)


def _refuse_git_paths(paths: list[str]) -> None:
    for path in paths:
        check_path(path)
        if any(part.lower() == ".git" for part in path.split("/")):
            raise WorkspaceError(
                f"workspace path {path!r}: a fork's changes never write inside `.git`; "
                "leave it out of the changes (git refuses it too)",
                field="path",
            )


def _plan(root_fd: int, base: Manifest, changes: Mapping[str, Entry | None]) -> list[_Step]:
    """The steps that apply `changes` to the target, after checking every file.

    Raises:
        ApplyConflict: some target file is neither the base version nor the fork's; names each and why.
    """
    _refuse_git_paths(list(changes))
    paths = changed_files(changes, base)
    base_entries = base.by_path()
    changed = set(paths)
    steps: list[_Step] = []
    conflicts: dict[str, str] = {}  # path → why
    for path in paths:
        old, new = base_entries.get(path), changes[path]
        state = _current(root_fd, path, changed)
        if isinstance(state, str):
            conflicts[path] = state
        elif state.matches(new):
            continue  # already applied
        elif state.matches(old):
            steps.append(_Step(path, old, new))
        else:
            conflicts[path] = state.differs(path, old)
    if conflicts:
        listed = "\n  ".join(conflicts.values())
        raise ApplyConflict(
            f"the fork's changes do not apply: {len(conflicts)} file(s) differ from the version the fork started "
            f"from, so nothing was written:\n  {listed}\nreview them (`forkq changes`), then apply by hand or "
            "restore those files",
            paths=list(conflicts),
        )
    return steps


@dataclass
class _Transaction:
    """The writes of one apply, each with its undo, taken back in reverse when one fails."""

    root_fd: int
    read: Read
    undo: list[Callable[[], None]] = field(default_factory=list)
    staged: dict[str, tuple[str, str]] = field(default_factory=dict)  # path → (its folder, the staged name)
    backup: str | None = None
    backups: int = 0

    def make_folder(self, parent_fd: int, path: str) -> None:
        name = path.rsplit("/", 1)[-1]
        os.mkdir(name, 0o777, dir_fd=parent_fd)
        self.undo.append(functools.partial(self._at, path.rpartition("/")[0], functools.partial(_rmdir, name)))

    def _at(self, folder: str, action: Callable[[int], None]) -> None:
        fd = _open_folder(self.root_fd, folder.split("/") if folder else [])
        try:
            action(fd)
        finally:
            os.close(fd)

    def stage(self, step: _Step, *, wait: bool = True) -> bool:
        """Write the new file under a fresh name in its folder; False when a file in the way must go first."""
        assert step.new is not None
        folders, name = _split(step.path)
        try:
            fd = _open_folder(self.root_fd, folders, make=self.make_folder)
        except _Blocked:
            if wait:  # the plan found that file or symlink changed too: it is moved aside before the second try
                return False
            raise
        try:
            data = self.read(step.new.digest)
            for _ in range(100):  # a name taken meanwhile: draw another
                short = name.encode()[:200].decode("utf-8", "ignore")  # room for the suffix in NAME_MAX bytes
                temp = f".{short}.forkq-{secrets.token_hex(6)}"
                with contextlib.suppress(FileExistsError):
                    _write_new(fd, temp, step.new.mode, data)
                    break
            else:
                raise FileExistsError(errno.EEXIST, "no free name to stage the file", step.path)
        finally:
            os.close(fd)
        folder = "/".join(folders)
        self.staged[step.path] = (folder, temp)
        self.undo.append(functools.partial(self._at, folder, functools.partial(_unlink_if_there, temp)))
        return True

    def _rename(self, src: tuple[str, str], dst: tuple[str, str]) -> None:
        """Rename (folder, name) to (folder, name), each folder entered beneath the root."""
        src_fd = _open_folder(self.root_fd, src[0].split("/") if src[0] else [])
        try:
            dst_fd = _open_folder(self.root_fd, dst[0].split("/") if dst[0] else [])
            try:
                os.rename(src[1], dst[1], src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)

    def move_aside(self, path: str) -> None:
        """Move the target's file at `path` into the backup folder, to put back if a later step fails."""
        if self.backup is None:
            self.backup = f"{BACKUP_PREFIX}{secrets.token_hex(8)}"
            os.mkdir(self.backup, 0o700, dir_fd=self.root_fd)
        self.backups += 1
        here, kept = path.rpartition("/")[::2], (self.backup, str(self.backups))
        self._rename(here, kept)
        self.undo.append(functools.partial(self._rename, kept, here))

    def remove_empty_folders(self, path: str) -> None:
        """Remove the folders of `path` that its removal left empty, deepest first."""
        folders, _ = _split(path)
        while folders:
            name = folders.pop()
            parent = "/".join(folders)
            try:
                self._at(parent, functools.partial(_rmdir, name))
            except OSError:
                return  # not empty (or not ours to remove): its parents are not empty either
            self.undo.append(functools.partial(self._at, parent, functools.partial(_mkdir, name)))

    def place(self, path: str) -> None:
        """Rename the staged file of `path` into place (its old version, if any, is already aside)."""
        folder, temp = self.staged.pop(path)
        staged, final = (folder, temp), (folder, path.rpartition("/")[2])
        self._rename(staged, final)
        self.undo.append(functools.partial(self._rename, final, staged))

    def roll_back(self) -> list[str]:
        """Take back every step in reverse; the steps that could not be taken back, as messages."""
        failed = []
        for action in reversed(self.undo):
            try:
                action()
            except (OSError, _Blocked) as exc:
                failed.append(str(exc))
        self.undo.clear()
        if not failed:
            self.finish()  # every file is back: the backups are copies of nothing any more
        return failed

    def finish(self) -> None:
        """Delete the backups: the apply is done (or fully undone)."""
        if self.backup is not None:
            _remove_tree(self.root_fd, self.backup)
            self.backup = None


def _rmdir(name: str, folder_fd: int) -> None:
    os.rmdir(name, dir_fd=folder_fd)


def _mkdir(name: str, folder_fd: int) -> None:
    os.mkdir(name, 0o777, dir_fd=folder_fd)


def _write_new(folder_fd: int, name: str, mode: Mode, data: bytes) -> None:
    """Create `name` (O_EXCL) with `data` as a file of `mode` (the umask applies, as git applies it), or a symlink."""
    if mode == Mode.SYMLINK:
        os.symlink(os.fsdecode(data), name, dir_fd=folder_fd)
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o777 if mode == Mode.EXECUTABLE else 0o666, dir_fd=folder_fd)
    try:
        write_fully(fd, data)
    except BaseException:
        os.close(fd)
        os.unlink(name, dir_fd=folder_fd)
        raise
    os.close(fd)


def _unlink_if_there(name: str, folder_fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder_fd)


def _remove_tree(parent_fd: int, name: str) -> None:
    """Remove the folder `name` and all it holds, never following a symlink."""
    fd = os.open(name, LISTED, dir_fd=parent_fd)
    try:
        for entry in os.listdir(fd):
            if os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode & 0o170000 == stat.S_IFDIR:
                _remove_tree(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _write(transaction: _Transaction, steps: list[_Step]) -> None:
    """Stage, move aside, remove emptied folders, stage what waited on them, then place every new file."""
    waiting = [step for step in steps if step.new is not None and not transaction.stage(step)]
    for step in steps:
        if step.old is not None:
            transaction.move_aside(step.path)
    for step in steps:
        if step.new is None:  # a replaced file's folder holds its staged successor: never empty
            transaction.remove_empty_folders(step.path)
    for step in waiting:
        transaction.stage(step, wait=False)
    for step in steps:
        if step.new is not None:
            transaction.place(step.path)


def apply_changes(
    target: Path, base: Manifest, changes: Mapping[str, Entry | None], read: Read, *, check: bool = False
) -> list[str]:
    """Apply a fork's `changes` (made on `base`) to the folder `target`, all or nothing; the paths changed.

    With `check`, only check: nothing is written, and the paths are those that would change.

    Raises:
        ApplyConflict: a target file differs from the base version; nothing was written.
        WorkspaceError: `target` is not a folder, a path is invalid, or writing failed (and was undone).
    """
    try:
        root_fd = os.open(target, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise WorkspaceError(f"apply target {str(target)!r}: expected a folder ({exc.strerror})", cause=exc) from exc
    try:
        steps = _plan(root_fd, base, changes)
        if not check and steps:
            _commit(root_fd, steps, read, target)
        return [step.path for step in steps]
    finally:
        os.close(root_fd)


def _commit(root_fd: int, steps: list[_Step], read: Read, target: Path) -> None:
    transaction = _Transaction(root_fd, read)
    try:
        _write(transaction, steps)
    except BaseException as exc:  # whatever failed (disk, a blob that cannot be read), take every step back
        failed = transaction.roll_back()
        undone = "every step was undone" if not failed else f"undoing failed too: {'; '.join(failed)}"
        if not isinstance(exc, OSError | _Blocked):
            exc.add_note(f"apply to {str(target)!r}: {undone}")
            raise
        raise WorkspaceError(
            f"apply to {str(target)!r}: writing the fork's changes failed ({exc}); {undone}. Fix the cause "
            "(space, permissions) and apply again",
            cause=exc,
        ) from exc
    transaction.finish()

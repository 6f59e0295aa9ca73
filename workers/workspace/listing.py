"""Which files of a folder a snapshot holds: git's listing in a git work tree, else a walk minus `.forkqignore`.

In a git work tree the listing is git's: the files it tracks, and the untracked ones it does not ignore
(`git ls-files --cached --others --exclude-standard`, run in the folder, so a subfolder of a repository
lists that subfolder, with paths relative to it). At the same time `git diff-files` names the tracked
files whose stat or content differ from git's index: the others hold their index blob, and are listed by
blob id without a stat of ours (git stats them in C, in threads, and handles racy timestamps); files
marked assume-unchanged or skip-worktree are stat'ed like untracked ones. Tracked files deleted on disk
are left out, and so are submodules and nested repositories (git lists them as folders: their files are
not part of this tree).
Without git installed, the folder is walked. Elsewhere every regular file under the folder is listed,
except what a `.forkqignore` (gitignore syntax) excludes: the one at the folder's top and the ones in
its subfolders, each for the paths under its own folder, the deepest one that has a rule for a path
deciding. A `.forkqignore` applies in a git work tree too, on top of git's listing. A `.git` is never
entered.

Symlinks are listed as links and never followed; fifos, sockets and devices are left out. Every listed
path is a valid workspace path (UTF-8 included), else the listing stops with an error naming it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Final

import pathspec

from workers.errors import WorkspaceError
from workers.workspace.manifest import MAX_PATH_DEPTH, check_path

IGNORE_FILE: Final = ".forkqignore"
GIT_TIMEOUT_S: Final = 60.0
# -v -s: each tracked file with its tag (H: cached, h: assumed unchanged, S: skip-worktree, M: unmerged), mode,
# blob id and stage; "? path" for an untracked one
GIT_LS_FILES: Final = ("ls-files", "-z", "-v", "-s", "--cached", "--others", "--exclude-standard")
# the tracked files whose stat or content differ from git's index: every other "H" file holds its index blob.
# --no-optional-locks: never write the user's index (its refresh) behind their back
GIT_DIFF_FILES: Final = ("--no-optional-locks", "diff-files", "-z", "--name-only", "--relative")
TRACKED_MODES: Final = ("100644", "100755", "120000")  # not 160000: a submodule
IGNORE_FIX: Final = "leave it out with .forkqignore (or .gitignore in a git work tree)"

Specs = tuple[tuple[str, pathspec.GitIgnoreSpec], ...]  # (folder prefix ending in "/" or "", its rules)


@dataclass(frozen=True, slots=True)
class Listing:
    """The files of a snapshot: (path, lstat) of the ones stat'ed, and in a git work tree the tracked files git
    found unchanged since its index, by (path, git mode, blob id), not stat'ed (their digest may be known by blob id).
    """

    files: list[tuple[str, os.stat_result]]
    unchanged: list[tuple[str, str, str]]
    git: bool
    key: str | None = None  # GitOutput.key of git's answers (None: walked, or a git command failed)


@dataclass(frozen=True, slots=True)
class GitOutput:
    """What git's two commands answered: ls-files (output, errors, exit status), and diff-files (output, status)."""

    listing: bytes
    errors: bytes
    status: int
    changed: bytes
    changed_status: int

    @property
    def key(self) -> str | None:
        """The SHA-256 of both outputs (None if either failed): the same key, the same tracked files with the same
        blobs and modes, the same untracked ones, the same ones found changed."""
        if self.status or self.changed_status:
            return None
        return hashlib.sha256(b"%d\0" % len(self.listing) + self.listing + self.changed).hexdigest()


class GitRun:
    """git's two commands, started at once: diff-files stats every tracked file (in threads) while ls-files lists."""

    def __init__(self, root: Path, listing: subprocess.Popen[bytes]) -> None:
        self.root, self.listing = root, listing
        try:
            self.changed = subprocess.Popen(
                ["git", "-C", str(root), *GIT_DIFF_FILES], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        except BaseException:
            listing.kill()
            listing.wait()
            raise

    @classmethod
    def start(cls, root: Path) -> GitRun | None:
        """Both commands started in `root`; None when git is not installed."""
        try:
            listing = subprocess.Popen(
                ["git", "-C", str(root), *GIT_LS_FILES], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        except FileNotFoundError:
            return None
        return cls(root, listing)

    def finish(self) -> GitOutput:
        """Both outputs, once both commands ended.

        Raises:
            WorkspaceError: a command took over `GIT_TIMEOUT_S` (both are then ended).
        """
        with self.listing, self.changed:
            try:
                out, err = _communicate(self.root, self.listing)
                changed_out, _ = _communicate(self.root, self.changed)
            except WorkspaceError:
                self.listing.kill()
                self.changed.kill()
                raise
        return GitOutput(out, err, self.listing.returncode, changed_out, self.changed.returncode)


def list_files(root: Path, *, stop_after: int, git: GitOutput | None = None) -> Listing:
    """The files of `root` (absolute and resolved) a snapshot holds; a walk stops after `stop_after` files.
    `git`: git's answers in `root`, when the caller ran it (else it is run here, if installed).

    Raises:
        WorkspaceError: a path is not valid (not UTF-8, a backslash, too long), a folder cannot be read, or git
            fails in a git work tree.
    """
    if git is None:
        run = GitRun.start(root)
        git = run.finish() if run is not None else None
    listed = None if git is None else _git_listing(root, git)
    if listed is None:
        return Listing(_walk(root, stop_after), [], git=False)
    unchanged, others, any_ignore_file = listed
    if any_ignore_file:
        folders = [
            p for p in [*others, *(u[0] for u in unchanged)] if p == IGNORE_FILE or p.endswith("/" + IGNORE_FILE)
        ]
        folders = [p[: -len(IGNORE_FILE)] for p in folders]
        specs: Specs = tuple((f, _load_spec(root, f + IGNORE_FILE)) for f in sorted(folders, key=len))
        unchanged = [u for u in unchanged if not _ignored(specs, u[0])]
        others = [p for p in others if not _ignored(specs, p)]
    check_all(root, [u[0] for u in unchanged] + others)
    return Listing(stat_files(root, others), unchanged, git=True, key=None if git is None else git.key)


def _git_listing(root: Path, git: GitOutput) -> tuple[list[tuple[str, str, str]], list[str], bool] | None:
    """git's listing of `root`: the unchanged tracked files (path, mode, blob id), the other paths, and whether any
    `.forkqignore` may be among them; None when `root` is not in a git work tree."""
    if git.status != 0:
        if not any((folder / ".git").exists() for folder in (root, *root.parents)):
            return None  # not a work tree: walk it
        error = git.errors.decode("utf-8", "replace").strip()[:500]
        raise WorkspaceError(
            f"workspace {root}: `git ls-files` failed in this git work tree ({error}); "
            "fix the repository, or launch with workspace shared"
        )
    # diff-files failing is no reason to fail: every tracked file is then stat'ed and read as an untracked one
    dirty = set(git.changed.decode("utf-8", "surrogateescape").split("\0")) if git.changed_status == 0 else None
    text = git.listing.decode("utf-8", "surrogateescape")
    return (*_parse_listing(text, dirty), IGNORE_FILE in text)


def _communicate(root: Path, proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    try:
        return proc.communicate(timeout=GIT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        raise WorkspaceError(
            f"workspace {root}: git took over {GIT_TIMEOUT_S:.0f} s to list the files; "
            "make the repository smaller, or launch with workspace shared",
            cause=exc,
        ) from exc


def _parse_listing(text: str, dirty: set[str] | None) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(unchanged tracked files as (path, mode, blob id), the other paths) from `git ls-files -v -s` output."""
    unchanged: list[tuple[str, str, str]] = []
    others: dict[str, None] = {}  # an unmerged path is listed once per stage: keep it once
    for record in text.split("\0"):
        if record[:2] == "? ":
            if not record.endswith("/"):  # a nested repository: not this tree's files
                others[record[2:]] = None
            continue
        meta, _, path = record.partition("\t")  # "H 100644 <blob id> 0", tab, path
        mode = meta[2:8]
        if not path or mode not in TRACKED_MODES:
            continue  # the trailing empty record, or a submodule
        if meta[0] == "H" and meta[-2:] == " 0" and dirty is not None and path not in dirty:
            unchanged.append((path, mode, meta[9:-2]))
        else:
            others[path] = None
    return unchanged, list(others)


def stat_files(root: Path, paths: list[str]) -> list[tuple[str, os.stat_result]]:
    """(path, lstat) of each path that is a regular file or a symlink (gone ones and folders left out)."""
    prefix = str(root) + "/"
    lstat, is_reg, is_lnk = os.lstat, stat.S_ISREG, stat.S_ISLNK
    found: list[tuple[str, os.stat_result]] = []
    for rel in paths:
        try:
            st = lstat(prefix + rel)
        except (FileNotFoundError, NotADirectoryError):
            continue  # tracked but deleted on disk, or removed since git listed it
        except PermissionError as exc:
            raise _unreadable(root, rel, exc) from exc
        if is_reg(st.st_mode) or is_lnk(st.st_mode):
            found.append((rel, st))
    return found


def check_all(root: Path, paths: list[str]) -> None:
    """Refuse the first path of `paths` that is not a valid workspace path (tested all at once when all are)."""
    joined = "\0".join(paths)
    try:
        joined.encode("utf-8")
        valid = (
            "\\" not in joined
            and max(map(len, paths), default=0) <= 1000
            and max(map(str.count, paths, repeat("/")), default=0) < MAX_PATH_DEPTH
        )
    except UnicodeEncodeError:
        valid = False
    if not valid:
        for rel in paths:
            _check(root, rel)


def _check(root: Path, rel: str) -> None:
    """Refuse a path that is not a valid workspace path (the fast test passes nearly every path)."""
    if len(rel) <= 1000 and "\\" not in rel and rel.count("/") < MAX_PATH_DEPTH:
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:
            raise _not_utf8(root, os.fsencode(rel)) from None
        return
    try:
        check_path(rel)
    except WorkspaceError as exc:
        raise WorkspaceError(f"workspace {root}: {exc}; rename it, or {IGNORE_FIX}", field="path") from exc


def _not_utf8(root: Path, raw: bytes) -> WorkspaceError:
    return WorkspaceError(
        f"workspace {root}: the name of {raw!r} is not valid UTF-8, and workspace paths are UTF-8; "
        f"rename it, or {IGNORE_FIX}",
        field="path",
    )


def _unreadable(root: Path, rel: str, exc: OSError) -> WorkspaceError:
    return WorkspaceError(
        f"workspace {root}: {rel or '.'} cannot be read ({exc.strerror}); make it readable, or {IGNORE_FIX}",
        field="path",
        cause=exc,
    )


def _load_spec(root: Path, rel: str) -> pathspec.GitIgnoreSpec:
    """The rules of the `.forkqignore` at `rel`: none if it is gone or not a regular file (a link is not followed)."""
    try:
        fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return pathspec.GitIgnoreSpec.from_lines([])  # tracked, but deleted on disk
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return pathspec.GitIgnoreSpec.from_lines([])
        raise _unreadable(root, rel, exc) from exc
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return pathspec.GitIgnoreSpec.from_lines([])
        lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _ignored(specs: Specs, rel: str) -> bool:
    """Whether the deepest `.forkqignore` with a rule for `rel` (a folder ends in "/") excludes it."""
    for prefix, spec in reversed(specs):
        if rel.startswith(prefix):
            include = spec.check_file(rel[len(prefix) :]).include
            if include is not None:
                return include
    return False


def _walk(root: Path, stop_after: int) -> list[tuple[str, os.stat_result]]:
    """Every regular file and symlink under `root` that no `.forkqignore` excludes, `.git` never entered."""
    found: list[tuple[str, os.stat_result]] = []
    stack: list[tuple[str, Specs]] = [("", ())]
    is_reg, is_lnk = stat.S_ISREG, stat.S_ISLNK
    while stack and len(found) <= stop_after:
        folder, specs = stack.pop()
        try:
            with os.scandir(root / folder if folder else root) as it:
                entries = list(it)
        except OSError as exc:
            raise _unreadable(root, folder.rstrip("/"), exc) from exc
        if any(e.name == IGNORE_FILE and e.is_file(follow_symlinks=False) for e in entries):
            specs = (*specs, (folder, _load_spec(root, folder + IGNORE_FILE)))
        for entry in entries:
            rel, is_dir = folder + entry.name, entry.is_dir(follow_symlinks=False)
            if entry.name == ".git" or (specs and _ignored(specs, rel + "/" if is_dir else rel)):
                continue
            if is_dir:
                stack.append((rel + "/", specs))
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while the folder was read
            if is_reg(st.st_mode) or is_lnk(st.st_mode):
                _check(root, rel)
                found.append((rel, st))
    return found

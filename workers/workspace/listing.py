"""Which files of a folder a snapshot holds: git's listing in a git work tree, else a walk minus `.forkqignore`.

In a git work tree the listing is git's: the files it tracks, and the untracked ones it does not ignore
(`git ls-files --cached --others --exclude-standard`, run in the folder, so a subfolder of a repository
lists that subfolder, with paths relative to it). Tracked files deleted on disk are left out, and so are
submodules and nested repositories (git lists them as folders: their files are not part of this tree).
Without git installed, the folder is walked. Elsewhere every regular file under the folder is listed,
except what a `.forkqignore` (gitignore syntax) excludes: the one at the folder's top and the ones in
its subfolders, each for the paths under its own folder, the deepest one that has a rule for a path
deciding. A `.forkqignore` applies in a git work tree too, on top of git's listing. A `.git` is never
entered.

Symlinks are listed as links and never followed; fifos, sockets and devices are left out. Every listed
path is a valid workspace path (UTF-8 included), else the listing stops with an error naming it.
"""

from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pathspec

from workers.errors import WorkspaceError
from workers.workspace.manifest import MAX_PATH_DEPTH, check_path

IGNORE_FILE: Final = ".forkqignore"
GIT_TIMEOUT_S: Final = 60.0
GIT_LS_FILES: Final = ("ls-files", "-z", "--cached", "--others", "--exclude-standard")
IGNORE_FIX: Final = "leave it out with .forkqignore (or .gitignore in a git work tree)"

Specs = tuple[tuple[str, pathspec.GitIgnoreSpec], ...]  # (folder prefix ending in "/" or "", its rules)


@dataclass(frozen=True, slots=True)
class Listing:
    """The files of a snapshot: (path, lstat) of every regular file and symlink, and whether git listed them."""

    files: list[tuple[str, os.stat_result]]
    git: bool


def list_files(root: Path, *, stop_after: int) -> Listing:
    """The files of `root` (absolute and resolved) a snapshot holds; a walk stops after `stop_after` files.

    Raises:
        WorkspaceError: a path is not valid (not UTF-8, a backslash, too long), a folder cannot be read, or git
            fails in a git work tree.
    """
    listed = _git_paths(root)
    if listed is None:
        return Listing(_walk(root, stop_after), git=False)
    return Listing(_stat_all(root, _apply_ignore_files(root, listed)), git=True)


def _git_paths(root: Path) -> list[str] | None:
    """git's listing of `root`, or None when `root` is not in a git work tree or git is not installed."""
    command = ["git", "-C", str(root), *GIT_LS_FILES]
    try:
        proc = subprocess.run(command, capture_output=True, timeout=GIT_TIMEOUT_S, check=False)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired as exc:
        raise WorkspaceError(
            f"workspace {root}: `git ls-files` took over {GIT_TIMEOUT_S:.0f} s; "
            "make the repository smaller, or launch with workspace shared",
            cause=exc,
        ) from exc
    if proc.returncode != 0:
        if not any((folder / ".git").exists() for folder in (root, *root.parents)):
            return None  # not a work tree: walk it
        error = proc.stderr.decode("utf-8", "replace").strip()[:500]
        raise WorkspaceError(
            f"workspace {root}: `git ls-files` failed in this git work tree ({error}); "
            "fix the repository, or launch with workspace shared"
        )
    # an unmerged path is listed once per stage; a nested repository ends in "/": not this tree's files.
    # A name that is not UTF-8 is refused only if no .forkqignore leaves it out (see _check)
    return [
        raw.decode("utf-8", "surrogateescape")
        for raw in dict.fromkeys(proc.stdout.split(b"\0"))
        if raw and not raw.endswith(b"/")
    ]


def _stat_all(root: Path, paths: list[str]) -> list[tuple[str, os.stat_result]]:
    """(path, lstat) of each listed path that is a regular file or a symlink (gone ones and folders left out)."""
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
            _check(root, rel)
            found.append((rel, st))
    return found


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
    try:
        lines = (root / rel).read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    except OSError as exc:
        raise _unreadable(root, rel, exc) from exc
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _ignored(specs: Specs, rel: str) -> bool:
    """Whether the deepest `.forkqignore` with a rule for `rel` (a folder ends in "/") excludes it."""
    for prefix, spec in reversed(specs):
        if rel.startswith(prefix):
            include = spec.check_file(rel[len(prefix) :]).include
            if include is not None:
                return include
    return False


def _apply_ignore_files(root: Path, paths: list[str]) -> list[str]:
    """git's listing minus what the listed `.forkqignore` files exclude."""
    folders = sorted(
        (p[: -len(IGNORE_FILE)] for p in paths if p == IGNORE_FILE or p.endswith("/" + IGNORE_FILE)), key=len
    )
    if not folders:
        return paths
    specs: Specs = tuple((folder, _load_spec(root, folder + IGNORE_FILE)) for folder in folders)
    return [p for p in paths if not _ignored(specs, p)]


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

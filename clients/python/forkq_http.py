"""A parent that only speaks HTTP: upload a folder as a forkq workspace, launch a fork with it, read its changes.

Standard library only (copy this one file beside your agent). The upload is a git push's: the manifest
(path, mode, size and SHA-256 of every file) goes first, the server answers with the blobs it lacks, only
those are sent, and the manifest is offered again to be stored. A second upload of the same tree sends
no file. What is uploaded:

- in a git work tree, the files git lists as tracked, or untracked and not ignored
  (`git ls-files -z --cached --others --exclude-standard`);
- elsewhere, every regular file, minus what `.forkqignore` excludes (a subset of gitignore's syntax:
  `#` comments, `!` negation, a trailing `/` for folders, a `/` anchoring to the root, `*`, `?`, `**`, `[...]`);
- symlinks as links (their blob is the target, never followed), executable bits kept.

    from forkq_http import upload_workspace, launch, changes
    manifest, uploaded = upload_workspace("http://127.0.0.1:8700", token, "/src/app")
    fork = launch("http://127.0.0.1:8700", token, parent, agent, workspace_manifest=manifest)
    print(changes("http://127.0.0.1:8700", token, fork["fork_id"]))
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE, EXECUTABLE, SYMLINK = 0o100644, 0o100755, 0o120000
UPLOADS_AT_ONCE = 8
TIMEOUT_S = 60.0
CHUNK = 1 << 20


class ForkqHttpError(Exception):
    """A request forkq refused (`status`, `field` from its error body), or a file that could not be read."""

    def __init__(self, message: str, status: int = 0, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


@dataclass(frozen=True)
class FileEntry:
    """One file of the tree: its path (relative, `/`-separated), git mode, size and SHA-256."""

    path: str
    mode: int
    size: int
    digest: str
    source: Path

    def json(self) -> dict[str, Any]:
        """The entry as the API takes it."""
        return {"path": self.path, "mode": self.mode, "size": self.size, "digest": self.digest}


# ── the tree ──────────────────────────────────────────────────────────────────────────────────


def _in_git(folder: Path) -> bool:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--is-inside-work-tree"],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:  # no git on this machine: the folder is walked instead
        return False
    return done.returncode == 0 and done.stdout.strip() == "true"


def _git_files(folder: Path) -> list[str]:
    argv = ["git", "-C", str(folder), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    done = subprocess.run(argv, capture_output=True, check=False)
    if done.returncode != 0:
        raise ForkqHttpError(f"git ls-files in {folder} failed: {done.stderr.decode(errors='replace').strip()}")
    return sorted({os.fsdecode(p) for p in done.stdout.split(b"\0") if p})


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A gitignore glob as a regex over a `/`-separated path."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out.append(f"[{'^' + body[1:] if body.startswith('!') else body}]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern[str]
    negate: bool
    folders_only: bool
    anchored: bool


class IgnoreRules:
    """`.forkqignore` patterns (a subset of gitignore): the last matching rule decides."""

    def __init__(self, text: str) -> None:
        self.rules: list[_Rule] = []
        for raw in text.splitlines():
            line = raw.rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:] if negate else line
            folders_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            self.rules.append(_Rule(_pattern_regex(line.lstrip("/")), negate, folders_only, anchored))

    def ignored(self, path: str, is_folder: bool) -> bool:
        """Whether `path` (relative, `/`-separated) is excluded."""
        verdict = False
        for rule in self.rules:
            if rule.folders_only and not is_folder:
                continue
            target = path if rule.anchored else path.rsplit("/", 1)[-1]
            if rule.regex.fullmatch(target):
                verdict = not rule.negate
        return verdict


def _walked_files(folder: Path) -> list[str]:
    ignore_file = folder / ".forkqignore"
    rules = IgnoreRules(ignore_file.read_text(encoding="utf-8") if ignore_file.is_file() else "")
    found: list[str] = []
    for root, dirs, files in os.walk(folder):  # never follows a symlinked folder: it is listed as a link
        rel = Path(root).relative_to(folder).as_posix()
        prefix = "" if rel == "." else f"{rel}/"
        links = [d for d in dirs if (Path(root) / d).is_symlink()]
        dirs[:] = sorted(d for d in dirs if d not in links and d != ".git" and not rules.ignored(prefix + d, True))
        found += [prefix + name for name in [*files, *links] if not rules.ignored(prefix + name, False)]
    return sorted(found)


def _entry(folder: Path, rel: str) -> FileEntry | None:
    path = folder / rel
    try:
        info = path.lstat()
    except FileNotFoundError:  # deleted but still in git's index
        return None
    if stat.S_ISLNK(info.st_mode):
        data = os.fsencode(os.readlink(path))
        return FileEntry(rel, SYMLINK, len(data), hashlib.sha256(data).hexdigest(), path)
    if not stat.S_ISREG(info.st_mode):  # a submodule, a socket, a FIFO: not a file of the tree
        return None
    digest, size = _hash_file(path)
    return FileEntry(rel, EXECUTABLE if info.st_mode & 0o111 else FILE, size, digest, path)


def _hash_file(path: Path) -> tuple[str, int]:
    sha, size = hashlib.sha256(), 0
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


def tree_entries(folder: str | os.PathLike[str]) -> list[FileEntry]:
    """The files of `folder` a workspace holds (see the module's docstring), hashed."""
    root = Path(folder).resolve()
    if not root.is_dir():
        raise ForkqHttpError(f"workspace folder {root} is not a folder; pass the parent's working directory")
    names = _git_files(root) if _in_git(root) else _walked_files(root)
    with ThreadPoolExecutor(UPLOADS_AT_ONCE) as pool:
        entries = list(pool.map(lambda rel: _entry(root, rel), names))
    return [e for e in entries if e is not None]


# ── the API ───────────────────────────────────────────────────────────────────────────────────


def _request(
    base_url: str,
    token: str | None,
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    content_type: str = "",
    accept: str = "application/json",
) -> tuple[int, bytes, str]:
    headers = {"Accept": accept}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if content_type:
        headers["Content-Type"] = content_type
    request = urllib.request.Request(base_url.rstrip("/") + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        raise _api_error(method, path, exc.code, exc.read()) from exc
    except urllib.error.URLError as exc:
        raise ForkqHttpError(f"{method} {path}: {exc.reason}; is forkq serve running at {base_url}?") from exc


def _api_error(method: str, path: str, status: int, body: bytes) -> ForkqHttpError:
    try:
        detail = json.loads(body)["error"]
        return ForkqHttpError(str(detail["message"]), status, detail.get("field"))
    except (ValueError, KeyError, TypeError):
        return ForkqHttpError(f"{method} {path}: HTTP {status} ({body[:300]!r}); is the URL forkq serve's?", status)


def _json(base_url: str, token: str | None, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    content_type = "application/json" if data is not None else ""
    _, answer, _ = _request(base_url, token, method, path, body=data, content_type=content_type)
    return json.loads(answer)


def _upload(base_url: str, token: str | None, entry: FileEntry) -> None:
    data = os.fsencode(os.readlink(entry.source)) if entry.mode == SYMLINK else entry.source.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry.digest:
        raise ForkqHttpError(f"{entry.source} changed while it was uploaded; upload the folder again")
    path = f"/v1/workspaces/blobs/{entry.digest}"
    _request(base_url, token, "PUT", path, body=data, content_type="application/octet-stream")


def upload_workspace(base_url: str, token: str | None, folder: str | os.PathLike[str]) -> tuple[str, int]:
    """Upload `folder` as a workspace: `(manifest digest, blobs uploaded)`; 0 uploaded when the server has it all.

    Raises:
        ForkqHttpError: the server refused (a tree over its bounds: 422 naming the largest folders), or a file
            changed while it was read.
    """
    entries = tree_entries(folder)
    offer = {"entries": [e.json() for e in entries]}
    answer = _json(base_url, token, "POST", "/v1/workspaces", offer)
    missing = set(answer["missing"])
    if not missing:
        return str(answer["manifest"]), 0
    by_digest = {e.digest: e for e in entries if e.digest in missing}
    with ThreadPoolExecutor(UPLOADS_AT_ONCE) as pool:
        list(pool.map(lambda e: _upload(base_url, token, e), by_digest.values()))
    stored = _json(base_url, token, "POST", "/v1/workspaces", offer)
    if stored["missing"]:
        raise ForkqHttpError(f"the server still lacks {len(stored['missing'])} blobs after the upload; upload again")
    return str(stored["manifest"]), len(by_digest)


def launch(
    base_url: str,
    token: str | None,
    parent: dict[str, Any],
    agent: dict[str, Any],
    *,
    workspace: str | None = None,
    workspace_manifest: str | None = None,
    network: bool | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Launch a fork (`POST /v1/forks`) with the launch `options` and a workspace; `{"fork_id", "status"}`."""
    extra = {"workspace": workspace, "workspace_manifest": workspace_manifest, "network": network}
    given = {**options, **{name: value for name, value in extra.items() if value is not None}}
    body = {"parent": parent, "agent": agent, "options": given}
    result: dict[str, Any] = _json(base_url, token, "POST", "/v1/forks", body)
    return result


def changes(base_url: str, token: str | None, fork_id: str, *, stat_only: bool = False) -> dict[str, Any]:
    """A fork's changes: `{"files": [...], "patch": "..."}` (`patch` None with `stat_only`)."""
    query = "?stat=1" if stat_only else ""
    result: dict[str, Any] = _json(base_url, token, "GET", f"/v1/forks/{fork_id}/changes{query}")
    return result


def patch(base_url: str, token: str | None, fork_id: str) -> bytes:
    """A fork's changes as the exact bytes of a git patch (`git apply` takes them)."""
    _, data, _ = _request(base_url, token, "GET", f"/v1/forks/{fork_id}/changes", accept="text/x-diff")
    return data

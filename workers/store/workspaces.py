"""A fork's workspace from the launcher's side: the snapshot a launch stores, and the changes a fork hands back.

A launch of a `snapshot` fork lists and hashes the parent's `cwd` (`workers.workspace.snapshot`), stores the
blobs Redis lacks and then the manifest (`workers.store.blobs`), and names the manifest in the bootstrap
record. A launch through `forkq serve` never reads the server's disk: its files come from an upload (the
manifest named by `workspace_manifest`), else its workspace starts empty.

A fork's changes are its journal's: the fold's `changes` over the base manifest, rendered as a git patch
(`workers.workspace.patch`) or applied to a folder, all or nothing (`workers.workspace.apply`).
"""

from __future__ import annotations

import functools
import logging
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker_config.settings import Settings
from workers.errors import InvalidAgentParams, WorkspaceError
from workers.records.conversation import fold
from workers.records.fork import BootstrapRecord
from workers.store.blobs import BlobStore, BlobStream
from workers.store.forks import ForkStore
from workers.workspace.manifest import EMPTY, Changes, Manifest
from workers.workspace.ref import WorkspaceMode, WorkspaceRef

log = logging.getLogger("forkq.workspace")


def shared_roots(settings: Settings) -> list[str]:
    """FORKQ_SHARED_ROOTS as normalized absolute paths (empty: not set)."""
    raw = settings.shared_roots or ""
    return [posixpath.normpath(r.strip()) for r in raw.split(",") if r.strip()]


def check_shared_root(cwd: str, settings: Settings) -> None:
    """A `shared` fork's cwd lies under one of FORKQ_SHARED_ROOTS, when that is set.

    Raises:
        InvalidAgentParams: it does not.
    """
    roots = shared_roots(settings)
    if not roots:
        return
    path = posixpath.normpath(cwd) if posixpath.isabs(cwd) else None
    if path is not None and any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots):
        return
    raise InvalidAgentParams(
        f"workspace shared: the parent's cwd {cwd!r} is not under FORKQ_SHARED_ROOTS ({', '.join(roots)}); a shared "
        "fork's tools act on that folder in place on every worker. Launch with workspace snapshot, or move the "
        "parent under one of those folders",
        field="workspace",
    )


@dataclass(frozen=True, slots=True)
class WorkspaceLaunch:
    """What a launch asks of the fork's files."""

    mode: WorkspaceMode | None  # None: FORKQ_WORKSPACE
    manifest: str | None = None  # an uploaded manifest's digest
    network: bool = True
    read_files: bool = True  # False through `forkq serve`: never read the server's own disk


def launch_workspace(cwd: str, asked: WorkspaceLaunch, *, settings: Settings, blobs: BlobStore) -> WorkspaceRef:
    """The record's workspace for a launch from a parent at `cwd`: its snapshot stored first.

    Raises:
        InvalidAgentParams: a shared cwd outside FORKQ_SHARED_ROOTS, an unknown uploaded manifest, or a snapshot
            asked for explicitly of a folder this machine does not have.
        WorkspaceTooLarge: the tree is over FORKQ_WORKSPACE_MAX_BYTES or _MAX_FILES.
        WorkspaceError: the tree cannot be read (a file changed while it was read, a name that is not UTF-8).
    """
    mode = asked.mode or WorkspaceMode(settings.workspace)
    if mode is WorkspaceMode.SHARED:
        check_shared_root(cwd, settings)
        return WorkspaceRef(mode=mode, root=cwd, scope=blobs.scope, network=asked.network)
    if asked.manifest is not None:
        if not blobs.has_manifest(asked.manifest):
            raise InvalidAgentParams(
                f"workspace manifest {asked.manifest} is not stored (never uploaded, or expired with its forks' "
                "records): upload the workspace first, then launch; over HTTP, upload it first with POST "
                "/v1/workspaces, PUT each missing blob, then POST /v1/workspaces again",
                field="workspace_manifest",
            )
        return WorkspaceRef(mode=mode, manifest=asked.manifest, root=cwd, scope=blobs.scope, network=asked.network)
    folder = Path(cwd)
    if not asked.read_files or not folder.is_absolute() or not folder.is_dir():
        if asked.read_files and asked.mode is WorkspaceMode.SNAPSHOT:
            raise InvalidAgentParams(
                f"workspace snapshot: the parent's cwd {cwd!r} is not a folder on this machine, so there is nothing "
                "to snapshot; launch from the parent's machine, upload the tree through `forkq serve`, or use "
                "workspace shared",
                field="workspace",
            )
        log.info("workspace: %r is not a folder here; the fork starts with an empty workspace", cwd)
        return WorkspaceRef(mode=mode, root=cwd, scope=blobs.scope, network=asked.network)
    manifest, git = store_snapshot(folder, settings=settings, blobs=blobs)
    return WorkspaceRef(mode=mode, manifest=manifest, root=cwd, scope=blobs.scope, network=asked.network, git=git)


def snapshot_cache_dir() -> Path | None:
    """Where a launcher keeps what it knows of its trees' files (size, times → digest), across processes."""
    home = Path.home()
    return home / ".cache" / "forkq" / "snapshots" if home.is_dir() else None


def store_snapshot(folder: Path, *, settings: Settings, blobs: BlobStore) -> tuple[str, bool]:
    """Snapshot `folder` and store what Redis lacks: the manifest's digest, and whether it came from git.

    The files the snapshot reads (a first launch's, or edited ones) are stored batch by batch while it reads the
    next ones; the rest (known by stat or blob id) only when the manifest is not stored yet.
    """
    from workers.workspace.snapshot import snapshot  # noqa: PLC0415  (snapshot launches only)

    with BlobStream(blobs) as upload:
        snap = snapshot(
            folder,
            max_bytes=settings.workspace_max_bytes,
            max_files=settings.workspace_max_files,
            cache_dir=snapshot_cache_dir(),
            on_read=upload.add,
        )
    digest = snap.digest
    if blobs.manifest_fresh(digest):  # stored (so are its blobs), and not yet due for renewal: nothing to send
        return digest, snap.git
    if blobs.has_manifest(digest):  # a manifest is stored only after its blobs: nothing to send
        blobs.put_manifest(snap.manifest, snap.encoded)  # renews it (and its blobs) when it is getting old
        return digest, snap.git
    for batch in _batches(blobs.missing(snap.manifest.digests() - upload.stored)):
        blobs.put({d: snap.read(d) for d in batch}, verified=True)  # Snapshot.read checks them against the digest
    return blobs.put_manifest(snap.manifest, snap.encoded), snap.git


def _batches(digests: list[str], size: int = 256) -> list[list[str]]:
    return [digests[i : i + size] for i in range(0, len(digests), size)]


@dataclass(frozen=True)  # functools.cached_property writes the instance __dict__ itself: frozen is no obstacle
class ForkChanges:
    """A snapshot fork's changes to its base: as a git patch, per file, or to apply."""

    fork_id: str
    root: str  # the parent's cwd the fork was launched from
    base: Manifest
    changes: Changes  # only the paths that differ from the base
    blobs: BlobStore

    def read(self, digest: str) -> bytes:
        """A blob's bytes, verified: every blob the changes name, old and new, fetched in one go on first use."""
        return self._contents[digest]

    @functools.cached_property
    def _contents(self) -> dict[str, bytes]:
        old = self.base.by_path()
        wanted = {e.digest for e in self.changes.values() if e is not None}
        wanted |= {old[p].digest for p in self.changes if p in old}
        return dict(self.blobs.get(sorted(wanted)))

    @property
    def paths(self) -> list[str]:
        """The changed files, sorted."""
        return sorted(self.changes)

    def patch(self) -> bytes:
        """The changes as a patch `git apply` accepts (binary files included)."""
        from workers.workspace.patch import render_patch  # noqa: PLC0415

        return render_patch(self.base, self.changes, self.read)

    def stat(self) -> list[dict[str, Any]]:
        """Per changed file: path, status, lines added and removed, binary."""
        from workers.workspace.patch import diffstat  # noqa: PLC0415

        return [_stat_json(s) for s in diffstat(self.base, self.changes, self.read)]

    def apply(self, target: Path, *, check: bool = False) -> list[str]:
        """Apply the changes to `target`, all or nothing; the paths changed (or that would be, with `check`).

        Raises:
            ApplyConflict: a file of `target` differs from the version the fork started from; nothing was written.
        """
        from workers.workspace.apply import apply_changes  # noqa: PLC0415

        return apply_changes(target, self.base, self.changes, self.read, check=check)


def _stat_json(stat: Any) -> dict[str, Any]:
    return {
        "path": stat.path,
        "status": str(stat.status),
        "added": stat.added,
        "removed": stat.removed,
        "binary": stat.binary,
    }


def fork_changes(store: ForkStore, blobs: BlobStore, record: BootstrapRecord) -> ForkChanges:
    """The changes the journal of `record`'s fork holds, against its base snapshot.

    Raises:
        WorkspaceError: the fork has no snapshot workspace (shared, or launched before workspaces).
    """
    ref = record.workspace
    if ref is None or not ref.snapshot:
        raise WorkspaceError(
            f"fork {record.fork_id} has no snapshot workspace (it acted on {record.cwd!r} in place): it has no "
            "changes to show or apply",
            fork_id=record.fork_id,
        )
    scoped = BlobStore(blobs.client, blobs.keys, ttl_s=blobs.ttl_s, scope=ref.scope)
    base = EMPTY if ref.manifest is None else scoped.get_manifest(ref.manifest)
    net = fold(store.journal(record.fork_id), fork_id=record.fork_id).changes
    changes = base.changes_to(base.apply(net))
    return ForkChanges(record.fork_id, ref.root, base, changes, scoped)


def default_target(changes: ForkChanges) -> Path:
    """The folder `forkq apply` writes without `--dir`: the parent's cwd."""
    return Path(os.path.normpath(changes.root))

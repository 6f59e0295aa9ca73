"""Workspaces over HTTP: a remote parent uploads its tree (manifest, then only the blobs the server lacks).

The server never reads its own disk at a path a request names: a snapshot launch through the API names an
uploaded manifest, or gets an empty workspace. The exchange is a git push's:

1. `offer`: the client sends the manifest (path, mode, size, digest of every file); the server answers with
   the manifest's digest and the blobs its scope lacks;
2. `upload`: the client sends each of those blobs, which the server checks against its digest;
3. `offer` again: nothing is missing, so the manifest is stored (a manifest is stored only once all its blobs
   are, with their sizes checked), and a launch may name it.

Blobs and manifests are stored per scope (`workspace_scope`): an answer says only what the caller's own scope
holds, so no client learns whether another's files exist once each tenant has its scope.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import redis

from broker_config.settings import Settings
from workers.base.keys import Keys
from workers.errors import RequestRefused, WorkspaceError, WorkspaceTooLarge
from workers.store.blobs import DEFAULT_SCOPE, BlobStore
from workers.workspace.manifest import EMPTY, Entry, Manifest, blob_digest
from workers.workspace.ref import WorkspaceMode

LARGEST_SHOWN: Final = 5  # folders a refusal names
STRLEN_BATCH: Final = 1000


def workspace_scope(principal: str) -> str:
    """The scope of the blobs and manifests of the caller `principal` (its token's id).

    One scope for every caller until tenants exist; this is the one place that will then map a caller to its
    tenant's scope.
    """
    del principal  # every caller shares the default scope until tenants exist
    return DEFAULT_SCOPE


@dataclass(frozen=True, slots=True)
class Offered:
    """The answer to an offered manifest: its digest, and the blobs the scope lacks (none: it is stored)."""

    manifest: str
    missing: list[str]


@dataclass(frozen=True, slots=True)
class LaunchWorkspace:
    """What a launch through the API passes to `ForkClient.launch`: the mode, the manifest's digest and network."""

    workspace: WorkspaceMode
    manifest: str | None
    network: bool


def largest_folders(entries: Iterable[Entry], count: int = LARGEST_SHOWN) -> list[tuple[str, int, int]]:
    """The `count` top-level folders (or `.`, the root's own files) holding the most bytes: `(folder, bytes, files)`."""
    sizes: Counter[str] = Counter()
    files: Counter[str] = Counter()
    for entry in entries:
        head, sep, _ = entry.path.partition("/")
        folder = f"{head}/" if sep else "."
        sizes[folder] += entry.size
        files[folder] += 1
    return [(folder, size, files[folder]) for folder, size in sizes.most_common(count)]


def check_bounds(manifest: Manifest, settings: Settings) -> None:
    """A manifest within FORKQ_WORKSPACE_MAX_FILES and FORKQ_WORKSPACE_MAX_BYTES.

    Raises:
        WorkspaceTooLarge: it is over one of them; the message names the bound, the largest folders and the fix.
    """
    files, size = len(manifest), manifest.total_bytes
    if files <= settings.workspace_max_files and size <= settings.workspace_max_bytes:
        return
    if files > settings.workspace_max_files:
        over = f"{files:,} files, over FORKQ_WORKSPACE_MAX_FILES ({settings.workspace_max_files:,})"
    else:
        over = f"{size:,} bytes, over FORKQ_WORKSPACE_MAX_BYTES ({settings.workspace_max_bytes:,})"
    largest = largest_folders(manifest)
    shown = ", ".join(f"{folder} ({nbytes:,} bytes, {nfiles:,} files)" for folder, nbytes, nfiles in largest)
    raise WorkspaceTooLarge(
        f"the workspace holds {over}; its largest folders: {shown}. Leave folders out (.gitignore or "
        '.forkqignore), or launch with workspace "shared"',
        largest=largest,
    )


class Workspaces:
    """The API's side of uploaded workspaces, over the blob store of each scope."""

    def __init__(self, client: redis.Redis, keys: Keys, settings: Settings) -> None:
        self.client = client
        self.keys = keys
        self.settings = settings

    def store(self, scope: str) -> BlobStore:
        """The blob store of `scope`."""
        return BlobStore(self.client, self.keys, ttl_s=self.settings.record_ttl_s, scope=scope)

    def offer(self, scope: str, entries: Sequence[Entry]) -> Offered:
        """The manifest of `entries` and the blobs `scope` lacks; stored once none is missing.

        Raises:
            WorkspaceError: a path is listed twice or lies under a file; a stored blob's size is not its entry's.
            WorkspaceTooLarge: the tree is over the workspace bounds.
        """
        manifest = Manifest.of(entries)
        check_bounds(manifest, self.settings)
        store, digest = self.store(scope), manifest.digest
        if store.has_manifest(digest):  # its blobs are stored too: an unchanged tree asks nothing of each file
            try:
                store.put_manifest(manifest)  # renews it and its blobs when they near their expiry
                return Offered(digest, [])
            except WorkspaceError:  # some of its blobs expired (Redis flushed): asked for as for a new tree
                pass
        missing = store.missing(sorted(manifest.digests()))
        if missing:
            return Offered(digest, missing)
        self._check_sizes(scope, manifest)
        store.put_manifest(manifest)
        return Offered(digest, [])

    def upload(self, scope: str, digest: str, data: bytes) -> None:
        """Store one blob of `scope`, after checking its bytes against `digest`.

        Raises:
            RequestRefused: the body is over FORKQ_WORKSPACE_MAX_BYTES (413).
            WorkspaceError: the body's digest is not `digest` (nothing is stored).
        """
        limit = self.settings.workspace_max_bytes
        if len(data) > limit:
            raise RequestRefused(
                f"blob {digest}: {len(data):,} bytes, over FORKQ_WORKSPACE_MAX_BYTES ({limit:,}); a workspace cannot "
                'hold this file: leave it out (.gitignore or .forkqignore), or launch with workspace "shared"',
                status=413,
            )
        actual = blob_digest(data)
        if actual != digest:
            raise WorkspaceError(
                f"blob {digest}: the body's digest is {actual}; upload the file's exact bytes (its SHA-256 in "
                "lowercase hex names it)",
                field="digest",
            )
        self.store(scope).put({digest: data}, verified=True)  # checked just above

    def for_launch(
        self, scope: str, workspace: WorkspaceMode | None, manifest: str | None, network: bool | None
    ) -> LaunchWorkspace:
        """The workspace of a launch through the API (its options; None: the default).

        A snapshot launch without a manifest gets the empty tree: the server never snapshots a folder of its own.

        Raises:
            WorkspaceError: a shared workspace names a manifest.
        """
        mode = workspace or WorkspaceMode(self.settings.workspace)
        net = True if network is None else network
        if mode is WorkspaceMode.SHARED:
            if manifest is not None:
                raise WorkspaceError(
                    f'workspace_manifest {manifest} names a snapshot, but the workspace is "shared" (the fork '
                    'works in its cwd in place); leave workspace_manifest out, or set workspace "snapshot"',
                    field="workspace_manifest",
                )
            return LaunchWorkspace(mode, None, net)
        store = self.store(scope)
        if manifest is None:
            return LaunchWorkspace(mode, store.put_manifest(EMPTY), net)
        # whether the scope holds it is the launch's own check (workers.store.workspaces.launch_workspace)
        return LaunchWorkspace(mode, manifest, net)

    def _check_sizes(self, scope: str, manifest: Manifest) -> None:
        """Each blob's stored size is its entries': the bounds were checked on the sizes the client declared.

        Raises:
            WorkspaceError: an entry's size is not its blob's; the message names the entry.
        """
        entries = list(manifest)
        for start in range(0, len(entries), STRLEN_BATCH):
            batch = entries[start : start + STRLEN_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for entry in batch:
                pipe.strlen(self.keys.blob(scope, entry.digest))
            for entry, size in zip(batch, pipe.execute(), strict=True):
                if entry.size != size:
                    raise WorkspaceError(
                        f"workspace entry {entry.path!r}: size {entry.size:,}, but its blob {entry.digest} holds "
                        f"{size:,} bytes; send each file's size in bytes",
                        field="size",
                    )

"""A snapshot fork's files on a worker: one private folder per run, built from Redis, journaled per tool call.

A run builds the base manifest its record names into `<workspaces>/runs/<pid>.<fork>.<epoch>/tree` from the
worker's bounded cache, replays the changes its journal holds on top, and watches the tree. After each tool
call the files the call changed are stored (content-addressed, so an unchanged file costs nothing) and handed
to the loop for the call's journal entry, which is fenced like every write: a revived run on any machine
rebuilds the same tree. Every tool of the fork acts in the folder, confined to it (`workers.workspace.sandbox`).
The folder is removed when the run ends; folders of a worker process that died are removed by the next
worker started on the machine (`sweep_stale_runs`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from broker_config.settings import Settings
from workers.records.fork import BootstrapRecord
from workers.store.blobs import BlobStore
from workers.tools.registry import ToolContext
from workers.workspace.manifest import EMPTY, Entry, Manifest, encode_changes
from workers.workspace.materialize import WorkspaceCache, apply_changes_to_tree, build, remove_tree
from workers.workspace.ref import WorkspaceRef
from workers.workspace.sandbox import Confinement
from workers.workspace.tracker import Tracker

log = logging.getLogger("forkq.workspace")

RUNS: Final = "runs"
CACHE: Final = "cache"


def workspaces_dir(settings: Settings) -> Path:
    """Where a worker keeps its runs' folders and its cache."""
    return settings.workspace_dir or Path(tempfile.gettempdir()) / "forkq-workspaces"


def worker_cache(settings: Settings) -> WorkspaceCache:
    """The worker process's cache of workspace blobs (FORKQ_WORKSPACE_CACHE_MB)."""
    return WorkspaceCache(workspaces_dir(settings) / CACHE, settings.workspace_cache_mb * 1024 * 1024)


def sweep_stale_runs(settings: Settings) -> int:
    """Remove the run folders of worker processes of this machine that are gone; how many were removed."""
    runs = workspaces_dir(settings) / RUNS
    removed = 0
    try:
        names = os.listdir(runs)
    except FileNotFoundError:
        return 0
    for name in names:
        pid = name.split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            remove_tree(runs / name)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


class WorkspaceUse:
    """The runs of this process that hold a workspace folder, and the bytes of their trees (for the metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[int, int] = {}

    def set(self, run: object, size: int) -> None:
        """`run` holds a tree of `size` bytes now."""
        with self._lock:
            self._bytes[id(run)] = size

    def drop(self, run: object) -> None:
        """`run` removed its folder."""
        with self._lock:
            self._bytes.pop(id(run), None)

    def totals(self) -> tuple[int, int]:
        """Runs holding a folder, and the bytes of their trees."""
        with self._lock:
            return len(self._bytes), sum(self._bytes.values())


class RunWorkspace:
    """One run's workspace (the loop's `Workspace`): its folder, its tracker, its sandbox."""

    def __init__(
        self,
        record: BootstrapRecord,
        *,
        settings: Settings,
        blobs: BlobStore,
        cache: WorkspaceCache,
        epoch: int,
        use: WorkspaceUse | None = None,
    ) -> None:
        assert record.workspace is not None and record.workspace.snapshot
        self.record = record
        self.ref = record.workspace
        self.settings = settings
        self.blobs = blobs
        self.cache = cache
        self.folder = workspaces_dir(settings) / RUNS / f"{os.getpid()}.{record.fork_id}.{epoch}"
        self.root = self.folder / "tree"
        self.tmp = self.folder / "tmp"
        self.confinement = Confinement(
            root=self.root,
            alias=self.ref.root,
            tmp=self.tmp,
            network=self.ref.network,
            enforce=settings.sandbox == "on",
        )
        self.tracker: Tracker | None = None
        self.use = use or WorkspaceUse()
        self.sizes: dict[str, int] = {}  # the tree's file sizes, kept up to date by the checkpoints (metrics)

    def base(self) -> Manifest:
        """The manifest the fork was launched with."""
        return EMPTY if self.ref.manifest is None else self.blobs.get_manifest(self.ref.manifest)

    def open(self, changes: Mapping[str, Entry | None]) -> None:
        """Build the tree as of the journal: the base snapshot, then the changes recorded so far."""
        if self.folder.exists():  # a run of the same epoch in this process cannot be; a leftover can
            remove_tree(self.folder)
        self.folder.mkdir(parents=True, mode=0o700)
        self.tmp.mkdir(mode=0o700)
        manifest = self.base()
        build(manifest, self.root, self.cache, self.blobs.get, git=self.ref.git)
        if changes:
            apply_changes_to_tree(self.root, dict(changes), self.cache, self.blobs.get)
            manifest = manifest.apply(changes)
        self.tracker = Tracker(
            self.root,
            manifest,
            max_bytes=self.settings.workspace_max_bytes,
            max_files=self.settings.workspace_max_files,
        )
        self.tracker.start()
        self.sizes = {e.path: e.size for e in manifest}
        self.use.set(self, sum(self.sizes.values()))

    def context(self, ctx: ToolContext) -> ToolContext:
        """`ctx` acting in this run's folder, confined to it."""
        return replace(ctx, cwd=self.root, confinement=self.confinement)

    def checkpoint(self) -> list[Any] | None:
        """Store the files the last call changed; their journal form (None: it changed none)."""
        if self.tracker is None:
            return None
        collected = self.tracker.collect()
        if not collected.changes:
            return None
        self.blobs.put(collected.blobs)
        for path, entry in collected.changes.items():
            if entry is None:
                self.sizes.pop(path, None)
            else:
                self.sizes[path] = entry.size
        self.use.set(self, sum(self.sizes.values()))
        return encode_changes(collected.changes)

    def share(self) -> WorkspaceRef:
        """The tree as of the last checkpoint, its manifest stored (its blobs are): a nested subagent's start."""
        assert self.tracker is not None, "open() first"
        return self.ref.model_copy(update={"manifest": self.blobs.put_manifest(self.tracker.manifest)})

    def merge(self, changes: Mapping[str, Entry | None]) -> None:
        """Write a nested subagent's changes into the tree; the next checkpoint journals them with its call."""
        if changes:
            apply_changes_to_tree(self.root, dict(changes), self.cache, self.blobs.get)

    def close(self) -> None:
        """Stop watching and remove the run's folder."""
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        self.use.drop(self)
        try:
            remove_tree(self.folder)
        except OSError as exc:  # never fail a run over its cleanup; the next worker start sweeps it
            log.warning("fork %s: its workspace folder %s was not removed: %s", self.record.fork_id, self.folder, exc)

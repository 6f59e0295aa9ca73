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
from workers.errors import ForkqError, WorkspaceError
from workers.records.fork import BootstrapRecord
from workers.store.blobs import BlobStore
from workers.tools.registry import ToolContext
from workers.workspace.manifest import EMPTY, Entry, Manifest, encode_changes
from workers.workspace.materialize import WorkspaceCache, apply_changes_to_tree, build, remove_tree
from workers.workspace.materialize import commit_base as _commit_base_tree
from workers.workspace.ref import WorkspaceRef
from workers.workspace.sandbox import Confinement
from workers.workspace.tracker import Tracker

log = logging.getLogger("forkq.workspace")

RUNS: Final = "runs"
REMOVING: Final = ".removing."  # a gone worker's run folder, renamed by the worker that removes it
READY_WAIT_S: Final = 900.0  # a tool call's wait for its tree: past git's own time limits for the base commit
CACHE: Final = "cache"


def workspaces_dir(settings: Settings) -> Path:
    """Where a worker keeps its runs' folders and its cache."""
    return settings.workspace_dir or Path(tempfile.gettempdir()) / "forkq-workspaces"


def worker_cache(settings: Settings) -> WorkspaceCache:
    """The worker process's cache of workspace blobs (FORKQ_WORKSPACE_CACHE_MB), written by a background thread."""
    return WorkspaceCache(workspaces_dir(settings) / CACHE, settings.workspace_cache_mb * 1024 * 1024, deferred=True)


def sweep_stale_runs(settings: Settings) -> int:
    """Remove the run folders of worker processes of this machine that are gone; how many were removed."""
    runs = workspaces_dir(settings) / RUNS
    removed = 0
    try:
        names = os.listdir(runs)
    except FileNotFoundError:
        return 0
    for name in names:
        # `<pid>.<fork>.<epoch>`, or `.removing.<pid>.<that>` while the worker <pid> removes it
        pid, _, rest = name.removeprefix(REMOVING).partition(".")
        run = rest if name.startswith(REMOVING) else name
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            # workers starting together on one machine sweep the same folders: the one whose rename wins removes
            # it, the others find it gone
            claimed = runs / f"{REMOVING}{os.getpid()}.{run}"
            try:
                os.rename(runs / name, claimed)
                remove_tree(claimed)
            except FileNotFoundError:
                continue
            except (OSError, WorkspaceError) as exc:  # a folder left behind must not stop the worker starting
                log.warning("workspace run folder %s of a gone worker not removed: %s", name, exc)
                continue
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
        self._ready = threading.Event()  # set once the tree is complete and watched: tools may run
        self._failed: BaseException | None = None
        self._finishing: threading.Thread | None = None

    def base(self) -> Manifest:
        """The manifest the fork was launched with."""
        return EMPTY if self.ref.manifest is None else self.blobs.get_manifest(self.ref.manifest)

    def open(self, changes: Mapping[str, Entry | None]) -> None:
        """Build the tree as of the journal: the base snapshot, then the changes recorded so far.

        With a git base, the repository is made (and the changes replayed on top of its commit) in a thread while
        the run's first model call is under way; every tool call waits for it.
        """
        if self.folder.exists():  # a run of the same epoch in this process cannot be; a leftover can
            remove_tree(self.folder)
        self.folder.mkdir(parents=True, mode=0o700)
        self.tmp.mkdir(mode=0o700)
        base = self.base()
        build(base, self.root, self.cache, self.blobs.get, trusted=True)  # BlobStore.get verifies
        if self.ref.git:
            self._finishing = threading.Thread(target=self._finish, args=(base, dict(changes)), daemon=True)
            self._finishing.start()
        else:
            self._finish(base, dict(changes))
            self._wait()

    def _finish(self, base: Manifest, changes: dict[str, Entry | None]) -> None:
        """The rest of the build: the base's repository (git's `.git` is never tracked or journaled), the journal's
        changes on top of its commit (so `git diff` shows the fork's own changes, whichever run made them), and
        the tracker."""
        try:
            if self.ref.git:
                try:
                    _commit_base_tree(self.root, base)
                except WorkspaceError as exc:  # the fork still runs; `git status` then says there is no repository
                    log.warning("fork %s: its workspace has no git repository: %s", self.record.fork_id, exc)
            manifest = base
            if changes:
                apply_changes_to_tree(self.root, changes, self.cache, self.blobs.get, trusted=True)
                manifest = base.apply(changes)
            tracker = Tracker(
                self.root,
                manifest,
                max_bytes=self.settings.workspace_max_bytes,
                max_files=self.settings.workspace_max_files,
            )
            tracker.start()
            self.tracker = tracker
            self.sizes = {e.path: e.size for e in manifest}
            self.use.set(self, sum(self.sizes.values()))
        except BaseException as exc:  # raised again to the first tool call, which ends the run with it
            self._failed = exc
        finally:
            self._ready.set()

    def _wait(self) -> Tracker:
        """The tracker, once the tree is complete.

        Raises:
            WorkspaceError: the tree could not be completed (the cause attached).
        """
        if not self._ready.wait(READY_WAIT_S):
            raise WorkspaceError(f"fork {self.record.fork_id}: its workspace was not ready within {READY_WAIT_S:g} s")
        if self._failed is not None:
            if isinstance(self._failed, ForkqError):
                raise self._failed
            raise WorkspaceError(
                f"fork {self.record.fork_id}: its workspace could not be built: {self._failed}", cause=self._failed
            )
        assert self.tracker is not None
        return self.tracker

    def context(self, ctx: ToolContext) -> ToolContext:
        """`ctx` acting in this run's folder, confined to it (once the tree is complete)."""
        self._wait()
        return replace(ctx, cwd=self.root, confinement=self.confinement)

    def checkpoint(self) -> list[Any] | None:
        """Store the files the last call changed; their journal form (None: it changed none)."""
        collected = self._wait().collect()
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
        return self.ref.model_copy(update={"manifest": self.blobs.put_manifest(self._wait().manifest)})

    def merge(self, changes: Mapping[str, Entry | None]) -> None:
        """Write a nested subagent's changes into the tree; the next checkpoint journals them with its call."""
        if changes:
            self._wait()
            apply_changes_to_tree(self.root, dict(changes), self.cache, self.blobs.get, trusted=True)

    def close(self) -> None:
        """Stop watching and remove the run's folder."""
        if self._finishing is not None:  # never remove the folder under git's feet
            self._finishing.join(READY_WAIT_S)
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        self.use.drop(self)
        try:
            remove_tree(self.folder)
        except OSError as exc:  # never fail a run over its cleanup; the next worker start sweeps it
            log.warning("fork %s: its workspace folder %s was not removed: %s", self.record.fork_id, self.folder, exc)

"""The launcher's side of workspaces on a real Redis: what a launch stores and records, and the changes read back."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from broker_config.settings import Settings
from workers.base.keys import Keys
from workers.errors import InvalidAgentParams, WorkspaceError, WorkspaceTooLarge
from workers.records.fork import BootstrapRecord
from workers.records.journal import EntryKind, JournalEntry
from workers.store.blobs import BlobStore
from workers.store.forks import ForkStore
from workers.store.workspaces import (
    WorkspaceLaunch,
    check_shared_root,
    fork_changes,
    launch_workspace,
    snapshot_cache_dir,
)
from workers.workspace.manifest import Entry, Mode, blob_digest, encode_changes
from workers.workspace.ref import WorkspaceMode, WorkspaceRef
from workers.workspace.snapshot import snapshot
from workers.workspace.statcache import RACY_NS


@pytest.fixture
def blobs(redis_client: redis.Redis, settings: Settings) -> BlobStore:
    return BlobStore(redis_client, Keys(settings.namespace), ttl_s=3600)


def record_of(fork_id: str, workspace: WorkspaceRef) -> BootstrapRecord:
    """A minimal bootstrap record of a fork with `workspace`."""
    return BootstrapRecord(
        fork_id=fork_id,
        parent_session="s",
        kind="fork",
        seed_chunks=[],
        message_count=0,
        task_prompt="t",
        directive="d",
        description="x",
        cwd=workspace.root,
        workspace=workspace,
    )


def tree(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("print('a')\n", encoding="utf-8")
    (root / "notes.txt").write_text("notes\n", encoding="utf-8")
    return root


def test_a_snapshot_launch_stores_the_tree_and_records_its_manifest(
    tmp_path: Path, settings: Settings, blobs: BlobStore
) -> None:
    root = tree(tmp_path / "proj")
    ref = launch_workspace(str(root), WorkspaceLaunch(WorkspaceMode.SNAPSHOT), settings=settings, blobs=blobs)
    assert ref.mode is WorkspaceMode.SNAPSHOT and ref.root == str(root) and ref.manifest is not None
    manifest = blobs.get_manifest(ref.manifest)
    assert [e.path for e in manifest] == ["notes.txt", "src/a.py"]
    assert dict(blobs.get(manifest.digests())) == {
        blob_digest(b"notes\n"): b"notes\n",
        blob_digest(b"print('a')\n"): b"print('a')\n",
    }


def test_the_default_snapshot_of_a_folder_this_machine_lacks_is_an_empty_workspace(
    settings: Settings, blobs: BlobStore
) -> None:
    ref = launch_workspace("/no/such/project", WorkspaceLaunch(None), settings=settings, blobs=blobs)
    assert ref.mode is WorkspaceMode.SNAPSHOT and ref.manifest is None


def test_an_explicit_snapshot_of_a_folder_this_machine_lacks_is_refused_naming_the_fix(
    settings: Settings, blobs: BlobStore
) -> None:
    with pytest.raises(InvalidAgentParams, match="not a folder on this machine") as raised:
        launch_workspace("/no/such/project", WorkspaceLaunch(WorkspaceMode.SNAPSHOT), settings=settings, blobs=blobs)
    assert raised.value.field == "workspace" and "shared" in str(raised.value)


def test_a_launch_that_may_not_read_files_never_reads_the_folder_a_request_names(
    tmp_path: Path, settings: Settings, blobs: BlobStore
) -> None:
    root = tree(tmp_path / "proj")
    asked = WorkspaceLaunch(WorkspaceMode.SNAPSHOT, read_files=False)
    ref = launch_workspace(str(root), asked, settings=settings, blobs=blobs)
    assert ref.manifest is None and list(blobs.client.scan_iter("*blob*")) == []


def test_a_tree_over_the_bounds_is_refused_before_anything_is_stored(
    tmp_path: Path, make_settings: Callable[..., Settings], blobs: BlobStore
) -> None:
    root = tree(tmp_path / "proj")
    (root / "big").mkdir()
    (root / "big" / "data.bin").write_bytes(b"x" * 5000)
    with pytest.raises(WorkspaceTooLarge, match="big") as raised:
        launch_workspace(
            str(root),
            WorkspaceLaunch(WorkspaceMode.SNAPSHOT),
            settings=make_settings(workspace_max_bytes=1000),
            blobs=blobs,
        )
    assert raised.value.largest[0][0].startswith("big")
    assert list(blobs.client.scan_iter("*")) == []


def test_an_uploaded_manifest_must_be_stored_before_a_launch_names_it(settings: Settings, blobs: BlobStore) -> None:
    asked = WorkspaceLaunch(WorkspaceMode.SNAPSHOT, manifest="a" * 64, read_files=False)
    with pytest.raises(InvalidAgentParams, match="upload the workspace first"):
        launch_workspace("/remote/proj", asked, settings=settings, blobs=blobs)


@pytest.mark.parametrize(
    ("cwd", "allowed"),
    [("/srv/shared/proj", True), ("/srv/shared", True), ("/srv/sharedother", False), ("/etc", False), ("rel", False)],
)
def test_a_shared_cwd_must_lie_under_the_shared_roots_when_they_are_set(
    make_settings: Callable[..., Settings], cwd: str, allowed: bool
) -> None:
    settings = make_settings(shared_roots="/srv/shared, /data/trees")
    if allowed:
        check_shared_root(cwd, settings)
    else:
        with pytest.raises(InvalidAgentParams, match="FORKQ_SHARED_ROOTS"):
            check_shared_root(cwd, settings)
    check_shared_root(cwd, make_settings())  # unset: anything goes, as before


def test_a_forks_changes_are_its_journals_over_its_base_and_a_reverted_file_is_no_change(
    settings: Settings, redis_client: redis.Redis, blobs: BlobStore, tmp_path: Path
) -> None:
    # Given a fork whose base has two files, and a journal that edits one, adds one, edits another back
    root = tree(tmp_path / "proj")
    ref = launch_workspace(str(root), WorkspaceLaunch(WorkspaceMode.SNAPSHOT), settings=settings, blobs=blobs)
    base = blobs.get_manifest(ref.manifest or "")
    new, edited = b"new\n", b"notes, edited\n"
    blobs.put({blob_digest(new): new, blob_digest(edited): edited})
    a = base.by_path()["src/a.py"]
    steps = [
        {"notes.txt": Entry("notes.txt", Mode.FILE, len(edited), blob_digest(edited))},
        {"n.txt": Entry("n.txt", Mode.EXECUTABLE, len(new), blob_digest(new)), "src/a.py": None},
        {"src/a.py": a},  # restored as it was
    ]
    store = ForkStore(redis_client, Keys(settings.namespace), ttl_s=3600)
    fid = "f-changes"
    record = record_of(fid, ref)
    for seq, changes in enumerate(steps):
        entry = JournalEntry(seq=seq, step=0, kind=EntryKind.TOOL_RESULT, response={"output": ""})
        entry = entry.model_copy(update={"changes": encode_changes(changes)})
        redis_client.rpush(Keys(settings.namespace).journal(fid), entry.encode())

    # When its changes are read
    changes = fork_changes(store, blobs, record)

    # Then they are the net changes: the edit and the addition; the file restored is no change
    assert changes.paths == ["n.txt", "notes.txt"]
    patch = changes.patch().decode()
    assert "new file mode 100755" in patch and "+notes, edited" in patch and "src/a.py" not in patch
    assert [s["status"] for s in changes.stat()] == ["added", "modified"]


def test_a_shared_fork_has_no_changes_to_read(settings: Settings, redis_client: redis.Redis, blobs: BlobStore) -> None:
    store = ForkStore(redis_client, Keys(settings.namespace), ttl_s=3600)
    record = record_of("f-shared", WorkspaceRef(mode=WorkspaceMode.SHARED, root="/p"))
    with pytest.raises(WorkspaceError, match="no snapshot workspace"):
        fork_changes(store, blobs, record)


def test_a_launch_of_an_unchanged_tree_whose_blobs_redis_lost_stores_them_again(
    tmp_path: Path, settings: Settings, blobs: BlobStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a git tree launched once (the launcher's cache knows it: the next launch takes the quick path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    root = tree(tmp_path / "proj")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    newest = max(os.lstat(os.path.join(d, n)).st_ctime_ns for d, _, ns in os.walk(root) for n in ns)
    while time.time_ns() <= newest + RACY_NS:  # the launch record trusts files out of the racy window
        time.sleep(0.05)  # the condition is the clock itself
    first = launch_workspace(str(root), WorkspaceLaunch(WorkspaceMode.SNAPSHOT), settings=settings, blobs=blobs)
    assert snapshot(root.resolve(), max_bytes=1 << 30, max_files=100, cache_dir=snapshot_cache_dir()).quick
    # When Redis loses everything, and the tree is launched again
    redis_client.flushdb()
    again = launch_workspace(str(root), WorkspaceLaunch(WorkspaceMode.SNAPSHOT), settings=settings, blobs=blobs)
    # Then the manifest and every blob it names are stored again
    assert again.manifest == first.manifest and again.manifest is not None
    manifest = blobs.get_manifest(again.manifest)
    assert dict(blobs.get(manifest.digests())) == {
        blob_digest(b"notes\n"): b"notes\n",
        blob_digest(b"print('a')\n"): b"print('a')\n",
    }

"""A sibling launch's shortcut: an unchanged git tree gives last time's manifest; any change takes the full path."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.workspace.test_snapshot import BIG, git
from workers.errors import WorkspaceTooLarge
from workers.workspace import quick, statcache
from workers.workspace.snapshot import Snapshot, snapshot


def repo(root: Path) -> Path:
    """A committed tree with untracked files too."""
    for rel, body in {"src/a.py": "a = 1\n", "src/b.py": "b = 2\n", "run.sh": "echo run\n", "notes.txt": "n\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    git(root, "init", "-q")
    git(root, "add", "src", "run.sh")
    git(root, "commit", "-q", "-m", "base")
    return root.resolve()


def wait_out_the_racy_window(roots: list[Path]) -> None:
    """Wait until every file's ctime (which no call can set back) is out of the racy window."""
    newest = max(os.lstat(os.path.join(d, n)).st_ctime_ns for r in roots for d, _, ns in os.walk(r) for n in ns)
    while time.time_ns() <= newest + statcache.RACY_NS:
        time.sleep(0.05)  # the condition is the clock itself


def snap(root: Path, cache: Path | None, *, max_files: int = 10**6) -> Snapshot:
    return snapshot(root, max_bytes=BIG, max_files=max_files, cache_dir=cache)


def edit_tracked(root: Path) -> None:
    (root / "src" / "a.py").write_text("a = 9\n")  # the same size


def edit_untracked(root: Path) -> None:
    (root / "notes.txt").write_text("N\n")


def add_untracked(root: Path) -> None:
    (root / "src" / "new.py").write_text("new\n")


def delete_tracked(root: Path) -> None:
    (root / "src" / "b.py").unlink()


def delete_untracked(root: Path) -> None:
    (root / "notes.txt").unlink()


def chmod_tracked(root: Path) -> None:
    (root / "run.sh").chmod(0o755)


def chmod_untracked(root: Path) -> None:
    (root / "notes.txt").chmod(0o755)


def stage_edit(root: Path) -> None:
    (root / "src" / "a.py").write_text("a = 7\n")
    git(root, "add", "src/a.py")


EDITS: list[Callable[[Path], None]] = [
    edit_tracked,
    edit_untracked,
    add_untracked,
    delete_tracked,
    delete_untracked,
    chmod_tracked,
    chmod_untracked,
    stage_edit,
]


def test_an_unchanged_git_tree_gives_the_recorded_manifest_without_building_it(tmp_path: Path) -> None:
    root, cache = repo(tmp_path / "root"), tmp_path / "cache"
    wait_out_the_racy_window([root])
    first = snap(root, cache)
    second = snap(root, cache)
    assert not first.quick and second.quick
    assert second.digest == first.digest == snap(root, None).digest
    assert second.manifest == first.manifest  # decoded from the record when asked for
    assert second.read(first.manifest.by_path()["run.sh"].digest) == b"echo run\n"


def test_every_kind_of_change_takes_the_full_path_and_gives_the_new_trees_digest(tmp_path: Path) -> None:
    # Given one tree per kind of change, each snapshotted once out of the racy window (its record written)
    roots = {edit.__name__: repo(tmp_path / edit.__name__) for edit in EDITS}
    wait_out_the_racy_window(list(roots.values()))
    cache = tmp_path / "cache"
    before = {name: snap(root, cache) for name, root in roots.items()}
    assert all(snap(root, cache).quick for root in roots.values())
    for edit in EDITS:
        root = roots[edit.__name__]
        # When the tree changes
        edit(root)
        after = snap(root, cache)
        # Then the snapshot is taken in full, and its digest is the new tree's (the same as without any cache)
        assert not after.quick, edit.__name__
        assert after.digest != before[edit.__name__].digest, edit.__name__
        assert after.digest == snap(root, None).digest == after.manifest.digest, edit.__name__


def test_a_record_written_within_the_racy_window_is_not_trusted(tmp_path: Path) -> None:
    root, cache = repo(tmp_path / "root"), tmp_path / "cache"
    first = snap(root, cache)  # the untracked file was written just now: within the window
    again = snap(root, cache)
    assert not again.quick and again.digest == first.digest


def test_the_bounds_still_hold_for_an_unchanged_tree(tmp_path: Path) -> None:
    root, cache = repo(tmp_path / "root"), tmp_path / "cache"
    wait_out_the_racy_window([root])
    snap(root, cache)
    with pytest.raises(WorkspaceTooLarge):
        snap(root, cache, max_files=2)


def test_a_damaged_record_is_ignored_and_written_again(tmp_path: Path) -> None:
    root, cache = repo(tmp_path / "root"), tmp_path / "cache"
    wait_out_the_racy_window([root])
    first = snap(root, cache)
    path = quick.record_file(cache, root)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    again = snap(root, cache)
    assert not again.quick and again.digest == first.digest
    assert snap(root, cache).quick


def test_a_walked_tree_keeps_no_record(tmp_path: Path) -> None:
    root, cache = tmp_path / "plain", tmp_path / "cache"
    root.mkdir()
    (root / "a.txt").write_text("a")
    snap(root, cache)
    assert not quick.record_file(cache, root.resolve()).exists()

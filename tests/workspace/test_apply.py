"""Applying a fork's changes to a folder: the fork's tree on success, nothing written on a conflict or a failure."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.workspace.patch_support import Blobs, Tree, changes_of, folders, git, read_tree, write_tree
from tests.workspace.test_patch import CASES, CONTENT, PATHS, TREES, _valid
from workers.errors import ApplyConflict, WorkspaceError
from workers.workspace.apply import apply_changes
from workers.workspace.manifest import Entry, Mode, blob_digest
from workers.workspace.patch import render_patch

F, X, L = Mode.FILE, Mode.EXECUTABLE, Mode.SYMLINK


def snapshot(root: Path) -> tuple[Tree, set[str], dict[str, int]]:
    """Everything a write could change: files and links with their bytes and modes, folders and their modes."""
    return read_tree(root, skip=()), folders(root), {f: (root / f).stat().st_mode for f in folders(root)}


@pytest.mark.parametrize("name", list(CASES))
def test_applying_gives_the_forks_tree_and_the_folders_git_apply_leaves(name: str, tmp_path: Path) -> None:
    # Given the base on disk twice
    base, new = CASES[name]
    blobs = Blobs()
    manifest, changes = changes_of(base, new, blobs)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write_tree(ours, base)
    write_tree(theirs, base)
    # When we check, then apply; and git applies our patch to the other copy
    before = snapshot(ours)
    would = apply_changes(ours, manifest, changes, blobs.read, check=True)
    assert snapshot(ours) == before
    done = apply_changes(ours, manifest, changes, blobs.read)
    git(theirs, "apply", "-", stdin=render_patch(manifest, changes, blobs.read))
    # Then both hold the fork's tree, with the same folders, and nothing of ours is left behind
    assert done == would == sorted({p for p in {*base, *new} if base.get(p) != new.get(p)}, key=str.encode)
    assert read_tree(ours, skip=()) == new
    assert folders(ours) == folders(theirs)
    # And applying again finds everything applied
    assert apply_changes(ours, manifest, changes, blobs.read) == []


BASE: Tree = {
    "a.txt": (F, b"a\n"),
    "b/c.txt": (F, b"c\n"),
    "b/run.sh": (X, b"echo\n"),
    "link": (L, b"a.txt"),
    "z/last.txt": (F, b"last\n"),
}
FORK: Tree = {
    "a.txt": (F, b"A\n"),
    "b/new.txt": (F, b"new\n"),
    "b/run.sh": (X, b"echo 2\n"),
    "link": (L, b"b/c.txt"),
    "n/e/w.bin": (F, b"\x00\x01"),
    "z/last.txt": (F, b"LAST\n"),
}

# How the parent's tree moved on since the fork started → the paths that conflict
DRIFT: dict[str, tuple[Tree, list[str]]] = {
    "first file edited": ({**BASE, "a.txt": (F, b"parent's\n")}, ["a.txt"]),
    "last file edited": ({**BASE, "z/last.txt": (F, b"parent's\n")}, ["z/last.txt"]),
    "removed file edited": ({**BASE, "b/c.txt": (F, b"parent's\n")}, ["b/c.txt"]),
    "modified file removed": ({p: v for p, v in BASE.items() if p != "b/run.sh"}, ["b/run.sh"]),
    "added file already there": ({**BASE, "b/new.txt": (F, b"other\n")}, ["b/new.txt"]),
    "exec bit changed": ({**BASE, "a.txt": (X, b"a\n")}, ["a.txt"]),
    "link retargeted": ({**BASE, "link": (L, b"elsewhere")}, ["link"]),
    "link became a file": ({**BASE, "link": (F, b"a.txt")}, ["link"]),
    "file became a link": ({**BASE, "a.txt": (L, b"a\n")}, ["a.txt"]),
    "a file where the fork makes a folder": ({**BASE, "n/e": (F, b"x")}, ["n/e/w.bin"]),
    "a folder where the fork adds a file": ({**BASE, "b/new.txt/inner": (F, b"x")}, ["b/new.txt"]),
    "two files": ({**BASE, "a.txt": (F, b"1\n"), "z/last.txt": (F, b"2\n")}, ["a.txt", "z/last.txt"]),
}


@pytest.mark.parametrize("name", list(DRIFT))
def test_a_conflict_names_each_file_and_writes_nothing(name: str, tmp_path: Path) -> None:
    # Given a fork's changes on BASE, and a target that moved on
    blobs = Blobs()
    manifest, changes = changes_of(BASE, FORK, blobs)
    target, conflicting = DRIFT[name]
    write_tree(tmp_path, target)
    before = snapshot(tmp_path)
    for check in (True, False):
        # When it is checked or applied
        with pytest.raises(ApplyConflict) as raised:
            apply_changes(tmp_path, manifest, changes, blobs.read, check=check)
        # Then the conflict names the files, and the tree is as it was
        assert raised.value.paths == conflicting
        for path in conflicting:
            assert path in str(raised.value)
        assert snapshot(tmp_path) == before


def test_odd_names_apply_and_conflict_by_their_own_name(tmp_path: Path) -> None:
    long_name = "é" * 127  # 254 bytes: its staging name must still fit in NAME_MAX
    blobs = Blobs()
    manifest, changes = changes_of({}, {"a: b.txt": (F, b"new\n"), f"dir/{long_name}": (X, b"x")}, blobs)
    (tmp_path / "ok").mkdir()
    apply_changes(tmp_path / "ok", manifest, changes, blobs.read)
    assert read_tree(tmp_path / "ok") == {"a: b.txt": (F, b"new\n"), f"dir/{long_name}": (X, b"x")}
    write_tree(tmp_path / "drift", {"a: b.txt": (F, b"the parent's\n")})
    with pytest.raises(ApplyConflict) as raised:
        apply_changes(tmp_path / "drift", manifest, changes, blobs.read)
    assert raised.value.paths == ["a: b.txt"]


def test_files_already_applied_count_as_applied_and_the_rest_is_written(tmp_path: Path) -> None:
    blobs = Blobs()
    manifest, changes = changes_of(BASE, FORK, blobs)
    write_tree(tmp_path, {**BASE, "a.txt": FORK["a.txt"], "b/new.txt": FORK["b/new.txt"]})
    assert "a.txt" not in apply_changes(tmp_path, manifest, changes, blobs.read)
    assert read_tree(tmp_path) == FORK


def test_a_symlinked_folder_in_the_target_is_never_written_through(tmp_path: Path) -> None:
    # Given a target whose folder `b` is a symlink to a folder outside it, holding the base's very files
    outside, target = tmp_path / "outside", tmp_path / "target"
    write_tree(outside, {p[2:]: v for p, v in BASE.items() if p.startswith("b/")})
    write_tree(target, {p: v for p, v in BASE.items() if not p.startswith("b/")})
    (target / "b").symlink_to(outside)
    blobs = Blobs()
    manifest, changes = changes_of(BASE, FORK, blobs)
    before, outside_before = snapshot(target), snapshot(outside)
    # When the fork's changes, which edit and add files under b/, are applied
    with pytest.raises(ApplyConflict) as raised:
        apply_changes(target, manifest, changes, blobs.read)
    # Then each of them conflicts, naming the symlink, and nothing moved on either side
    assert raised.value.paths == ["b/c.txt", "b/new.txt", "b/run.sh"]
    assert "folder 'b' is a symlink" in str(raised.value)
    assert snapshot(target) == before
    assert snapshot(outside) == outside_before


def test_a_symlink_to_outside_where_a_file_was_is_a_conflict_and_stays_a_link(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"a\n")  # the very bytes the base had: following the link would find no conflict
    target = tmp_path / "target"
    write_tree(target, {**BASE, "a.txt": (L, str(secret).encode())})
    blobs = Blobs()
    manifest, changes = changes_of(BASE, FORK, blobs)
    with pytest.raises(ApplyConflict, match=r"a\.txt"):
        apply_changes(target, manifest, changes, blobs.read)
    assert secret.read_bytes() == b"a\n"
    assert (target / "a.txt").is_symlink()


def test_a_failure_midway_takes_back_every_step(tmp_path: Path) -> None:
    # Given changes where a file replaces another file's path as a folder, so its staging waits until files were
    # moved aside, and a blob that cannot be read for it
    base: Tree = {"a.txt": (F, b"a\n"), "d": (F, b"file\n"), "e/x": (F, b"x\n")}
    fork: Tree = {"a.txt": (F, b"A\n"), "d/inner": (F, b"unreadable\n"), "new/f": (F, b"f\n")}
    blobs = Blobs()
    manifest, changes = changes_of(base, fork, blobs)
    broken = blob_digest(b"unreadable\n")

    def read(digest: str) -> bytes:
        if digest == broken:
            raise WorkspaceError("blob lost")
        return blobs.read(digest)

    write_tree(tmp_path, base)
    before = snapshot(tmp_path)
    # When applying fails after files were staged and moved aside and folders removed and made
    with pytest.raises(WorkspaceError, match="blob lost") as raised:
        apply_changes(tmp_path, manifest, changes, read)
    # Then the tree is as it was, no staged file or backup left
    assert "every step was undone" in "".join(raised.value.__notes__)
    assert snapshot(tmp_path) == before
    # And with the blob readable, the same changes apply
    apply_changes(tmp_path, manifest, changes, blobs.read)
    assert read_tree(tmp_path) == fork


def test_paths_inside_git_are_refused(tmp_path: Path) -> None:
    blobs = Blobs()
    manifest, _ = changes_of({}, {}, blobs)
    hook = Entry(".git/hooks/post-commit", Mode.EXECUTABLE, 3, blob_digest(b"x\n"))
    with pytest.raises(WorkspaceError, match=r"\.git"):
        apply_changes(tmp_path, manifest, {hook.path: hook}, blobs.read)
    assert list(tmp_path.iterdir()) == []


def test_a_target_that_is_not_a_folder_is_refused(tmp_path: Path) -> None:
    blobs = Blobs()
    manifest, changes = changes_of({}, {"a": (F, b"a")}, blobs)
    (tmp_path / "file").write_bytes(b"")
    for target in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(WorkspaceError, match="expected a folder"):
            apply_changes(target, manifest, changes, blobs.read)


def test_new_files_get_the_umask_as_git_gives_them(tmp_path: Path) -> None:
    blobs = Blobs()
    manifest, changes = changes_of({}, {"f": (F, b"f"), "x": (X, b"x")}, blobs)
    old = os.umask(0o027)
    try:
        apply_changes(tmp_path, manifest, changes, blobs.read)
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "x").stat().st_mode & 0o777 == 0o750


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(base=TREES, edits=st.dictionaries(PATHS, st.one_of(st.none(), CONTENT), max_size=6), drift=st.booleans())
def test_any_change_of_any_small_tree_applies_or_writes_nothing(
    tmp_path_factory: pytest.TempPathFactory, base: Tree, edits: dict[str, tuple[Mode, bytes] | None], drift: bool
) -> None:
    new = _valid({**{p: v for p, v in base.items() if p not in edits}, **{p: v for p, v in edits.items() if v}})
    blobs = Blobs()
    manifest, changes = changes_of(base, new, blobs)
    folder = tmp_path_factory.mktemp("tree")
    try:
        # the target drifted: one file the fork changes was edited by the parent too
        target = dict(base)
        touched = [p for p in changes if p in base and base[p][0] != L] if drift else []
        if touched:
            target[touched[0]] = (base[touched[0]][0], base[touched[0]][1] + b"drift")
        write_tree(folder, target)
        before = snapshot(folder)
        if touched:
            with pytest.raises(ApplyConflict):
                apply_changes(folder, manifest, changes, blobs.read)
            assert snapshot(folder) == before
        else:
            apply_changes(folder, manifest, changes, blobs.read)
            assert read_tree(folder) == new
    finally:
        shutil.rmtree(folder)

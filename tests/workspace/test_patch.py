"""The patch of a fork's changes: real `git apply` accepts it, in a repository and in a plain folder, and the result
is the fork's tree byte for byte; `git apply --stat` agrees with our stat."""

from __future__ import annotations

import random
import shutil
import string
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.workspace.patch_support import Blobs, Tree, changes_of, git, git_repo, random_bytes, read_tree, write_tree
from workers.workspace.manifest import Entry, Mode, blob_digest
from workers.workspace.patch import (
    FileStat,
    FileStatus,
    changed_files,
    diffstat,
    git_blob_id,
    is_binary,
    quote_path,
    render_patch,
    render_stat,
)

F, X, L = Mode.FILE, Mode.EXECUTABLE, Mode.SYMLINK
LONG = b"".join(b"line %d\n" % i for i in range(1, 60))
NOISE = random_bytes(1, 10_000)

# (base tree, the fork's tree)
CASES: dict[str, tuple[Tree, Tree]] = {
    "text edits": (
        {"a.txt": (F, LONG), "keep.txt": (F, b"same\n")},
        {"a.txt": (F, LONG.replace(b"line 3\n", b"three\n").replace(b"line 40\n", b"")), "keep.txt": (F, b"same\n")},
    ),
    "edits at both ends": ({"a": (F, LONG)}, {"a": (F, b"first\n" + LONG[7:-8] + b"last\n")}),
    "add": ({}, {"new.txt": (F, b"hello\nworld\n")}),
    "delete": ({"old.txt": (F, b"bye\n"), "k": (F, b"k\n")}, {"k": (F, b"k\n")}),
    "rename": ({"src/x.py": (F, LONG)}, {"dst/y.py": (F, LONG)}),
    "exec bit only": ({"run.sh": (F, b"#!/bin/sh\necho hi\n")}, {"run.sh": (X, b"#!/bin/sh\necho hi\n")}),
    "exec bit dropped and content": ({"run.sh": (X, b"echo 1\n")}, {"run.sh": (F, b"echo 2\n")}),
    "symlink add": ({"t.txt": (F, b"t\n")}, {"t.txt": (F, b"t\n"), "link": (L, b"t.txt")}),
    "symlink change": ({"link": (L, b"a/b"), "a/b": (F, b"")}, {"link": (L, b"../elsewhere"), "a/b": (F, b"")}),
    "symlink delete": ({"link": (L, b"t"), "t": (F, b"x")}, {"t": (F, b"x")}),
    "symlink becomes file": ({"p": (L, b"target")}, {"p": (F, b"now a file\n")}),
    "file becomes symlink": ({"p": (X, b"was a file\n")}, {"p": (L, b"target")}),
    "binary add": ({}, {"noise.bin": (F, NOISE), "small.bin": (F, b"\x00\x01")}),
    "binary modify": ({"n.bin": (F, NOISE)}, {"n.bin": (F, NOISE[:5000] + b"\x00changed" + NOISE[5008:])}),
    "binary delete": ({"n.bin": (X, NOISE)}, {}),
    "text with a NUL": ({"t": (F, b"text\n")}, {"t": (F, b"text\x00with nul\n")}),
    "not utf-8": ({"latin": (F, b"caf\xe9\n")}, {"latin": (F, b"caf\xe9 au lait\n")}),
    "empty file add": ({}, {"empty": (F, b""), "d/empty": (X, b"")}),
    "empty file delete": ({"empty": (F, b"")}, {}),
    "empty to content": ({"e": (F, b"")}, {"e": (F, b"now\n")}),
    "content to empty": ({"e": (F, b"was\nhere\n")}, {"e": (F, b"")}),
    "no trailing newline added to": ({"n": (F, b"a\nb")}, {"n": (F, b"a\nb\nc")}),
    "trailing newline added": ({"n": (F, b"a\nb")}, {"n": (F, b"a\nb\n")}),
    "trailing newline removed": ({"n": (F, LONG)}, {"n": (F, LONG[:-1])}),
    "unicode text": ({"u.md": (F, "héllo wörld\n日本語\n".encode())}, {"u.md": (F, "héllo wörld\n中文 😀\n".encode())}),
    "crlf text": ({"w.txt": (F, b"a\r\nb\r\nc\r\n")}, {"w.txt": (F, b"a\r\nB\r\nc\r\n")}),
    "nested new folder": ({"top": (F, b"t\n")}, {"top": (F, b"t\n"), "a/b/c/d.txt": (F, b"deep\n")}),
    "spaces and non-ascii paths": (
        {"my file.txt": (F, b"one\n"), "dir with space/ä ö.txt": (F, b"x\n")},
        {"my file.txt": (F, b"two\n"), "dir with space/ä ö.txt": (F, b"y\n"), "naïve/€.bin": (F, b"\x00")},
    ),
    "quotes, backslash-free oddities": ({}, {'say "hi".txt': (F, b"hi\n"), "tab\tname": (F, b"t\n")}),
    "file replaced by a folder": ({"d": (F, b"file\n")}, {"d/inner": (F, b"inside\n")}),
    "folder replaced by a file": ({"d/inner": (F, b"inside\n")}, {"d": (F, b"file\n")}),
    "symlink replaced by a folder": ({"a": (L, b"/etc")}, {"a/passwd": (F, b"in the tree\n")}),
    "folder replaced by a symlink": ({"a/b": (F, b"in\n"), "a/c": (X, b"")}, {"a": (L, b"b")}),
    "many hunks": (
        {"m": (F, LONG * 3)},
        {"m": (F, (LONG * 3).replace(b"line 10\n", b"ten\n").replace(b"line 50\n", b"fifty\nfifty-one\n"))},
    ),
}


def patch_of(base: Tree, new: Tree) -> tuple[bytes, list[FileStat]]:
    """Our patch and stat for `base` → `new`."""
    blobs = Blobs()
    manifest, changes = changes_of(base, new, blobs)
    return render_patch(manifest, changes, blobs.read), diffstat(manifest, changes, blobs.read)


@pytest.mark.parametrize("name", list(CASES))
def test_git_apply_turns_the_base_into_the_forks_tree_in_a_repository_and_a_plain_folder(
    name: str, tmp_path: Path
) -> None:
    # Given the base committed in a git repository, and a plain copy of it
    base, new = CASES[name]
    patch, _ = patch_of(base, new)
    repo = git_repo(tmp_path / "repo", base)
    plain = tmp_path / "plain"
    write_tree(plain, base)
    # When git checks and applies our patch in both
    for folder in (repo, plain):
        checked = git(folder, "apply", "--check", "-", stdin=patch, check=False)
        assert checked.returncode == 0, checked.stderr.decode() + "\n" + patch.decode()
        applied = git(folder, "apply", "-", stdin=patch, check=False)
        assert applied.returncode == 0, applied.stderr.decode()
        # Then each holds the fork's tree, bytes and modes
        assert read_tree(folder) == new
    # And the repository's own diff of the result finds the same files changed
    git(repo, "add", "-A")
    listed = git(
        repo, "-c", "core.quotePath=false", "diff", "--cached", "--no-renames", "--name-only", "-z"
    ).stdout.split(b"\0")
    assert sorted(p.decode() for p in listed if p) == sorted({*base, *new} - {p for p in base if base[p] == new.get(p)})


@pytest.mark.parametrize("name", list(CASES))
def test_git_apply_stat_agrees_with_our_stat(name: str, tmp_path: Path) -> None:
    base, new = CASES[name]
    patch, stats = patch_of(base, new)
    write_tree(tmp_path, base)
    ours = render_stat(stats)
    theirs = git(tmp_path, "apply", "--stat", "-", stdin=patch).stdout.decode()
    assert ours == theirs
    numstat = git(tmp_path, "apply", "--numstat", "-", stdin=patch).stdout.decode().splitlines()
    assert [line.split("\t")[:2] for line in numstat] == [
        ["-", "-"] if s.binary else [str(s.added), str(s.removed)] for s in stats
    ]


def test_the_patch_matches_git_diffs_own_headers_for_each_kind_of_change(tmp_path: Path) -> None:
    # Given a base and the fork's tree with every kind of header git writes
    base: Tree = {"m": (F, b"a\n"), "gone": (F, b"g\n"), "x": (F, b"x\n"), "bin": (F, b"\x00a"), "sp ace": (F, b"1\n")}
    new: Tree = {"m": (F, b"b\n"), "added": (F, b"n\n"), "x": (X, b"x\n"), "bin": (F, b"\x00b"), "sp ace": (F, b"2\n")}
    patch, _ = patch_of(base, new)
    repo = git_repo(tmp_path / "repo", base)
    write_tree(repo, new)
    (repo / "gone").unlink()
    git(repo, "add", "-A")
    theirs = git(repo, "diff", "--cached", "--no-renames", "--binary", "--full-index").stdout
    # Then every header and name line is git's own (hunks and deflated bytes may differ)

    def headers(text: bytes) -> list[bytes]:
        kept = (b"diff --git", b"new file", b"deleted file", b"old mode", b"new mode", b"index ", b"--- ", b"+++ ")
        return sorted(line for line in text.splitlines() if line.startswith(kept))

    assert headers(patch) == headers(theirs)
    assert b"+++ b/sp ace\t\n" in patch


def test_changes_equal_to_the_base_give_an_empty_patch() -> None:
    blobs = Blobs()
    manifest, _ = changes_of({"a": (F, b"a\n"), "l": (L, b"a")}, {}, blobs)
    same = {e.path: e for e in manifest}
    same["never-there"] = None
    assert render_patch(manifest, same, blobs.read) == b""
    assert diffstat(manifest, same, blobs.read) == []
    assert render_stat([]) == " 0 files changed\n"


def test_changed_files_are_sorted_by_their_utf8_bytes() -> None:
    entry = Entry("b", Mode.FILE, 0, blob_digest(b""))
    changes = {"b": entry, "a/z": None, "a": None, "ä": None, "Z": None}
    assert changed_files(changes) == ["Z", "a", "a/z", "b", "ä"]
    blobs = Blobs()
    base, _ = changes_of({"b": (F, b""), "a": (F, b"a")}, {}, blobs)
    assert changed_files(changes, base) == ["a"]  # b is as it was; a/z, ä and Z were never there


def test_a_long_file_of_few_distinct_lines_still_diffs_quickly_and_applies(tmp_path: Path) -> None:
    # Given files difflib alone would take minutes on: many lines, few distinct ones, edits all over
    rng = random.Random(7)
    few = [b"%d\n" % rng.randrange(101) for _ in range(60_000)]
    unique = [b"unique line %d\n" % i for i in range(60_000)]
    base: Tree = {"few": (F, b"".join(few)), "unique": (F, b"".join(unique))}
    for lines in (few, unique):
        for _ in range(20):
            lines[rng.randrange(len(lines))] = b"edited\n"
    new: Tree = {"few": (F, b"".join(few)), "unique": (F, b"".join(unique))}
    # When the patch is made
    started = time.monotonic()
    patch, stats = patch_of(base, new)
    elapsed = time.monotonic() - started
    # Then git applies it; the file of unique lines got small hunks, the other was replaced as a whole
    write_tree(tmp_path, base)
    git(tmp_path, "apply", "-", stdin=patch)
    assert read_tree(tmp_path) == new
    few_stat, unique_stat = stats
    assert few_stat.added == few_stat.removed > 10_000  # all between the first and the last edit
    assert (unique_stat.added, unique_stat.removed) == (20, 20)
    assert elapsed < 30  # minutes without the bound; a generous margin for a loaded machine


def test_statuses_name_what_happened_to_each_file() -> None:
    base: Tree = {"mod": (F, b"1\n"), "del": (F, b"d\n"), "mode": (F, b"m\n"), "bin": (F, b"\x00")}
    new: Tree = {"mod": (F, b"2\n3\n"), "add": (F, b"a\n"), "mode": (X, b"m\n"), "bin": (F, b"\x00\x01")}
    _, stats = patch_of(base, new)
    assert [(s.path, s.status, s.added, s.removed, s.binary) for s in stats] == [
        ("add", FileStatus.ADDED, 1, 0, False),
        ("bin", FileStatus.MODIFIED, 0, 0, True),
        ("del", FileStatus.DELETED, 0, 1, False),
        ("mod", FileStatus.MODIFIED, 2, 1, False),
        ("mode", FileStatus.MODE, 0, 0, False),
    ]
    assert stats[0].json() == {"path": "add", "added": 1, "removed": 0, "binary": False, "status": "added"}


def test_long_names_and_large_changes_are_scaled_as_git_scales_them(tmp_path: Path) -> None:
    deep = "/".join(["folder-with-a-long-name"] * 4) + "/file.txt"
    base: Tree = {deep: (F, LONG), "short": (F, b"")}
    new: Tree = {deep: (F, b""), "short": (F, b"x\n" * 500)}
    patch, stats = patch_of(base, new)
    write_tree(tmp_path, base)
    assert render_stat(stats) == git(tmp_path, "apply", "--stat", "-", stdin=patch).stdout.decode()


def test_binary_detection_and_git_blob_ids_follow_git() -> None:
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"
    assert is_binary(b"a" * 7999 + b"\x00")
    assert not is_binary(b"a" * 8000 + b"\x00")  # git looks no further than 8000 bytes
    assert is_binary(b"\xff\xfe")
    assert not is_binary("ünïcödé".encode())


def test_paths_are_quoted_as_git_quotes_them() -> None:
    assert quote_path("plain name.txt") is None
    assert quote_path("ä") == '"\\303\\244"'
    assert quote_path('a"b\\c\td\x7f\x01') == '"a\\"b\\\\c\\td\\177\\001"'


# Random small trees: names from a few letters two folders deep, contents that are text, binary, empty or links.
NAMES = st.sampled_from(["a", "b", "c d", "é", "x.bin"])
PATHS = st.lists(NAMES, min_size=1, max_size=3).map("/".join)
TEXT = st.lists(st.sampled_from(["alpha", "beta", "", "gamma delta", "ü"]), max_size=12).map(
    lambda words: "\n".join(words).encode()
)
CONTENT = st.one_of(
    st.tuples(st.sampled_from([F, X]), TEXT),
    st.tuples(st.just(F), st.binary(max_size=300)),
    st.tuples(st.just(L), st.text(string.ascii_letters + "./", min_size=1, max_size=12).map(str.encode)),
)


def _valid(tree: Tree) -> Tree:
    """`tree` without the files that lie under another file's path."""
    return {p: v for p, v in tree.items() if not any(p.startswith(q + "/") for q in tree)}


TREES = st.dictionaries(PATHS, CONTENT, max_size=8).map(_valid)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(base=TREES, edits=st.dictionaries(PATHS, st.one_of(st.none(), CONTENT), max_size=6), keep=st.booleans())
def test_any_change_of_any_small_tree_applies_with_git(
    tmp_path_factory: pytest.TempPathFactory, base: Tree, edits: dict[str, tuple[Mode, bytes] | None], keep: bool
) -> None:
    new = {p: v for p, v in base.items() if keep or p not in edits}
    new = _valid({**new, **{p: v for p, v in edits.items() if v is not None}})
    patch, stats = patch_of(base, new)
    folder = tmp_path_factory.mktemp("tree")
    try:
        write_tree(folder, base)
        applied = git(folder, "apply", "--allow-empty", "-", stdin=patch, check=False)
        assert applied.returncode == 0, applied.stderr.decode() + "\n" + patch.decode(errors="replace")
        assert read_tree(folder) == new
        assert len(stats) == patch.count(b"diff --git ")
        write_tree(folder / "stat", base)  # a fresh copy: --stat only reads the patch, but wants a folder
        assert git(folder / "stat", "apply", "--stat", "--allow-empty", "-", stdin=patch).stdout.decode() == (
            render_stat(stats) if stats else ""
        )
    finally:
        shutil.rmtree(folder)

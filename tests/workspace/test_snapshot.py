"""The launch's snapshot of a folder: what it lists (git, .forkqignore), links, bounds, changes and the stat cache."""

from __future__ import annotations

import gc
import hashlib
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from workers.errors import WorkspaceError, WorkspaceTooLarge
from workers.workspace import quick, statcache
from workers.workspace.manifest import Manifest, Mode
from workers.workspace.snapshot import Snapshot, snapshot
from workers.workspace.statcache import StatCache, cache_file

BIG = 1 << 40
HOUR_NS = 3600 * 10**9


def git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false", *args],
        cwd=root,
        check=True,
        capture_output=True,
    )


def write(root: Path, files: dict[str, bytes | str]) -> None:
    for rel, body in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body.encode() if isinstance(body, str) else body)


def age(root: Path) -> None:
    """Set every file's mtime an hour back, out of the stat cache's racy window."""
    old = time.time_ns() - HOUR_NS
    for folder, _, names in os.walk(root):
        for name in names:
            os.utime(os.path.join(folder, name), ns=(old, old), follow_symlinks=False)


def snap(root: Path, *, max_bytes: int = BIG, max_files: int = 10**6, cache_dir: Path | None = None) -> Snapshot:
    return snapshot(root, max_bytes=max_bytes, max_files=max_files, cache_dir=cache_dir)


def paths(s: Snapshot) -> list[str]:
    return [e.path for e in s.manifest]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_git_tree_holds_tracked_and_untracked_files_but_not_ignored_or_deleted_ones(tmp_path: Path) -> None:
    # Given a repository with tracked, untracked, ignored and deleted files, and a nested repository
    write(tmp_path, {".gitignore": "build/\n*.log\n", "src/a.py": "a = 1\n", "gone.c": "x", "app.log": "log"})
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "base")
    (tmp_path / "gone.c").unlink()
    write(tmp_path, {"src/new.py": "b = 2\n", "build/out.o": "obj", "inner/f.txt": "nested"})
    git(tmp_path / "inner", "init", "-q")
    # When it is snapshotted
    s = snap(tmp_path)
    # Then git listed it, and the files are exactly the tracked and untracked-not-ignored ones that exist
    assert s.git is True
    assert paths(s) == [".gitignore", "src/a.py", "src/new.py"]
    assert s.manifest.by_path()["src/new.py"].digest == sha(b"b = 2\n")
    assert s.root == tmp_path.resolve()


def test_a_subfolder_of_a_repository_is_snapshotted_with_paths_relative_to_it(tmp_path: Path) -> None:
    write(tmp_path, {"top.txt": "t", "pkg/mod/a.py": "a", "pkg/b.py": "b", "pkg/.gitignore": "*.tmp\n"})
    git(tmp_path, "init", "-q")
    write(tmp_path, {"pkg/c.tmp": "ignored", "pkg/d.py": "untracked"})
    s = snap(tmp_path / "pkg")
    assert s.git is True
    assert paths(s) == [".gitignore", "b.py", "d.py", "mod/a.py"]


def test_a_plain_folder_holds_every_file_but_what_forkqignore_files_exclude(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            ".forkqignore": "*.log\n!keep.log\nnode_modules/\n",
            "a.log": "x",
            "keep.log": "kept",
            "node_modules/dep/index.js": "dep",
            "src/main.py": "main",
            "src/.forkqignore": "secret.txt\n",
            "src/secret.txt": "s",
            "other/secret.txt": "not under src: kept",
            "vendor/.git/HEAD": "a .git is never entered",
            "vendor/lib.py": "lib",
        },
    )
    s = snap(tmp_path)
    assert s.git is False
    assert paths(s) == [
        ".forkqignore",
        "keep.log",
        "other/secret.txt",
        "src/.forkqignore",
        "src/main.py",
        "vendor/lib.py",
    ]


def test_a_forkqignore_applies_on_top_of_gits_listing(tmp_path: Path) -> None:
    write(tmp_path, {".forkqignore": "data/\n", "data/big.bin": "tracked but left out", "a.py": "a"})
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    assert paths(snap(tmp_path)) == [".forkqignore", "a.py"]
    # a .forkqignore that is a link is not followed, and one deleted on disk has no rules
    (tmp_path / ".forkqignore").unlink()
    assert paths(snap(tmp_path)) == ["a.py", "data/big.bin"]
    (tmp_path / ".forkqignore").symlink_to(tmp_path / "rules")
    write(tmp_path, {"rules": "a.py\n"})
    assert paths(snap(tmp_path)) == [".forkqignore", "a.py", "data/big.bin", "rules"]


def test_without_git_installed_a_git_tree_is_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, {".gitignore": "build/\n", "a.py": "a", "build/out.o": "o"})
    git(tmp_path, "init", "-q")
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    s = snap(tmp_path)
    assert s.git is False
    assert paths(s) == [".gitignore", "a.py", "build/out.o"]


def test_a_broken_repository_is_an_error_not_a_walk(tmp_path: Path) -> None:
    write(tmp_path, {".git": "not a gitdir line", "a.py": "a"})
    with pytest.raises(WorkspaceError, match=r"git ls-files` failed in this git work tree"):
        snap(tmp_path)


@pytest.mark.parametrize("in_git", [False, True])
def test_symlinks_stay_links_and_are_never_followed(tmp_path: Path, in_git: bool) -> None:
    # Given links inside the tree, out of it, to a folder, and in loops
    outside = tmp_path / "outside"
    write(outside, {"secret.txt": "never copied"})
    root = tmp_path / "root"
    write(root, {"real.txt": "real", "dir/inner.txt": "inner"})
    links = {
        "to_real": "real.txt",
        "to_dir": "dir",
        "out": str(outside / "secret.txt"),
        "out_dir": str(outside),
        "loop_a": "loop_b",
        "loop_b": "loop_a",
        "self": "self",
        "dangling": "missing/nowhere",
    }
    for name, target in links.items():
        (root / name).symlink_to(target)
    if in_git:
        git(root, "init", "-q")
    # When the tree is snapshotted
    s = snap(root)
    # Then each link is one entry: its target's bytes, nothing behind it
    by_path = s.manifest.by_path()
    assert sorted(by_path) == sorted(["real.txt", "dir/inner.txt", *links])
    for name, target in links.items():
        entry = by_path[name]
        assert (entry.mode, entry.size, entry.digest) == (Mode.SYMLINK, len(target.encode()), sha(target.encode()))
        assert s.read(entry.digest) == target.encode()
    assert by_path["real.txt"].mode is Mode.FILE


def test_executable_bits_are_kept_and_fifos_and_sockets_left_out(tmp_path: Path) -> None:
    write(tmp_path, {"run.sh": "#!/bin/sh\n", "data.txt": "d", "group_exec": "g"})
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "group_exec").chmod(0o610)
    (tmp_path / "data.txt").chmod(0o600)
    os.mkfifo(tmp_path / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)  # a socket's path is short-bounded: bind it by its relative name
        sock.bind("sock")
    finally:
        os.chdir(cwd)
        sock.close()
    s = snap(tmp_path)
    modes = {e.path: e.mode for e in s.manifest}
    assert modes == {"data.txt": Mode.FILE, "group_exec": Mode.EXECUTABLE, "run.sh": Mode.EXECUTABLE}


def test_a_tree_over_the_byte_bound_is_refused_before_any_file_is_read_naming_its_largest_folders(
    tmp_path: Path,
) -> None:
    # Given a tree whose largest folder holds a terabyte (sparse): reading it would take hours
    write(tmp_path, {"src/a.py": "a" * 100, "src/b.py": "b" * 100, "docs/x.md": "x" * 50, "top.txt": "t"})
    (tmp_path / "data").mkdir()
    with (tmp_path / "data" / "huge.bin").open("wb") as f:
        f.truncate(1 << 40)
    cache = tmp_path.parent / "cache-over"
    # When it is snapshotted with a 1 MiB bound
    started = time.monotonic()
    with pytest.raises(WorkspaceTooLarge) as caught:
        snap(tmp_path, max_bytes=1 << 20, cache_dir=cache)
    # Then it is refused at once, naming the largest folders by bytes with their file counts, and the fix
    assert time.monotonic() - started < 10
    assert caught.value.largest[:3] == [("data", 1 << 40, 1), ("src", 200, 2), ("docs", 50, 1)]
    message = str(caught.value)
    assert "data/ (1024.0 GiB, 1 files)" in message and "src/ (200 bytes, 2 files)" in message
    assert ".forkqignore" in message and "workspace shared" in message and "FORKQ_WORKSPACE_MAX_BYTES" in message
    assert not cache.exists()


@pytest.mark.parametrize("in_git", [False, True])
def test_a_tree_over_the_file_bound_is_refused_naming_the_folders_with_most_files(tmp_path: Path, in_git: bool) -> None:
    write(tmp_path, {f"many/f{i}": "" for i in range(30)} | {"big/one.bin": "x" * 5000, "a.txt": "a"})
    if in_git:
        git(tmp_path, "init", "-q")
    with pytest.raises(WorkspaceTooLarge) as caught:
        snap(tmp_path, max_files=10)
    assert caught.value.largest[0][0] == "many"
    assert "many/" in str(caught.value) and "10 files" in str(caught.value)
    assert snap(tmp_path, max_files=32).manifest.total_bytes == 5001


def test_the_stat_cache_lets_a_second_snapshot_read_no_file(tmp_path: Path) -> None:
    # Given a tree whose files are older than the racy window
    root, cache = tmp_path / "root", tmp_path / "cache"
    write(root, {f"d{i % 3}/f{i}.txt": f"file {i}" for i in range(20)} | {"link": "x"})
    (root / "link").unlink()
    (root / "link").symlink_to("d0/f0.txt")
    git(root, "init", "-q")
    age(root)
    # When it is snapshotted twice
    first = snap(root, cache_dir=cache)
    second = snap(root, cache_dir=cache)
    # Then the second reads no file, and finds the same manifest
    assert (first.hashed, first.reused) == (20, 0)
    assert (second.hashed, second.reused) == (0, 20)
    assert second.manifest == first.manifest
    assert cache_file(cache, root.resolve()).is_file()
    # And after one file is edited (same size), only that one is read again
    (root / "d1" / "f1.txt").write_text("FILE 1")
    third = snap(root, cache_dir=cache)
    assert (third.hashed, third.reused) == (1, 19)
    assert third.manifest.by_path()["d1/f1.txt"].digest == sha(b"FILE 1")
    assert first.manifest.changes_to(third.manifest).keys() == {"d1/f1.txt"}


def wait_out_the_racy_window(root: Path) -> None:
    """Wait until every file's ctime (which no call can set back) is out of the racy window."""
    newest = max(os.lstat(os.path.join(d, n)).st_ctime_ns for d, _, names in os.walk(root) for n in names)
    while time.time_ns() <= newest + statcache.RACY_NS:
        time.sleep(0.05)  # the condition is the clock itself


def test_tracked_files_git_finds_unchanged_are_neither_stated_nor_read_once_their_blobs_are_known(
    tmp_path: Path,
) -> None:
    # Given a committed tree, out of the racy window, snapshotted once (the blobs' digests are learned)
    root, cache = tmp_path / "root", tmp_path / "cache"
    write(root, {f"d{i % 3}/f{i}.txt": f"file {i}" for i in range(12)} | {"untracked.txt": "u"})
    git(root, "init", "-q")
    git(root, "add", "d0", "d1", "d2")
    git(root, "commit", "-q", "-m", "base")
    (root / "link").symlink_to("d0/f0.txt")
    git(root, "add", "link")
    wait_out_the_racy_window(root)
    first = snap(root, cache_dir=cache)
    assert (first.hashed, first.from_git) == (13, 0)
    # When it is snapshotted again, without the launch record (which would give the whole manifest at once)
    quick.forget(cache, root.resolve())
    second = snap(root, cache_dir=cache)
    # Then the tracked files' entries come from git's blob ids, the untracked one from the stat cache
    assert (second.hashed, second.reused, second.from_git, second.quick) == (0, 1, 12, False)
    assert second.manifest == first.manifest
    # And a tracked file edited (same size), or edited while marked assume-unchanged, is read again
    (root / "d1" / "f1.txt").write_text("FILE 1")
    git(root, "update-index", "--assume-unchanged", "d2/f2.txt")
    (root / "d2" / "f2.txt").write_text("FILE 2")
    third = snap(root, cache_dir=cache)
    by_path = third.manifest.by_path()
    assert by_path["d1/f1.txt"].digest == sha(b"FILE 1")
    assert by_path["d2/f2.txt"].digest == sha(b"FILE 2")
    assert (third.hashed, third.from_git) == (2, 10)
    assert by_path["link"] == first.manifest.by_path()["link"]


def test_where_git_ignores_the_disks_exec_bits_a_tracked_file_has_gits_mode(tmp_path: Path) -> None:
    write(tmp_path, {"a.sh": "echo a", "b.sh": "echo b"})
    old = time.time_ns() - HOUR_NS  # out of git's racy window: its index then vouches for a.sh
    for name in ("a.sh", "b.sh"):
        os.utime(tmp_path / name, ns=(old, old))
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "core.fileMode", "false")
    git(tmp_path, "add", "-A")
    (tmp_path / "a.sh").chmod(0o755)  # git sees no change: the entry keeps the index's mode
    (tmp_path / "b.sh").chmod(0o755)
    git(tmp_path, "update-index", "-q", "--refresh")  # the new ctimes: a stat-dirty file is listed as changed
    write(tmp_path, {"b.sh": "echo B"})  # changed since the index: read from disk, with the mode on disk
    modes = {e.path: e.mode for e in snap(tmp_path).manifest}
    assert modes == {"a.sh": Mode.FILE, "b.sh": Mode.EXECUTABLE}


def test_files_written_within_the_racy_window_are_read_again(tmp_path: Path) -> None:
    root, cache = tmp_path / "root", tmp_path / "cache"
    write(root, {"fresh.txt": "just written", "old.txt": "old"})
    old = time.time_ns() - HOUR_NS
    os.utime(root / "old.txt", ns=(old, old))
    snap(root, cache_dir=cache)
    second = snap(root, cache_dir=cache)
    assert (second.hashed, second.reused) == (1, 1)


def test_a_stat_cache_trusts_only_entries_older_than_the_racy_window_before_its_snapshot(tmp_path: Path) -> None:
    root, folder = tmp_path / "root", tmp_path / "cache"
    write(root, {"old": "o", "racy": "r"})
    old = time.time_ns() - HOUR_NS
    os.utime(root / "old", ns=(old, old))
    st_old, st_racy = os.lstat(root / "old"), os.lstat(root / "racy")
    cache = StatCache.load(folder, root)
    cache.add("old", st_old, "a" * 64)
    cache.add("racy", st_racy, "b" * 64)
    cache.save(time.time_ns())
    loaded = StatCache.load(folder, root)
    assert loaded.lookup("old", st_old) == "a" * 64
    assert loaded.lookup("racy", st_racy) is None
    assert loaded.lookup("old", st_racy) is None  # another file's stat
    assert loaded.hits == 1
    assert StatCache.load(folder, tmp_path / "other").known == {}  # another root: another cache file


def test_a_damaged_stat_cache_is_ignored(tmp_path: Path) -> None:
    root, cache = tmp_path / "root", tmp_path / "cache"
    write(root, {"a.txt": "a"})
    age(root)
    assert snap(root, cache_dir=cache).hashed == 1
    path = cache_file(cache, root.resolve())
    data = bytearray(path.read_bytes())
    data[-3] ^= 1  # one flipped bit: the checksum no longer matches
    path.write_bytes(bytes(data))
    assert snap(root, cache_dir=cache).hashed == 1
    assert snap(root, cache_dir=cache).reused == 1
    path.write_bytes(b"short")
    assert snap(root, cache_dir=cache).hashed == 1


def test_a_cache_folder_keeps_only_the_most_recent_roots(tmp_path: Path) -> None:
    st = os.lstat(tmp_path)
    for i in range(statcache.MAX_ROOTS + 3):
        cache = StatCache.load(tmp_path / "cache", tmp_path / f"root{i}")
        cache.add("a", st, "a" * 64)
        cache.save(0)
    assert len(list((tmp_path / "cache").glob("*" + statcache.SUFFIX))) == statcache.MAX_ROOTS
    assert cache_file(tmp_path / "cache", tmp_path / f"root{statcache.MAX_ROOTS + 2}").is_file()


def test_read_gives_a_blobs_bytes_and_refuses_a_file_changed_or_removed_since(tmp_path: Path) -> None:
    write(tmp_path, {"a.txt": "alpha", "b.txt": "beta", "same.txt": "alpha"})
    s = snapshot(tmp_path, max_bytes=BIG, max_files=100, keep_bytes=0)  # keeps no bytes: every read is from disk
    a = s.manifest.by_path()["a.txt"].digest
    assert s.read(a) == b"alpha"
    assert s.paths_of(a) == ("a.txt", "same.txt")
    (tmp_path / "a.txt").write_text("ALPHA")
    with pytest.raises(WorkspaceError, match=r"a\.txt was changed since the snapshot; launch again"):
        s.read(a)
    (tmp_path / "b.txt").unlink()
    with pytest.raises(WorkspaceError, match=r"b\.txt was removed since the snapshot"):
        s.read(s.manifest.by_path()["b.txt"].digest)
    with pytest.raises(WorkspaceError, match="no file of this snapshot has blob"):
        s.read("0" * 64)


def test_read_gives_the_bytes_the_snapshot_hashed_within_its_budget_then_reads_the_disk(tmp_path: Path) -> None:
    # Given a snapshot that keeps up to 10 bytes of the files it read: the two small ones, not the large one
    write(tmp_path, {"a.txt": "alpha", "b.txt": "beta" * 5, "c.txt": "gamma"})
    s = snapshot(tmp_path, max_bytes=BIG, max_files=100, keep_bytes=10)
    digests = {e.path: e.digest for e in s.manifest}
    # When every file is then changed on disk
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(name.upper())
    # Then the kept ones still give the bytes the snapshot hashed (its digest's), the others are read and refused
    assert s.read(digests["a.txt"]) == b"alpha"
    assert s.read(digests["c.txt"]) == b"gamma"
    with pytest.raises(WorkspaceError, match=r"b\.txt was changed since the snapshot"):
        s.read(digests["b.txt"])
    # And kept bytes are handed out once: a second read goes to the disk
    with pytest.raises(WorkspaceError, match=r"a\.txt was changed since the snapshot"):
        s.read(digests["a.txt"])


def test_a_large_file_read_whole_to_be_kept_has_the_digest_of_a_chunked_read(tmp_path: Path) -> None:
    data = os.urandom(3 << 20) + b"tail"
    write(tmp_path, {"big.bin": data})
    kept = snapshot(tmp_path, max_bytes=BIG, max_files=10, keep_bytes=BIG)
    chunked = snapshot(tmp_path, max_bytes=BIG, max_files=10, keep_bytes=0)
    assert kept.manifest == chunked.manifest
    assert kept.read(sha(data)) == data


def test_a_file_that_keeps_changing_while_it_is_read_is_refused_naming_it(tmp_path: Path) -> None:
    # Given a large file that a writer appends to without pause
    write(tmp_path, {"quiet.txt": "q"})
    busy = tmp_path / "busy.log"
    busy.write_bytes(os.urandom(1 << 20) * 24)
    stop = threading.Event()

    def append() -> None:
        with busy.open("ab", buffering=0) as f:
            while not stop.is_set():
                f.write(b"x")

    writer = threading.Thread(target=append)
    writer.start()
    # When it is snapshotted until the change is seen (each read takes long enough for many appends)
    try:
        error = None
        for _ in range(20):
            try:
                snap(tmp_path)
            except WorkspaceError as exc:
                error = exc
                break
    finally:
        stop.set()
        writer.join()
    # Then the snapshot is refused, naming the file and the fix
    assert error is not None
    assert "busy.log changed while it was read; launch again when it is quiet" in str(error)
    # And once quiet, it is snapshotted
    assert snap(tmp_path).manifest.by_path()["busy.log"].size == busy.stat().st_size


@pytest.mark.parametrize("in_git", [False, True])
def test_a_name_that_is_not_utf8_is_refused_naming_it_and_the_fix(tmp_path: Path, in_git: bool) -> None:
    write(tmp_path, {"ok.txt": "ok"})
    bad = os.fsencode(tmp_path) + b"/bad\xff.txt"
    fd = os.open(bad, os.O_CREAT | os.O_WRONLY)
    os.close(fd)
    if in_git:
        git(tmp_path, "init", "-q")
    with pytest.raises(WorkspaceError, match=r"bad\\xff\.txt' is not valid UTF-8.*\.forkqignore"):
        snap(tmp_path)
    write(tmp_path, {".forkqignore": "bad*\n"})
    assert paths(snap(tmp_path)) == [".forkqignore", "ok.txt"]


def test_a_path_that_is_not_a_folder_is_refused(tmp_path: Path) -> None:
    write(tmp_path, {"a.txt": "a"})
    with pytest.raises(WorkspaceError, match="not a folder"):
        snap(tmp_path / "a.txt")
    with pytest.raises(WorkspaceError, match="not found"):
        snap(tmp_path / "missing")


def test_a_snapshot_manifest_is_canonical(tmp_path: Path) -> None:
    write(tmp_path, {"b": "1", "a/z": "2", "a.b": "3", "é": "4"})
    s = snap(tmp_path)
    assert Manifest.decode(s.manifest.encode()) == s.manifest
    assert Manifest.of(s.manifest.entries) == s.manifest


def test_on_read_gets_each_file_read_with_its_digest_as_the_threads_read_on(tmp_path: Path) -> None:
    files = {f"d{i % 7}/f{i}.bin": os.urandom(20_000 + i) for i in range(600)}  # over PARALLEL_BYTES: threads
    write(tmp_path, files)
    got: list[list[tuple[str, bytes]]] = []
    s = snapshot(tmp_path, max_bytes=BIG, max_files=10**6, on_read=got.append)
    streamed = {digest: data for batch in got for digest, data in batch}
    assert len(got) > 1  # batch by batch
    assert streamed == {sha(data): data for data in files.values()}
    assert {e.digest for e in s.manifest} == set(streamed)


def test_a_snapshot_pauses_the_garbage_collector_and_leaves_it_as_it_found_it(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a\n", encoding="utf-8")
    seen: list[bool] = []
    assert gc.isenabled()
    snapshot(tmp_path, max_bytes=1 << 20, max_files=10, cache_dir=None, on_read=lambda _: seen.append(gc.isenabled()))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        snapshot(tmp_path, max_bytes=1 << 20, max_files=10, cache_dir=None)
        assert not gc.isenabled()
    finally:
        gc.enable()

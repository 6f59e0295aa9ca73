"""Building a manifest into a folder: byte for byte, from the cache or Redis, with a base commit; replay; removal."""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis

from tests.conftest import TEST_NAMESPACE
from workers.base.keys import Keys
from workers.errors import RecordIntegrityError, WorkspaceError
from workers.store.blobs import BlobStore
from workers.workspace.cache import WorkspaceCache
from workers.workspace.manifest import Entry, Manifest, Mode, blob_digest
from workers.workspace.materialize import KERNEL_COPY_MIN, apply_changes_to_tree, build

BIG = bytes(range(256)) * (KERNEL_COPY_MIN // 256 + 3)  # over the kernel-copy size
TREE: dict[str, tuple[Mode, bytes]] = {
    "README.md": (Mode.FILE, b"# hello\n"),
    "bin/run": (Mode.EXECUTABLE, b"#!/bin/sh\necho run\n"),
    "src/pkg/mod.py": (Mode.FILE, b"x = 1\n"),
    "src/pkg/same.py": (Mode.FILE, b"x = 1\n"),  # one blob, two files
    "src/data.bin": (Mode.FILE, BIG),
    "src/empty": (Mode.FILE, b""),
    "link-in": (Mode.SYMLINK, b"src/pkg/mod.py"),
    "link-out": (Mode.SYMLINK, b"/etc"),
    "link-dangling": (Mode.SYMLINK, b"../nowhere"),
}


class Blobs:
    """The blobs of some trees, served like BlobStore.get, counting the calls and the digests asked for."""

    def __init__(self, *trees: dict[str, tuple[Mode, bytes]]) -> None:
        self.data = {blob_digest(b): b for tree in trees for _, b in tree.values()}
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, digests: Sequence[str]) -> Iterator[tuple[str, bytes]]:
        with self.lock:
            self.calls.append(list(digests))
        for digest in digests:
            yield digest, self.data[digest]


def manifest_of(tree: dict[str, tuple[Mode, bytes]]) -> Manifest:
    return Manifest.of(Entry(p, m, len(b), blob_digest(b)) for p, (m, b) in tree.items())


def read_tree(root: Path) -> dict[str, tuple[Mode, bytes]]:
    """Every file and symlink under `root` (outside .git) with its mode and bytes (a link's target)."""
    found: dict[str, tuple[Mode, bytes]] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git" and not os.path.islink(os.path.join(folder, d))]
        names = files + [d for d in os.listdir(folder) if os.path.islink(os.path.join(folder, d)) and d not in files]
        for name in names:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                found[relative] = (Mode.SYMLINK, os.fsencode(os.readlink(path)))
            else:
                assert stat.S_IMODE(info.st_mode) in (0o644, 0o755), relative
                found[relative] = (Mode.of(info.st_mode), Path(path).read_bytes())
    return found


def git(root: Path, *args: str) -> str:
    env = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "PATH": os.environ["PATH"]}
    return subprocess.run(["git", *args], cwd=root, env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def cache(tmp_path: Path) -> WorkspaceCache:
    return WorkspaceCache(tmp_path / "cache", 64 * 1024 * 1024)


def test_a_build_matches_the_manifest_byte_for_byte_with_modes_and_symlinks(tmp_path: Path, cache: WorkspaceCache):
    blobs = Blobs(TREE)

    stats = build(manifest_of(TREE), tmp_path / "tree", cache, blobs)

    assert read_tree(tmp_path / "tree") == TREE
    assert (stats.files, stats.bytes) == (len(TREE), sum(len(b) for _, b in TREE.values()))
    assert stats.fetched == len(blobs.data)
    assert os.readlink(tmp_path / "tree" / "link-out") == "/etc"  # stored as is, never followed


def test_a_cold_build_fetches_from_redis_in_one_call_and_a_warm_one_fetches_nothing(
    tmp_path: Path, cache: WorkspaceCache, redis_client: redis.Redis
):
    # Given the tree's blobs in Redis, behind a fetch that counts its calls
    store = BlobStore(redis_client, Keys(TEST_NAMESPACE), ttl_s=3600)
    store.put({blob_digest(b): b for _, b in TREE.values()})
    calls: list[list[str]] = []

    def fetch(digests: Sequence[str]) -> Iterator[tuple[str, bytes]]:
        calls.append(list(digests))
        return store.get(digests)

    # When it is built twice from one cache
    cold = build(manifest_of(TREE), tmp_path / "one", cache, fetch)
    warm = build(manifest_of(TREE), tmp_path / "two", cache, fetch)

    # Then the first build asked once for every blob, the second asked nothing, and both trees are the manifest
    assert len(calls) == 1 and sorted(calls[0]) == sorted({blob_digest(b) for _, b in TREE.values()})
    assert (cold.fetched, warm.fetched, warm.fetched_bytes) == (len(calls[0]), 0, 0)
    assert read_tree(tmp_path / "one") == read_tree(tmp_path / "two") == TREE


def test_a_cache_hit_avoids_the_fetch_and_only_missing_blobs_are_fetched(tmp_path: Path, cache: WorkspaceCache):
    changed = {**TREE, "README.md": (Mode.FILE, b"# changed\n")}
    blobs = Blobs(TREE, changed)
    build(manifest_of(TREE), tmp_path / "one", cache, blobs)

    build(manifest_of(changed), tmp_path / "two", cache, blobs)

    assert blobs.calls[1] == [blob_digest(b"# changed\n")]
    assert read_tree(tmp_path / "two") == changed


def test_files_of_a_build_are_copies_a_fork_cannot_change_the_cache_through(tmp_path: Path, cache: WorkspaceCache):
    build(manifest_of(TREE), tmp_path / "tree", cache, Blobs(TREE))

    for name in ("src/data.bin", "README.md"):
        (tmp_path / "tree" / name).write_bytes(b"changed by the fork")

    cached = cache.path(blob_digest(BIG))
    assert cached is not None and cached.read_bytes() == BIG
    assert os.stat(cached).st_nlink == 1 and stat.S_IMODE(os.stat(cached).st_mode) == 0o444


@pytest.mark.parametrize("blob", [TREE["README.md"][1], BIG], ids=["small", "large"])
def test_a_damaged_cache_file_is_fetched_again_not_copied(tmp_path: Path, cache: WorkspaceCache, blob: bytes):
    blobs = Blobs(TREE)
    build(manifest_of(TREE), tmp_path / "one", cache, blobs)
    cached = cache.path(blob_digest(blob))
    assert cached is not None
    cached.chmod(0o644)
    cached.write_bytes(b"X" + blob[1:])

    build(manifest_of(TREE), tmp_path / "two", cache, blobs)

    assert blobs.calls[1] == [blob_digest(blob)]
    assert read_tree(tmp_path / "two") == TREE
    assert cached.read_bytes() == blob  # the damaged file was replaced by the fetched one


def test_a_blob_failing_verification_is_an_error_and_never_a_file(tmp_path: Path, cache: WorkspaceCache):
    def fetch(digests: Sequence[str]) -> Iterator[tuple[str, bytes]]:
        for digest in digests:
            yield digest, b"substituted"

    with pytest.raises(RecordIntegrityError, match="digest"):
        build(manifest_of(TREE), tmp_path / "tree", cache, fetch)

    assert not (tmp_path / "tree").exists()
    assert cache.used_bytes == 0


def test_a_blob_the_store_does_not_return_is_an_error(tmp_path: Path, cache: WorkspaceCache):
    blobs = Blobs(TREE)
    del blobs.data[blob_digest(TREE["README.md"][1])]

    with pytest.raises(WorkspaceError, match="did not return 1"):
        build(manifest_of(TREE), tmp_path / "tree", cache, lambda ds: blobs([d for d in ds if d in blobs.data]))


def test_a_build_refuses_a_folder_that_is_not_empty(tmp_path: Path, cache: WorkspaceCache):
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "stray").write_text("x")

    with pytest.raises(WorkspaceError, match="not empty"):
        build(manifest_of(TREE), tmp_path / "tree", cache, Blobs(TREE))

    assert (tmp_path / "tree" / "stray").read_text() == "x"


def test_a_build_never_writes_through_a_symlink_of_its_own_tree(tmp_path: Path, cache: WorkspaceCache):
    # Given a manifest (built without Manifest.of's checks) with a link `a` to a folder outside, and a file a/b
    outside = tmp_path / "outside"
    outside.mkdir()
    tree = {"a": (Mode.SYMLINK, os.fsencode(outside)), "a/b": (Mode.FILE, b"escaped")}
    entries = tuple(Entry(p, m, len(b), blob_digest(b)) for p, (m, b) in tree.items())

    with pytest.raises(WorkspaceError):
        build(Manifest(entries), tmp_path / "tree", cache, Blobs(tree))

    assert list(outside.iterdir()) == []


def test_a_git_build_starts_clean_and_its_diff_shows_exactly_the_forks_edit(tmp_path: Path, cache: WorkspaceCache):
    tree = {**TREE, ".gitignore": (Mode.FILE, b"*.bin\n")}  # an ignored file that is part of the snapshot
    build(manifest_of(tree), tmp_path / "tree", cache, Blobs(tree), git=True)
    root = tmp_path / "tree"
    assert git(root, "status", "--porcelain") == ""
    assert git(root, "ls-files", "-s", "bin/run").startswith("100755")

    (root / "src" / "pkg" / "mod.py").write_text("x = 2\n")

    assert git(root, "diff", "--name-only") == "src/pkg/mod.py\n"
    assert "1 file changed" in git(root, "diff", "--stat")
    assert git(root, "log", "--format=%an %ad", "--date=unix") == "forkq 946684800\n"


def test_a_git_build_ignores_the_workers_own_git_configuration(
    tmp_path: Path, cache: WorkspaceCache, monkeypatch: pytest.MonkeyPatch
):
    # Given a worker whose environment names a git config with a failing hook, signing and a filter, and a GIT_DIR
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "pre-commit").write_text("#!/bin/sh\nexit 1\n")
    (hooks / "pre-commit").chmod(0o755)
    config = tmp_path / "gitconfig"
    config.write_text(
        f'[core]\n\thooksPath = {hooks}\n[commit]\n\tgpgSign = true\n[filter "x"]\n\tclean = false\n\trequired = true\n'
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "elsewhere"))
    tree = {**TREE, ".gitattributes": (Mode.FILE, b"* filter=x\n")}

    # When a tree is built with its base commit
    build(manifest_of(tree), tmp_path / "tree", cache, Blobs(tree), git=True)

    # Then the commit was made in the tree, with no hook, signature or filter
    monkeypatch.delenv("GIT_DIR")
    assert git(tmp_path / "tree", "status", "--porcelain") == ""
    assert git(tmp_path / "tree", "show", "-s", "--format=%G?") == "N\n"
    assert not (tmp_path / "elsewhere").exists()


def test_one_tree_gives_one_base_commit_on_every_build(tmp_path: Path, cache: WorkspaceCache):
    build(manifest_of(TREE), tmp_path / "one", cache, Blobs(TREE), git=True)
    build(manifest_of(TREE), tmp_path / "two", cache, Blobs(TREE), git=True)

    assert git(tmp_path / "one", "rev-parse", "HEAD") == git(tmp_path / "two", "rev-parse", "HEAD")


def test_a_git_build_refuses_a_git_folder_inside_the_tree(tmp_path: Path, cache: WorkspaceCache):
    tree = {**TREE, "sub/.git/config": (Mode.FILE, b"[core]\n")}

    with pytest.raises(WorkspaceError, match=r"\.git"):
        build(manifest_of(tree), tmp_path / "tree", cache, Blobs(tree), git=True)


def test_replayed_changes_give_the_tree_of_the_changed_manifest(tmp_path: Path, cache: WorkspaceCache):
    # Given a built tree, and changes that edit, add, remove (emptying a folder), turn a file into a folder,
    # a folder into a file, and replace a symlink by a file
    after = {
        "README.md": (Mode.EXECUTABLE, b"# edited\n"),
        "bin/run": (Mode.EXECUTABLE, b"#!/bin/sh\necho run\n"),
        "src/empty/now-a-folder": (Mode.FILE, b"inside\n"),
        "src/data.bin": (Mode.FILE, BIG),
        "src/pkg": (Mode.FILE, b"a file where a folder was\n"),
        "link-out": (Mode.FILE, b"no longer a link\n"),
        "link-in": (Mode.SYMLINK, b"README.md"),
        "new/deep/file.txt": (Mode.FILE, b"new\n"),
    }
    base = manifest_of(TREE)
    build(base, tmp_path / "tree", cache, Blobs(TREE))
    changes = base.changes_to(manifest_of(after))

    apply_changes_to_tree(tmp_path / "tree", changes, cache, Blobs(TREE, after))

    assert read_tree(tmp_path / "tree") == after
    assert not (tmp_path / "tree" / "link-dangling").is_symlink()


def test_replayed_changes_never_reach_through_a_symlink(tmp_path: Path, cache: WorkspaceCache):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep")
    tree = {"a": (Mode.SYMLINK, os.fsencode(outside))}
    build(manifest_of(tree), tmp_path / "tree", cache, Blobs(tree))
    write = {"a/victim": Entry("a/victim", Mode.FILE, 3, blob_digest(b"bad"))}

    with pytest.raises(WorkspaceError, match="not a folder"):
        apply_changes_to_tree(tmp_path / "tree", write, cache, Blobs({"x": (Mode.FILE, b"bad")}))
    with pytest.raises(WorkspaceError, match="not a folder"):
        apply_changes_to_tree(tmp_path / "tree", {"a/victim": None}, cache, Blobs())

    assert (outside / "victim").read_text() == "keep"


def test_concurrent_builds_from_threads_share_one_small_cache(tmp_path: Path):
    # Given eight trees sharing most blobs, and a cache too small for all of them
    trees = [{**TREE, "own.txt": (Mode.FILE, f"tree {i}\n".encode() * 5000)} for i in range(8)]
    blobs = Blobs(*trees)
    cache = WorkspaceCache(tmp_path / "cache", len(BIG) + 60_000)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for round_ in range(3):
                build(manifest_of(trees[i]), tmp_path / f"t{i}-{round_}", cache, blobs)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert all(read_tree(tmp_path / f"t{i}-{r}") == trees[i] for i in range(8) for r in range(3))
    assert cache.used_bytes <= cache.max_bytes


def test_a_cache_of_no_bytes_writes_straight_from_the_fetched_blobs(tmp_path: Path):
    cache = WorkspaceCache(tmp_path / "cache", 0)
    blobs = Blobs(TREE)

    build(manifest_of(TREE), tmp_path / "one", cache, blobs)
    build(manifest_of(TREE), tmp_path / "two", cache, blobs)

    assert read_tree(tmp_path / "two") == TREE
    assert len(blobs.calls) == 2 and cache.used_bytes == 0


def test_a_cache_file_a_crash_cut_short_is_found_at_restart_and_fetched_again(tmp_path: Path):
    # Given a cache whose copy of the large blob was cut short (the worker died while writing it)
    blobs = Blobs(TREE)
    build(manifest_of(TREE), tmp_path / "one", WorkspaceCache(tmp_path / "cache", 1 << 26), blobs)
    cut = tmp_path / "cache" / blob_digest(BIG)[:2] / blob_digest(BIG)
    cut.chmod(0o644)
    with open(cut, "r+b") as file:
        file.truncate(len(BIG) // 2)

    # When the restarted worker builds the tree
    restarted = WorkspaceCache(tmp_path / "cache", 1 << 26)
    build(manifest_of(TREE), tmp_path / "two", restarted, blobs)

    # Then only that blob was fetched again, and both the tree and the cache hold it whole
    assert blobs.calls[1] == [blob_digest(BIG)]
    assert read_tree(tmp_path / "two") == TREE and cut.read_bytes() == BIG
    assert restarted.used_bytes == sum(len(b) for b in blobs.data.values())


def test_a_change_that_does_not_fit_the_tree_leaves_no_stray_file(tmp_path: Path, cache: WorkspaceCache):
    build(manifest_of(TREE), tmp_path / "tree", cache, Blobs(TREE))
    over_a_folder = {"src/pkg": Entry("src/pkg", Mode.FILE, 2, blob_digest(b"x\n"))}

    with pytest.raises(WorkspaceError, match=r"src/pkg|Is a directory"):
        apply_changes_to_tree(tmp_path / "tree", over_a_folder, cache, Blobs({"x": (Mode.FILE, b"x\n")}))

    assert sorted(os.listdir(tmp_path / "tree" / "src")) == ["data.bin", "empty", "pkg"]


def test_a_deferred_cache_is_filled_after_the_build_and_a_tree_file_changed_meanwhile_never_reaches_it(
    tmp_path: Path,
):
    # Given a cache written by its background thread
    cache = WorkspaceCache(tmp_path / "cache", 64 * 1024 * 1024, deferred=True)
    blobs = Blobs(TREE)

    # When a cold build is followed at once by the fork changing its files, before the cache is written
    build(manifest_of(TREE), tmp_path / "one", cache, blobs)
    for name in ("src/data.bin", "README.md", "src/pkg/mod.py"):
        (tmp_path / "one" / name).write_bytes(b"changed by the fork")
    cache.flush()

    # Then the cache holds the fetched bytes, and a second build takes them all from it, unchanged
    assert read_tree(tmp_path / "one")["README.md"] == (Mode.FILE, b"changed by the fork")
    build(manifest_of(TREE), tmp_path / "two", cache, blobs)
    assert len(blobs.calls) == 1 and read_tree(tmp_path / "two") == TREE
    cached = cache.path(blob_digest(BIG))
    assert cached is not None and cached.read_bytes() == BIG and os.stat(cached).st_nlink == 1


def test_a_trusted_build_from_the_blob_store_still_never_writes_a_blob_redis_holds_damaged(
    tmp_path: Path, cache: WorkspaceCache, redis_client: redis.Redis
):
    # Given the tree's blobs in Redis, one of them then overwritten with other bytes
    store = BlobStore(redis_client, Keys(TEST_NAMESPACE), ttl_s=3600)
    store.put({blob_digest(b): b for _, b in TREE.values()})
    damaged = blob_digest(TREE["bin/run"][1])
    redis_client.set(store.keys.blob(store.scope, damaged), b"#!/bin/sh\nrm -rf ~\n")

    # When it is built with the store's own verification only (trusted)
    with pytest.raises(RecordIntegrityError, match=damaged):
        build(manifest_of(TREE), tmp_path / "tree", cache, store.get, trusted=True)

    # Then nothing is left of the tree, and the cache never received the damaged blob
    cache.flush()
    assert not (tmp_path / "tree").exists() and cache.path(damaged) is None


def test_a_trusted_replay_writes_the_changed_files_from_the_blob_store(
    tmp_path: Path, cache: WorkspaceCache, redis_client: redis.Redis
):
    store = BlobStore(redis_client, Keys(TEST_NAMESPACE), ttl_s=3600)
    new = b"print('changed')\n"
    store.put({blob_digest(b): b for b in [*(b for _, b in TREE.values()), new]})
    build(manifest_of(TREE), tmp_path / "tree", cache, store.get, trusted=True)

    changes = {"src/pkg/mod.py": Entry("src/pkg/mod.py", Mode.FILE, len(new), blob_digest(new)), "README.md": None}
    apply_changes_to_tree(tmp_path / "tree", changes, cache, store.get, trusted=True)

    expected = {k: v for k, v in TREE.items() if k != "README.md"} | {"src/pkg/mod.py": (Mode.FILE, new)}
    assert read_tree(tmp_path / "tree") == expected

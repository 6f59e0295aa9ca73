"""A worker's cache of workspace blobs: fetch only what is missing, verify, keep within its bound, survive restarts."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from workers.errors import RecordIntegrityError, WorkspaceError
from workers.workspace.cache import WorkspaceCache, fetch_verified
from workers.workspace.manifest import blob_digest

BLOBS = {blob_digest(data): data for data in (b"a" * 1000, b"b" * 1000, b"c" * 1000, b"d" * 3000)}
A, B, C, D = BLOBS


class Fetch:
    """Serves BLOBS like BlobStore.get and records each call's digests."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, digests: Sequence[str]) -> Iterator[tuple[str, bytes]]:
        self.calls.append(list(digests))
        for digest in digests:
            yield digest, BLOBS[digest]


def test_ensure_fetches_only_the_missing_blobs_in_one_call(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 10_000)
    fetch = Fetch()

    cache.ensure([A, B], fetch)
    cache.ensure([A, B, C, C], fetch)

    assert fetch.calls == [[A, B], [C]]
    for digest in (A, B, C):
        path = cache.path(digest)
        assert path is not None and path.read_bytes() == BLOBS[digest]
    assert cache.used_bytes == 3000


def test_a_fetched_blob_that_fails_verification_is_not_stored(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 10_000)

    with pytest.raises(RecordIntegrityError, match=A):
        cache.ensure([A], lambda digests: [(A, b"not a")])

    assert cache.path(A) is None and cache.used_bytes == 0


def test_a_fetch_that_leaves_a_blob_out_is_an_error(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 10_000)

    with pytest.raises(WorkspaceError, match="did not return 1"):
        cache.ensure([A, B], lambda digests: [(A, BLOBS[A])])


def test_eviction_keeps_the_used_bytes_within_the_bound_least_recently_used_first(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 2500)
    cache.ensure([A, B], Fetch())
    assert cache.path(A) is not None  # A is now the most recently used

    cache.ensure([C], Fetch())

    assert cache.path(B) is None and cache.path(A) is not None and cache.path(C) is not None
    assert cache.used_bytes == 2000 <= cache.max_bytes
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted([A, C])


def test_a_blob_larger_than_the_cache_is_not_kept(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 2500)
    cache.ensure([A], Fetch())

    cache.ensure([D], Fetch())

    assert cache.path(D) is None and cache.path(A) is not None


def test_held_blobs_are_not_evicted_and_a_blob_with_no_room_is_not_kept(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 2000)
    cache.ensure([A, B], Fetch())

    with cache.hold([A, B, C]) as held:
        kept = cache.put(C, BLOBS[C])
        assert set(held) == {A, B}

    assert not kept and cache.path(A) is not None and cache.path(B) is not None
    assert cache.put(C, BLOBS[C]) and cache.used_bytes == 2000


def test_a_restarted_cache_finds_its_blobs_and_drops_leftovers(tmp_path: Path):
    WorkspaceCache(tmp_path, 10_000).ensure([A, B], Fetch())
    (tmp_path / A[:2] / f".{A}.leftover").write_bytes(b"half")

    cache = WorkspaceCache(tmp_path, 1500)  # and the bound was lowered meanwhile

    assert cache.used_bytes == 1000
    assert not (tmp_path / A[:2] / f".{A}.leftover").exists()
    assert sum(cache.path(d) is not None for d in (A, B)) == 1


def test_cache_files_are_read_only_in_a_private_folder(tmp_path: Path):
    cache = WorkspaceCache(tmp_path / "cache", 10_000)
    cache.ensure([A], Fetch())

    path = cache.path(A)

    assert path is not None and (os.stat(path).st_mode & 0o777) == 0o444
    assert os.stat(tmp_path / "cache").st_mode & 0o777 == 0o700


def test_threads_storing_into_one_cache_keep_it_within_its_bound(tmp_path: Path):
    blobs = {blob_digest(bytes([i]) * 700): bytes([i]) * 700 for i in range(64)}
    cache = WorkspaceCache(tmp_path, 10_000)
    errors: list[BaseException] = []

    def run(offset: int) -> None:
        try:
            for i in range(64):
                digest = list(blobs)[(i + offset) % 64]
                cache.ensure([digest], lambda ds: [(d, blobs[d]) for d in ds])
                assert cache.used_bytes <= cache.max_bytes
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n * 8,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    on_disk = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert cache.used_bytes == sum(p.stat().st_size for p in on_disk) <= 10_000
    assert all(p.read_bytes() == blobs[p.name] for p in on_disk)


def test_a_negative_bound_is_refused(tmp_path: Path):
    with pytest.raises(WorkspaceError, match="negative"):
        WorkspaceCache(tmp_path, -1)


def test_a_deferred_cache_stores_blobs_put_later_in_the_background_and_flush_waits_for_them(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 10_000, deferred=True)

    for digest in (A, B, C):
        cache.put_later(digest, BLOBS[digest])
    cache.put_later(A, BLOBS[A])  # a second time: stored once
    cache.flush()

    for digest in (A, B, C):
        path = cache.path(digest)
        assert path is not None and path.read_bytes() == BLOBS[digest]
        assert (os.stat(path).st_mode & 0o777) == 0o444
    assert cache.used_bytes == 3000


def test_blobs_put_later_keep_the_cache_within_its_bound(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 2500, deferred=True)

    for digest in (A, B, C, D):  # D alone is over the bound: never kept
        cache.put_later(digest, BLOBS[digest])
    cache.flush()

    on_disk = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert cache.used_bytes == sum(p.stat().st_size for p in on_disk) == 2000
    assert cache.path(D) is None and cache.path(C) is not None


def test_a_cache_that_is_not_deferred_stores_a_blob_put_later_at_once(tmp_path: Path):
    cache = WorkspaceCache(tmp_path, 10_000)

    cache.put_later(A, BLOBS[A])

    path = cache.path(A)
    assert path is not None and path.read_bytes() == BLOBS[A]


def test_a_trusted_fetch_is_not_hashed_again_but_must_still_return_each_digest_asked_for_once(tmp_path: Path):
    # trusted: the fetch verifies (BlobStore.get does), so its bytes pass as given
    said = [(A, b"as the fetch says")]
    assert list(fetch_verified(lambda ds: said, [A], trusted=True)) == said
    with pytest.raises(RecordIntegrityError, match=A):  # not trusted: hashed here
        list(fetch_verified(lambda ds: said, [A]))
    with pytest.raises(WorkspaceError, match="did not return 1"):
        list(fetch_verified(lambda ds: [(A, BLOBS[A])], [A, B], trusted=True))
    with pytest.raises(WorkspaceError, match="not asked for"):
        list(fetch_verified(lambda ds: [(A, BLOBS[A]), (A, BLOBS[A])], [A, B], trusted=True))

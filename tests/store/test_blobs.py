"""Workspace blobs on a real Redis: which are missing, storing them, and their TTLs (renewed, never shortened)."""

from __future__ import annotations

import pytest
import redis

from broker_config.settings import Settings
from workers.base.keys import Keys
from workers.errors import WorkspaceError
from workers.store import blobs as blobs_module
from workers.store.blobs import BlobStore
from workers.workspace.manifest import blob_digest


@pytest.fixture
def store(redis_client: redis.Redis, settings: Settings) -> BlobStore:
    return BlobStore(redis_client, Keys(settings.namespace), ttl_s=3600)


def key(store: BlobStore, data: bytes) -> str:
    return store.keys.blob(store.scope, blob_digest(data))


def test_missing_lists_the_absent_digests_in_order_once_and_renews_the_present_ones(
    store: BlobStore, redis_client: redis.Redis
) -> None:
    present, absent = [b"one", b"two"], [b"three", b"four"]
    for data in present:
        redis_client.set(key(store, data), data, ex=60)
    asked = [blob_digest(d) for d in [b"three", b"one", b"four", b"three", b"two"]]
    assert store.missing(asked) == [blob_digest(b"three"), blob_digest(b"four")]
    for data in present:
        assert store.blob_ttl_s - 5 <= redis_client.ttl(key(store, data)) <= store.blob_ttl_s
    for data in absent:
        assert not redis_client.exists(key(store, data))  # asking stores nothing


def test_missing_never_shortens_a_ttl_nor_gives_one_to_a_blob_without(
    store: BlobStore, redis_client: redis.Redis
) -> None:
    longer, forever = b"longer", b"forever"
    redis_client.set(key(store, longer), longer, ex=store.blob_ttl_s * 10)
    redis_client.set(key(store, forever), forever)
    assert store.missing([blob_digest(longer), blob_digest(forever)]) == []
    assert redis_client.ttl(key(store, longer)) > store.blob_ttl_s * 9
    assert redis_client.ttl(key(store, forever)) == -1


def test_missing_answers_batches_of_keys_each_in_one_script(
    store: BlobStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs_module, "BATCH_KEYS", 7)
    datas = [f"blob {i}".encode() for i in range(30)]
    store.put({blob_digest(d): d for d in datas[::2]})
    assert store.missing(blob_digest(d) for d in datas) == [blob_digest(d) for d in datas[1::2]]


def test_put_stores_new_blobs_keeps_existing_ones_and_only_lengthens_their_ttl(
    store: BlobStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs_module, "BATCH_BYTES", 10)  # several scripts
    old, longer, new = b"old blob", b"longer blob", [f"new {i}".encode() for i in range(5)]
    redis_client.set(key(store, old), old, ex=60)
    redis_client.set(key(store, longer), longer, ex=store.blob_ttl_s * 10)
    store.put({blob_digest(d): d for d in [old, longer, *new]})
    assert dict(store.get(blob_digest(d) for d in [old, longer, *new])) == {
        blob_digest(d): d for d in [old, longer, *new]
    }
    for data in [old, *new]:
        assert store.blob_ttl_s - 5 <= redis_client.ttl(key(store, data)) <= store.blob_ttl_s
    assert redis_client.ttl(key(store, longer)) > store.blob_ttl_s * 9


def test_put_refuses_bytes_that_are_not_their_digests_unless_the_caller_verified_them(
    store: BlobStore, redis_client: redis.Redis
) -> None:
    with pytest.raises(WorkspaceError, match="its bytes have digest"):
        store.put({blob_digest(b"a"): b"b"})
    assert not redis_client.exists(store.keys.blob(store.scope, blob_digest(b"a")))
    store.put({blob_digest(b"c"): b"c"}, verified=True)
    assert dict(store.get([blob_digest(b"c")])) == {blob_digest(b"c"): b"c"}


def test_the_scripts_are_loaded_again_when_redis_forgot_them(store: BlobStore, redis_client: redis.Redis) -> None:
    store.put({blob_digest(b"x"): b"x"})
    redis_client.script_flush()
    assert store.missing([blob_digest(b"x"), blob_digest(b"y")]) == [blob_digest(b"y")]
    redis_client.script_flush()
    store.put({blob_digest(b"y"): b"y"})
    assert store.missing([blob_digest(b"y")]) == []

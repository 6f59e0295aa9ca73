"""Workspace blobs on a real Redis: which are missing, storing them (at once, or streamed as a launch reads them),
and their TTLs (renewed, never shortened)."""

from __future__ import annotations

import os

import pytest
import redis

from broker_config.settings import Settings
from workers.base.keys import Keys
from workers.errors import WorkspaceError
from workers.store import blobs as blobs_module
from workers.store.blobs import BlobStore, BlobStream
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


def sent_to_redis(redis_client: redis.Redis) -> int:
    """Bytes Redis has read from its clients so far."""
    return int(redis_client.info("stats")["total_net_input_bytes"])


def test_a_stream_stores_each_blob_once_and_renews_the_ones_redis_had_without_shortening_a_ttl(
    store: BlobStore, redis_client: redis.Redis
) -> None:
    old, longer = b"old blob", b"longer blob"
    redis_client.set(key(store, old), old, ex=60)
    redis_client.set(key(store, longer), longer, ex=store.blob_ttl_s * 10)
    new = [f"new {i}".encode() for i in range(8)]
    large = os.urandom(blobs_module.JOIN_BELOW + 1)  # asked about, then sent as it is
    every = [old, longer, *new, large]
    with BlobStream(store) as stream:
        stream.add([(blob_digest(d), d) for d in [old, *new[:4]]])
        stream.add([(blob_digest(d), d) for d in [longer, *new[4:], new[0], large, large]])
    assert stream.stored == {blob_digest(d) for d in every}
    assert dict(store.get(blob_digest(d) for d in every)) == {blob_digest(d): d for d in every}
    for data in [old, *new, large]:
        assert store.blob_ttl_s - 5 <= redis_client.ttl(key(store, data)) <= store.blob_ttl_s
    assert redis_client.ttl(key(store, longer)) > store.blob_ttl_s * 9


def test_a_stream_sends_no_large_blob_redis_already_holds_but_sends_small_ones_unasked(
    store: BlobStore, redis_client: redis.Redis
) -> None:
    large, small = os.urandom(blobs_module.SEND_UNASKED + 1), b"small"
    store.put({blob_digest(large): large})
    before = sent_to_redis(redis_client)
    with BlobStream(store) as stream:
        stream.add([(blob_digest(large), large), (blob_digest(small), small)])
    assert stream.sent_bytes == len(small) and stream.stored == {blob_digest(large), blob_digest(small)}
    assert sent_to_redis(redis_client) - before < len(large)
    assert dict(store.get([blob_digest(small)])) == {blob_digest(small): small}


def test_a_stream_whose_writes_redis_refuses_raises_when_closed(store: BlobStore, redis_client: redis.Redis) -> None:
    redis_client.config_set("maxmemory", 1)  # every write refused (noeviction)
    try:
        with pytest.raises(redis.ResponseError, match="maxmemory"), BlobStream(store) as stream:
            stream.add([(blob_digest(b"refused"), b"refused")])
    finally:
        redis_client.config_set("maxmemory", 0)
    assert store.missing([blob_digest(b"refused")]) == [blob_digest(b"refused")]


def test_get_fetches_batch_after_batch_in_order_and_raises_for_a_blob_gone_from_a_later_one(
    store: BlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs_module, "BATCH_KEYS", 3)
    datas = [f"blob {i}".encode() for i in range(10)]
    store.put({blob_digest(d): d for d in datas})
    assert list(store.get(blob_digest(d) for d in datas)) == [(blob_digest(d), d) for d in datas]
    with pytest.raises(WorkspaceError, match="is not in Redis"):
        list(store.get([*(blob_digest(d) for d in datas), blob_digest(b"never stored")]))

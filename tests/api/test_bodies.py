"""Request bodies of the HTTP API: gzip, the size limit on what is sent and on what it inflates to, other encodings.

`Inflater` on its own (a gzip bomb is cut off at the limit), then through uvicorn serving the API.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.api_support import FORK, Api, no_keys_written
from workers.api.bodies import Inflater
from workers.errors import RequestRefused

MiB = 1024 * 1024


def bomb(inflated: int) -> bytes:
    """A gzip stream of `inflated` zero bytes (about a thousandth of that, compressed), built without holding them."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(MiB)
    parts = [packer.compress(block) for _ in range(inflated // MiB)]
    return b"".join([*parts, packer.flush()])


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """64 MiB of zeros, gzipped to about 64 KiB: 64 times the limit of the tests' servers, once inflated."""
    return bomb(64 * MiB)


# ── Inflater ──────────────────────────────────────────────────────────────────────────────────


def test_inflater_decodes_gzip_fed_in_pieces() -> None:
    data = json.dumps({"history": ["x" * 1000] * 50}).encode()
    packed = gzip.compress(data)
    inflater = Inflater(limit=len(data))

    out = b"".join(inflater.feed(packed[i : i + 100]) for i in range(0, len(packed), 100))
    inflater.finish()

    assert out == data


def test_inflater_cuts_a_gzip_bomb_off_one_byte_past_the_limit_without_inflating_the_rest(gzip_bomb: bytes) -> None:
    packed = gzip_bomb
    inflater = Inflater(limit=MiB)

    with pytest.raises(RequestRefused) as refused:
        inflater.feed(packed)

    assert refused.value.status == 413
    assert inflater.size == MiB + 1  # it asked zlib for at most one byte past the limit
    assert len(packed) < MiB // 8  # small enough to pass the limit on what is sent


@pytest.mark.parametrize(
    ("packed", "words"),
    [
        (gzip.compress(b"{}")[:-4], "truncated"),
        (b"not gzip at all", "not valid gzip"),
        (gzip.compress(b"{}") + gzip.compress(b"{}"), "data after its end"),
    ],
    ids=["truncated", "not-gzip", "two-streams"],
)
def test_inflater_refuses_gzip_that_is_not_one_whole_stream_with_400(packed: bytes, words: str) -> None:
    inflater = Inflater(limit=MiB)

    with pytest.raises(RequestRefused) as refused:
        inflater.feed(packed)
        inflater.finish()

    assert refused.value.status == 400 and words in str(refused.value)


# ── through the API ───────────────────────────────────────────────────────────────────────────


@pytest.fixture
def small_api(serve_api: Callable[..., Api]) -> Api:
    """The API with a body limit of 1 MiB."""
    return serve_api(api_max_body_bytes=MiB)


def test_a_gzip_body_launches_like_a_plain_one(http: Any, parent: dict[str, Any]) -> None:
    body = gzip.compress(json.dumps({"parent": parent, "agent": FORK}).encode())

    response = http.post(
        "/v1/forks", content=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
    )

    assert response.status_code == 202, response.text
    assert http.get(f"/v1/forks/{response.json()['fork_id']}").json()["description"] == FORK["description"]


def test_a_body_over_the_limit_is_refused_with_413_and_nothing_written(
    small_api: Api, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    big = {**parent, "system_instruction": "x" * (MiB + 10)}
    unchanged = no_keys_written(redis_client)

    with small_api.client() as http:
        plain = http.post("/v1/forks", json={"parent": big, "agent": FORK})
        # the same body compressed passes the limit on what is sent, not the one on what it inflates to
        packed = gzip.compress(json.dumps({"parent": big, "agent": FORK}).encode())
        inflated = http.post(
            "/v1/forks", content=packed, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )

    assert len(packed) < MiB
    for response in (plain, inflated):
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["status"] == 413 and "FORKQ_API_MAX_BODY_BYTES" in error["message"]
    assert "(decompressed)" in inflated.json()["error"]["message"]
    unchanged()


def test_a_gzip_bomb_is_refused_with_413(small_api: Api, redis_client: redis.Redis, gzip_bomb: bytes) -> None:
    unchanged = no_keys_written(redis_client)

    with small_api.client() as http:
        response = http.post(
            "/v1/forks",
            content=gzip_bomb,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )

    assert response.status_code == 413
    assert "(decompressed)" in response.json()["error"]["message"]
    unchanged()


def test_a_body_sent_in_chunks_without_a_length_is_counted_as_it_arrives(small_api: Api) -> None:
    pieces = (b"x" * 65536 for _ in range(32))  # 2 MiB, no Content-Length: chunked transfer encoding

    with small_api.client() as http:
        response = http.post("/v1/forks", content=pieces, headers={"Content-Type": "application/json"})

    assert response.status_code == 413
    assert "(as sent)" in response.json()["error"]["message"]


@pytest.mark.parametrize("encoding", ["br", "deflate", "gzip, br"])
def test_a_body_in_another_encoding_is_refused_with_415(http: Any, parent: dict[str, Any], encoding: str) -> None:
    response = http.post(
        "/v1/forks",
        content=json.dumps({"parent": parent, "agent": FORK}).encode(),
        headers={"Content-Encoding": encoding, "Content-Type": "application/json"},
    )

    assert response.status_code == 415
    assert response.json()["error"] == {
        "status": 415,
        "message": f"Content-Encoding {encoding!r} is not supported; send the body plain or gzip",
        "field": None,
    }


def test_a_gzip_approval_decision_is_read_too(http: Any, parent: dict[str, Any]) -> None:
    fork_id = http.post("/v1/forks", json={"parent": parent, "agent": FORK}).json()["fork_id"]

    response = http.post(
        f"/v1/forks/{fork_id}/approvals/w1",
        content=gzip.compress(b'{"decision": "approve"}'),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )

    assert response.status_code == 409  # read and understood: the fork is just not parked
    assert "not awaiting approval" in response.json()["error"]["message"]

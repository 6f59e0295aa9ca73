"""Bearer tokens of the HTTP API: FORKQ_API_TOKENS (plain and `sha256:` entries), and every endpoint behind them
but /healthz; a request without a valid token is answered 401 before its body is read, and writes nothing."""

from __future__ import annotations

import hashlib
import json
import socket
from typing import Any

import pytest
import redis
from pydantic import SecretStr

from broker_config.settings import load_settings
from tests.api_support import FORK, HASHED_TOKEN, TOKEN, Api, no_keys_written
from workers.api.auth import TokenSet
from workers.errors import ConfigurationError

GUARDED = [
    ("GET", "/v1/forks/f-1"),
    ("GET", "/v1/forks/f-1/result"),
    ("GET", "/v1/forks/f-1/notification"),
    ("GET", "/v1/forks/f-1/events"),
    ("GET", "/v1/forks/f-1/transcript"),
    ("POST", "/v1/forks/f-1/cancel"),
    ("POST", "/v1/forks/f-1/approvals/c1"),
    ("GET", "/v1/sessions/s-1/forks"),
    ("GET", "/openapi.json"),
    ("GET", "/v1/nothing"),
]


def test_a_launch_without_a_token_is_401_and_writes_nothing(
    api: Api, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    unchanged = no_keys_written(redis_client)

    with api.client(token=None) as anonymous:
        response = anonymous.post("/v1/forks", json={"parent": parent, "agent": FORK})

    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="forkq"'
    assert response.json() == {
        "error": {
            "status": 401,
            "message": "no bearer token: send `Authorization: Bearer <token>` with a token of FORKQ_API_TOKENS",
            "field": None,
        }
    }
    unchanged()


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer wrong",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Basic {TOKEN}",
        f"Bearer sha256:{hashlib.sha256(HASHED_TOKEN.encode()).hexdigest()}",  # the stored hash is not a token
        f"Bearer {hashlib.sha256(HASHED_TOKEN.encode()).hexdigest()}",
        "Bearer",
    ],
)
def test_a_wrong_token_is_401_and_writes_nothing(
    api: Api, redis_client: redis.Redis, parent: dict[str, Any], authorization: str
) -> None:
    unchanged = no_keys_written(redis_client)

    with api.client(token=None, headers={"Authorization": authorization}) as caller:
        response = caller.post("/v1/forks", json={"parent": parent, "agent": FORK})

    assert response.status_code == 401
    assert response.json()["error"]["status"] == 401 and TOKEN not in response.text
    unchanged()


def test_a_token_configured_as_its_sha256_is_accepted(api: Api, parent: dict[str, Any]) -> None:
    with api.client(token=HASHED_TOKEN) as caller:
        launched = caller.post("/v1/forks", json={"parent": parent, "agent": FORK})
        state = caller.get(f"/v1/forks/{launched.json()['fork_id']}")

    assert (launched.status_code, state.status_code) == (202, 200)


def test_every_endpoint_but_healthz_needs_a_token(api: Api) -> None:
    with api.client(token=None) as anonymous:
        answers = {(method, path): anonymous.request(method, path).status_code for method, path in GUARDED}
        health = anonymous.get("/healthz")

    assert answers == {endpoint: 401 for endpoint in GUARDED}
    assert health.status_code == 200


def test_the_body_of_a_request_without_a_token_is_never_read(api: Api) -> None:
    # Given a request that announces a 10 GB body and sends none of it
    host, port = api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/forks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000000\r\n\r\n"
        )

        # Then the answer comes at once: 401, without waiting for the body
        answer = ""
        while not answer.endswith("}}") and (received := conn.recv(65536)):
            answer += received.decode()

    assert answer.startswith("HTTP/1.1 401")
    assert json.loads(answer.split("\r\n\r\n", 1)[1])["error"]["status"] == 401


def test_an_api_without_tokens_serves_anyone_only_when_asked_to(serve_api: Any, parent: dict[str, Any]) -> None:
    api = serve_api(require_auth=False)

    with api.client(token=None) as anonymous:
        response = anonymous.post("/v1/forks", json={"parent": parent, "agent": FORK})

    assert response.status_code == 202


# ── TokenSet and the setting ──────────────────────────────────────────────────────────────────


def test_token_entries_are_trimmed_empty_ones_dropped_and_hashes_read_in_either_case() -> None:
    digest = hashlib.sha256(b"second").hexdigest().upper()
    tokens = TokenSet.parse(SecretStr(f" first ,, sha256:{digest} ,"))

    assert len(tokens.digests) == 2
    assert tokens.match(b"first") is not None and tokens.match(b"second") is not None
    assert tokens.match(b"first") != tokens.match(b"second")
    assert tokens.match(b" first") is None and tokens.match(b"third") is None
    assert not TokenSet.parse(None) and not TokenSet.parse(SecretStr(" , "))


def test_a_non_ascii_token_matches_its_utf8_bytes() -> None:
    tokens = TokenSet.parse(SecretStr("clé-ünïcode"))

    assert tokens.match("clé-ünïcode".encode()) is not None


@pytest.mark.parametrize("entry", ["sha256:abc", "sha256:" + "g" * 64, "sha256:" + "a" * 65, "sha256:"])
def test_a_hash_entry_that_is_not_64_hex_digits_is_a_configuration_error_that_shows_no_token(entry: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_settings(api_tokens=f"secret-token-1,{entry}")

    assert refused.value.field == "FORKQ_API_TOKENS"
    assert "64 hex digits" in str(refused.value) and "secret-token-1" not in str(refused.value)


def test_the_tokens_setting_never_prints_its_value() -> None:
    settings = load_settings(api_tokens="secret-token-1")

    assert "secret-token-1" not in repr(settings) and "secret-token-1" not in str(settings.model_dump())

"""Budgets over HTTP: a session's budget set and read, a fork's budgets, and bad input refused with 422 naming the
field (nothing written). A fork paused by a budget and resumed by its raise: tests/e2e/test_typescript_client.py,
whose live test runs through this API."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis

from tests.api_support import FORK, no_keys_written


def test_a_session_budget_is_set_and_read_with_its_limit_used_and_left(http: httpx.Client) -> None:
    assert http.get("/v1/sessions/s-http/budget").json() == {
        "session": "s-http",
        "tokens": None,
        "used": 0,
        "left": None,
        "resumed": [],
    }

    answer = http.put("/v1/sessions/s-http/budget", json={"tokens": 5000})

    assert answer.status_code == 200, answer.text
    assert answer.json() == {"session": "s-http", "tokens": 5000, "used": 0, "left": 5000, "resumed": []}
    assert http.get("/v1/sessions/s-http/budget").json()["tokens"] == 5000


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"tokens": -1}, "tokens", "greater than or equal to 0"),
        ({"tokens": "many"}, "tokens", "valid integer"),
        ({"tokens": 1.5}, "tokens", "valid integer"),
        ({"tokens": True}, "tokens", "valid integer"),
        ({"tokens": 10**15 + 1}, "tokens", "less than or equal to"),
        ({}, "tokens", "is required"),
        ({"tokens": 5, "usd": 1}, "usd", "is not known"),
    ],
)
def test_a_budget_that_is_not_a_whole_number_of_tokens_is_422_naming_the_field_and_nothing_is_written(
    http: httpx.Client, redis_client: redis.Redis, body: dict[str, Any], field: str, says: str
) -> None:
    check = no_keys_written(redis_client)

    answer = http.put("/v1/sessions/s-http/budget", json=body)

    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == field and says in error["message"], error
    check()


def test_a_session_id_with_braces_is_422(http: httpx.Client) -> None:
    assert http.put("/v1/sessions/a%7Bb%7D/budget", json={"tokens": 5}).status_code == 422


def test_a_launch_option_max_tokens_reaches_the_forks_budget_and_a_bad_one_is_422_naming_it(
    http: httpx.Client, parent: dict[str, Any], redis_client: redis.Redis
) -> None:
    check = no_keys_written(redis_client)
    bad = http.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": {"max_tokens": 0}})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "max_tokens", bad.text
    assert "max_tokens must be a positive whole number of tokens" in bad.json()["error"]["message"]
    check()

    launched = http.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": {"max_tokens": 900}})
    fork_id = launched.json()["fork_id"]
    budget = http.get(f"/v1/forks/{fork_id}/budget").json()

    assert budget == {
        "fork_id": fork_id,
        "max_tokens": 900,
        "used": 0,
        "left": 900,
        "session": {"session": parent["session_id"], "tokens": None, "used": 0, "left": None, "resumed": []},
    }
    assert http.get("/v1/forks/f-never-launched/budget").status_code == 404

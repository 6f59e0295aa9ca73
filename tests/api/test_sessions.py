"""`POST /v1/sessions/{id}/cancel` over HTTP with a live worker: a parked and a running fork of the session end
cancelled, keeping their usage; a launch into the session is then 409 and writes nothing, with an Idempotency-Key
too; another session is untouched; an invalid session id is 422."""

from __future__ import annotations

from typing import Any

import httpx
import redis
from celery.worker import WorkController

from tests.api.test_routes import error_of, launch
from tests.api_support import FORK, no_keys_written, wait_status
from tests.cli_support import call, step
from tests.conftest import TEST_NAMESPACE

SESSION = "s-api-cancel"


def test_a_session_cancel_ends_its_forks_and_refuses_launches_into_it_with_409(
    http: httpx.Client,
    scripted_worker: Any,
    parent: dict[str, Any],
    work: Any,
    redis_client: redis.Redis,
) -> None:
    # Given a worker whose model runs a shell command, slowly, then answers; a fork of the session parked on that
    # command, one running it (yolo), and a fork of another session parked too
    worker: WorkController = scripted_worker(
        [step(call("s1", "run_shell_command", command="echo hi"), delay_s=0.2)] * 50 + [step("done")]
    )
    assert worker is not None
    asks = {**parent, "session_id": SESSION, "cwd": str(work), "approval_mode": "default"}
    parked = launch(http, asks, approval_policy="park", workspace="shared")
    running = launch(http, {**asks, "approval_mode": "yolo"}, workspace="shared")
    other = launch(http, {**asks, "session_id": "s-api-other"}, approval_policy="park", workspace="shared")
    for fork_id in (parked, other):
        wait_status(http, fork_id, "awaiting_approval")
    wait_status(http, running, "running")

    # When the session is cancelled over HTTP
    response = http.post(f"/v1/sessions/{SESSION}/cancel")

    # Then both of its forks were cancelled by it; the running one keeps its usage; the other session's waits on
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"session", "cancelled", "forks", "already_ended", "refused_until_ms"}
    assert (body["session"], body["cancelled"], body["forks"], body["already_ended"]) == (
        SESSION,
        2,
        [parked, running],
        0,
    )
    result = http.get(f"/v1/forks/{running}/result").json()
    assert result["status"] == "cancelled" and result["usage"]["model_calls"] >= 1
    assert http.get(f"/v1/forks/{other}").json()["status"] == "awaiting_approval"

    # and a launch into it, with an Idempotency-Key or without, is 409 naming the session and writes nothing (a
    # shared workspace: a snapshot one's files, content-addressed and shared by launches, are stored before it)
    before = set(redis_client.keys(f"{TEST_NAMESPACE}:*"))
    for headers in ({}, {"Idempotency-Key": "after-the-cancel"}):
        request = {"parent": asks, "agent": FORK, "options": {"workspace": "shared"}}
        refused = http.post("/v1/forks", json=request, headers=headers)
        error = error_of(refused, 409)
        assert error["field"] == "session_id" and f"session '{SESSION}' was cancelled" in error["message"]
        assert "new session id" in error["message"]
    assert set(redis_client.keys(f"{TEST_NAMESPACE}:*")) - before == set()  # the worker's own keys may come and go

    # and a second cancel finds both ended
    again = http.post(f"/v1/sessions/{SESSION}/cancel").json()
    assert (again["cancelled"], again["forks"], again["already_ended"]) == (0, [], 2)
    http.post(f"/v1/forks/{other}/cancel")


def test_a_session_cancel_of_an_invalid_session_id_is_422_and_writes_nothing(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    unchanged = no_keys_written(redis_client)

    response = http.post("/v1/sessions/has%20space/cancel")

    error = error_of(response, 422)
    assert error["field"] == "session_id"
    unchanged()

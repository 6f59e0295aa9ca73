"""The HTTP API end to end: uvicorn serving `make_api`, a live worker, the private Redis, httpx as the client.

Launch, result (long poll), state, notification, transcript, cancel, approvals on a parked fork, a session's
forks, invalid input (422, nothing written), idempotency keys, /healthz and /openapi.json. The token check:
test_auth.py; bodies (gzip, limits): test_bodies.py; event streams: test_sse.py; `forkq serve`
itself: test_server.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery.worker import WorkController
from openapi_spec_validator import validate

from tests.api_support import FORK, TOKEN, Api, no_keys_written, wait_status
from tests.cli_support import call, step
from tests.conftest import TEST_NAMESPACE
from workers.client import ForkClient
from workers.errors import InvalidAgentParams, InvalidParentSnapshot
from workers.history.params import MSG_FORK_TURNS_VALUE
from workers.records.fork import Status

SECRET_KEY = "sk-never-in-a-response-0123456789"


def launch(http: httpx.Client, parent: dict[str, Any], agent: dict[str, Any] | None = None, **options: Any) -> str:
    """POST /v1/forks; the new fork's id (asserting the 202)."""
    response = http.post("/v1/forks", json={"parent": parent, "agent": agent or FORK, "options": options})
    assert response.status_code == 202, response.text
    assert response.headers["location"] == f"/v1/forks/{response.json()['fork_id']}"
    return str(response.json()["fork_id"])


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The error of a response in the one error shape, checking its status."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"status", "message", "field"}
    assert body["error"]["status"] == status
    return dict(body["error"])


# ── launch → result ───────────────────────────────────────────────────────────────────────────


def test_a_launch_over_http_runs_to_the_result_and_state_the_cli_prints(
    http: httpx.Client, live_worker: WorkController, client: ForkClient, parent: dict[str, Any]
) -> None:
    response = http.post("/v1/forks", json={"parent": parent, "agent": {**FORK, "fork_turns": "1"}})
    assert response.status_code == 202
    fork_id = response.json()["fork_id"]
    assert response.json() == {"fork_id": fork_id, "status": "queued"}

    result = http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20})

    assert result.status_code == 200, result.text
    expected = client.result(fork_id)
    assert expected is not None and expected.status is Status.SUCCEEDED
    assert result.json() == {
        "fork_id": fork_id,
        "status": "succeeded",
        "output": expected.output,
        "usage": expected.usage.model_dump(),
        "error": None,
    }
    assert "directive: Write the expiry tests." in result.json()["output"]
    state = http.get(f"/v1/forks/{fork_id}")
    assert state.status_code == 200 and state.json() == client.status(fork_id).model_dump(mode="json")


def test_a_result_wait_that_runs_out_answers_202_with_the_state(http: httpx.Client, parent: dict[str, Any]) -> None:
    fork_id = launch(http, parent)  # no worker: it stays queued

    started = time.monotonic()
    response = http.get(f"/v1/forks/{fork_id}/result", params={"wait": 0.5})
    waited = time.monotonic() - started

    assert response.status_code == 202
    assert (response.json()["fork_id"], response.json()["status"]) == (fork_id, "queued")
    assert 0.5 <= waited < 3
    assert http.get(f"/v1/forks/{fork_id}/result").status_code == 202  # no wait: at once


def test_a_result_wait_returns_as_soon_as_the_fork_ends(
    http: httpx.Client, live_worker: WorkController, parent: dict[str, Any]
) -> None:
    fork_id = launch(http, parent)

    started = time.monotonic()
    response = http.get(f"/v1/forks/{fork_id}/result", params={"wait": 60})

    assert response.status_code == 200 and response.json()["status"] == "succeeded"
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("wait", ["60.5", "-1", "nan", "soon"])
def test_a_wait_over_60_seconds_or_not_a_number_is_refused_with_422(
    http: httpx.Client, parent: dict[str, Any], wait: str
) -> None:
    fork_id = launch(http, parent)

    error = error_of(http.get(f"/v1/forks/{fork_id}/result", params={"wait": wait}), 422)

    assert error["field"] == "wait"


def test_an_unknown_fork_is_404_and_an_invalid_id_422_in_the_one_error_shape(http: httpx.Client) -> None:
    missing = error_of(http.get("/v1/forks/f-nothing-here"), 404)
    invalid = error_of(http.get("/v1/forks/-bad"), 422)
    no_route = error_of(http.get("/v1/nothing"), 404)

    assert missing == {
        "status": 404,
        "message": "fork f-nothing-here: not found (never launched, or past its retention)",
        "field": None,
    }
    assert invalid["field"] == "fork_id"
    assert no_route["field"] is None
    for path in ("result", "notification", "transcript", "events"):
        assert error_of(http.get(f"/v1/forks/f-nothing-here/{path}"), 404)["message"].startswith("fork f-nothing-here")
    assert error_of(http.post("/v1/forks/f-nothing-here/cancel"), 404)["message"].startswith("fork f-nothing-here")


# ── invalid input: 422 with the Python API's message, nothing written ─────────────────────────


def python_error(client: ForkClient, parent: dict[str, Any], agent: dict[str, Any], **options: Any) -> Exception:
    """The error `ForkClient.launch` raises for the same launch."""
    try:
        client.launch(parent, agent, **options)
    except (InvalidAgentParams, InvalidParentSnapshot) as exc:
        return exc
    raise AssertionError("the launch was not refused")


BAD_LAUNCHES = {  # (Agent call, change to the parent snapshot, launch options, the field the error names)
    "fork-turns-0": ({**FORK, "fork_turns": "0"}, {}, {}, "fork_turns"),
    "fork-turns-teammate": ({**FORK, "fork_turns": "3", "name": "reviewer"}, {}, {}, "fork_turns"),
    "no-description": ({"prompt": "no description"}, {}, {}, "description"),
    "bad-history": (FORK, {"history": [{"role": "robot", "parts": []}]}, {}, "history[0]"),
    "bad-session": (FORK, {"session_id": "has spaces"}, {}, "session_id"),
    "max-turns-0": (FORK, {}, {"max_turns": 0}, "max_turns"),
    "approval-policy": (FORK, {}, {"approval_policy": "ask"}, "approval_policy"),
    "fork-id": (FORK, {}, {"fork_id": "../escape"}, "fork_id"),
}


@pytest.mark.parametrize("case", sorted(BAD_LAUNCHES))
def test_invalid_input_gets_422_with_the_python_apis_message_and_nothing_is_written(
    http: httpx.Client, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any], case: str
) -> None:
    agent, parent_change, options, field = BAD_LAUNCHES[case]
    bad_parent = {**parent, **parent_change}
    unchanged = no_keys_written(redis_client)
    expected = python_error(client, bad_parent, agent, **options)

    plain = http.post("/v1/forks", json={"parent": bad_parent, "agent": agent, "options": options})
    keyed = http.post(
        "/v1/forks",
        json={"parent": bad_parent, "agent": agent, "options": options},
        headers={"Idempotency-Key": "bad-input-1"},
    )

    for response in (plain, keyed):
        assert error_of(response, 422) == {"status": 422, "message": str(expected), "field": field}
    unchanged()
    assert redis_client.llen(client.settings.queue) == 0


def test_the_fork_turns_message_is_the_contracts_own(http: httpx.Client, parent: dict[str, Any]) -> None:
    error = error_of(http.post("/v1/forks", json={"parent": parent, "agent": {**FORK, "fork_turns": "x"}}), 422)

    assert (error["message"], error["field"]) == (MSG_FORK_TURNS_VALUE, "fork_turns")


WRONG_SHAPES = [  # (body beside the parent, the field named, words of the message)
    ({"agent": FORK, "options": {"bogus": 1}}, "options.bogus", "launch option 'bogus' is not known"),
    ({"agent": FORK, "extra": 1}, "extra", "body field 'extra' is not known"),
    ({"options": {}}, "agent", "body field 'agent' is required"),
    ({"agent": "not an object"}, "agent", "body field 'agent': Input should be a valid dictionary"),
]


@pytest.mark.parametrize("case", WRONG_SHAPES, ids=["option", "extra", "missing", "not-object"])
def test_a_body_of_the_wrong_shape_is_refused_with_422_naming_the_field(
    http: httpx.Client, redis_client: redis.Redis, parent: dict[str, Any], case: tuple[dict[str, Any], str, str]
) -> None:
    body, field, words = case
    unchanged = no_keys_written(redis_client)

    error = error_of(http.post("/v1/forks", json={"parent": parent, **body}), 422)

    assert error["field"] == field and words in error["message"]
    unchanged()


def test_a_body_that_is_not_json_is_refused_with_422(http: httpx.Client, redis_client: redis.Redis) -> None:
    error = error_of(http.post("/v1/forks", content=b"{not json", headers={"Content-Type": "application/json"}), 422)

    assert error["message"].startswith("the request body is not JSON")
    assert redis_client.dbsize() == 0


def test_the_subagent_options_reach_the_record_and_a_capability_the_mode_lacks_is_422(
    http: httpx.Client, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    # a completed-turn fork with a persona, a tool filter and a depth limit
    options = {
        "seed_mode": "completed_turns",
        "persona": "You write release notes.",
        "tool_filter": ["read_file"],
        "max_depth": 1,
    }
    fork_id = launch(http, parent, **options)
    record = client.inspect(fork_id)
    assert (record["seed_mode"], record["persona"], record["tool_filter"], record["max_depth"]) == (
        "completed_turns",
        True,
        ["read_file"],
        1,
    )
    assert record["system_instruction"] == "You write release notes."

    # a persona for a fork_turns fork: the Python API's message, and nothing written
    before = redis_client.dbsize()
    error = error_of(http.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": {"persona": "x"}}), 422)
    assert error["field"] == "persona" and "keeps the parent's system prompt byte for byte" in error["message"]
    assert redis_client.dbsize() == before


def test_launch_options_reach_the_bootstrap_record(
    http: httpx.Client, client: ForkClient, parent: dict[str, Any]
) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    options = {
        "approval_policy": "park",
        "output_schema": schema,
        "max_turns": 7,
        "max_wall_s": 90,
        "fork_id": "f-mine",
    }

    fork_id = launch(http, parent, **options)

    taken = http.post("/v1/forks", json={"parent": parent, "agent": {**FORK, "prompt": "Other."}, "options": options})
    record = client.inspect(fork_id)
    assert fork_id == "f-mine"
    assert "a different bootstrap record already exists" in error_of(taken, 409)["message"]
    assert {name: record[name] for name in options if name != "fork_id"} == {
        "approval_policy": "park",
        "output_schema": schema,
        "max_turns": 7,
        "max_wall_s": 90,
    }


# ── idempotency keys ──────────────────────────────────────────────────────────────────────────


def test_an_idempotency_key_with_the_same_body_returns_the_same_fork_and_another_body_409(
    http: httpx.Client, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    body = {"parent": parent, "agent": FORK, "options": {"max_turns": 5}}
    key = {"Idempotency-Key": "launch-0001"}

    first = http.post("/v1/forks", json=body, headers=key)
    # the same body, its keys in another order: the same canonical JSON
    again = http.post(
        "/v1/forks",
        content=json.dumps(dict(reversed(body.items()))),
        headers={**key, "Content-Type": "application/json"},
    )
    other = http.post("/v1/forks", json={**body, "options": {"max_turns": 6}}, headers=key)
    fresh = http.post("/v1/forks", json=body, headers={"Idempotency-Key": "launch-0002"})

    fork_id = first.json()["fork_id"]
    assert first.status_code == 202 and "idempotent-replayed" not in first.headers
    assert again.status_code == 200 and again.json() == {"fork_id": fork_id, "status": "queued"}
    assert again.headers["idempotent-replayed"] == "true"
    error = error_of(other, 409)
    assert error["field"] == "Idempotency-Key" and fork_id in error["message"]
    assert fresh.status_code == 202 and fresh.json()["fork_id"] != fork_id
    states = [k for k in redis_client.keys(f"{client.settings.namespace}:*:state")]
    assert len(states) == 2
    assert redis_client.llen(client.settings.queue) == 2  # one job per fork: the repeat sent none
    ttl = redis_client.ttl(client.store.keys.idempotency(_key_digest("launch-0001")))
    assert 0 < ttl <= client.settings.api_idempotency_ttl_s


def _key_digest(key: str) -> str:
    from workers.api.auth import TokenSet
    from workers.api.launches import key_digest

    caller = TokenSet.parse(__import__("pydantic").SecretStr(TOKEN)).match(TOKEN.encode())
    assert caller is not None
    return key_digest(caller.token_id, key)


def test_concurrent_launches_with_one_idempotency_key_to_two_servers_make_one_fork(
    serve_api: Callable[..., Api], client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    servers = [serve_api(), serve_api()]  # stateless: two servers on one Redis
    body = {"parent": parent, "agent": FORK}
    answers: list[httpx.Response] = []
    gate = threading.Barrier(8)

    def send(api: Api) -> None:
        with api.client() as http:
            gate.wait()
            answers.append(http.post("/v1/forks", json=body, headers={"Idempotency-Key": "race"}))

    threads = [threading.Thread(target=send, args=(servers[i % 2],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert sorted(a.status_code for a in answers) == [200] * 7 + [202]
    assert len({a.json()["fork_id"] for a in answers}) == 1
    assert len(redis_client.keys(f"{client.settings.namespace}:*:state")) == 1


def test_two_callers_with_different_tokens_do_not_share_an_idempotency_key(api: Api, parent: dict[str, Any]) -> None:
    from tests.api_support import HASHED_TOKEN

    body = {"parent": parent, "agent": FORK}
    with api.client() as one, api.client(HASHED_TOKEN) as other:
        first = one.post("/v1/forks", json=body, headers={"Idempotency-Key": "k"})
        second = other.post("/v1/forks", json={**body, "options": {"max_turns": 2}}, headers={"Idempotency-Key": "k"})

    assert (first.status_code, second.status_code) == (202, 202)
    assert first.json()["fork_id"] != second.json()["fork_id"]


# ── a fork that ended: notification and transcript ────────────────────────────────────────────


def test_the_notification_is_409_until_the_fork_ends_then_the_task_notification(
    http: httpx.Client,
    client: ForkClient,
    start_live_worker: Callable[..., WorkController],
    app: Any,
    parent: dict[str, Any],
) -> None:
    fork_id = launch(http, parent)
    early = error_of(http.get(f"/v1/forks/{fork_id}/notification"), 409)

    start_live_worker(app)
    assert http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20}).status_code == 200
    response = http.get(f"/v1/forks/{fork_id}/notification")

    assert "is queued: it has no result to notify yet" in early["message"]
    assert response.status_code == 200
    assert response.json() == {
        "fork_id": fork_id,
        "status": "succeeded",
        "notification": client.notification(fork_id),
    }
    assert response.json()["notification"].startswith("<task-notification>")


def test_the_transcript_of_a_fork_whose_record_names_a_seed_index_shows_its_whole_seed(
    http: httpx.Client, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    # Given a queued fork of a long history: its record names its seed chunks through an index chunk
    turns = [
        {"role": r, "parts": [{"text": f"{r} {i} " + "words " * (i % 30)}]}
        for i in range(150)
        for r in ("user", "model")
    ]
    fork_id = launch(http, {**parent, "history": [*turns, *parent["history"]]})
    stored = redis_client.get(f"{TEST_NAMESPACE}:{{{fork_id}}}:bootstrap") or b""
    assert b"seed_index" in stored and b"seed_chunks" not in stored

    transcript = http.get(f"/v1/forks/{fork_id}/transcript").json()

    assert transcript["seed"]["messages"] > 300


PARKING = [
    step(call("w1", "write_file", path="a.txt", content="a" * 50)),
    step(call("s1", "run_shell_command", command="true")),
]


def parked_fork(http: httpx.Client, parent: dict[str, Any], work: Path) -> str:
    """A fork parked on a file edit (approval mode default, approval policy park), acting on `work` in place."""
    parked = {**parent, "cwd": str(work), "approval_mode": "default"}
    fork_id = launch(http, parked, approval_policy="park", workspace="shared")
    wait_status(http, fork_id, "awaiting_approval")
    return fork_id


def test_a_parked_fork_is_approved_and_denied_over_http_and_its_transcript_shows_every_step(
    http: httpx.Client,
    scripted_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    work: Path,
) -> None:
    # Given a fork parked on a write_file call, whose next step is a shell command, then a final answer
    scripted_worker([*PARKING, step("all done")])
    fork_id = parked_fork(http, parent, work)

    # When the result is asked for, it comes back at once with the state and the pending call
    started = time.monotonic()
    parked = http.get(f"/v1/forks/{fork_id}/result", params={"wait": 30})
    assert time.monotonic() - started < 5
    assert parked.status_code == 202 and parked.json()["status"] == "awaiting_approval"
    assert [(c["call_id"], c["name"]) for c in parked.json()["pending_approval"]] == [("w1", "write_file")]
    # what it waits for has its own field: the calls to decide, and no error
    state = http.get(f"/v1/forks/{fork_id}").json()
    assert state["waiting_for"] == {"kind": "approval", "calls": [{"call_id": "w1", "name": "write_file"}]}
    assert state["error"] is None

    # Then a person approves it, and denies the shell command it parks on next
    approved = http.post(f"/v1/forks/{fork_id}/approvals/w1", json={"decision": "approve"})
    assert approved.status_code == 200
    assert approved.json() == {
        "fork_id": fork_id,
        "call_id": "w1",
        "decision": "approve",
        "outcome": "queued",
        "status": "queued",
    }
    wait_status(http, fork_id, "awaiting_approval")
    unknown = error_of(http.post(f"/v1/forks/{fork_id}/approvals/nope", json={"decision": "deny"}), 409)
    denied = http.post(f"/v1/forks/{fork_id}/approvals/s1", json={"decision": "deny", "reason": "not here"})
    assert denied.json()["outcome"] == "queued" and "no pending call 'nope'" in unknown["message"]

    # And the fork ends; its transcript shows the calls, the decisions and the results, in order
    result = http.get(f"/v1/forks/{fork_id}/result", params={"wait": 30})
    assert result.status_code == 200 and result.json()["output"] == "all done"
    assert (work / "a.txt").read_text() == "a" * 50
    transcript = http.get(f"/v1/forks/{fork_id}/transcript", params={"max_chars": 10}).json()
    assert transcript["seed"]["settings"]["approval_policy"] == "park"
    assert transcript["seed"]["messages"] > 0 and "write_file" in transcript["seed"]["tools"]
    kinds = [(s["kind"], s.get("call_id")) for s in transcript["steps"]]
    assert kinds == [
        ("model", None),
        ("approval", "w1"),
        ("tool_result", "w1"),
        ("model", None),
        ("approval", "s1"),
        ("tool_result", "s1"),
        ("model", None),
    ]
    steps = transcript["steps"]
    assert steps[0]["calls"] == [
        {"call_id": "w1", "name": "write_file", "args": {"path": "a.txt", "content": "a" * 50}}
    ]
    assert (steps[4]["decision"], steps[4]["reason"]) == ("deny", "not here")
    assert steps[5]["truncated"] is True and len(steps[5]["error"]) == 10 and steps[5]["chars"] > 10
    assert steps[6]["text"] == "all done" and "calls" in steps[6] and "output" not in steps[6]


def test_an_approval_body_must_say_approve_or_deny(http: httpx.Client, parent: dict[str, Any]) -> None:
    fork_id = launch(http, parent)

    error = error_of(http.post(f"/v1/forks/{fork_id}/approvals/w1", json={"decision": "maybe"}), 422)
    not_parked = error_of(http.post(f"/v1/forks/{fork_id}/approvals/w1", json={"decision": "approve"}), 409)

    assert error["field"] == "decision"
    assert "is queued, not awaiting approval" in not_parked["message"]


# ── cancel ────────────────────────────────────────────────────────────────────────────────────


def test_cancel_answers_the_status_after_and_a_second_cancel_changes_nothing(
    http: httpx.Client, parent: dict[str, Any]
) -> None:
    fork_id = launch(http, parent)

    first = http.post(f"/v1/forks/{fork_id}/cancel")
    second = http.post(f"/v1/forks/{fork_id}/cancel")
    result = http.get(f"/v1/forks/{fork_id}/result")

    assert first.status_code == 200 and first.json() == {"fork_id": fork_id, "status": "cancelled"}
    assert second.json() == {"fork_id": fork_id, "status": "cancelled"}
    assert result.status_code == 200 and result.json()["error"] == "cancelled by request"


# ── a session's forks ─────────────────────────────────────────────────────────────────────────


def test_a_sessions_forks_are_listed_newest_first_with_their_kind_name_and_status(
    http: httpx.Client, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    first = launch(http, parent)
    teammate = launch(http, parent, {"description": "review", "prompt": "Review it.", "name": "reviewer"})
    http.post(f"/v1/forks/{first}/cancel")
    other = launch(http, {**parent, "session_id": "another-session"})

    listing = http.get(f"/v1/sessions/{parent['session_id']}/forks")
    newest = http.get(f"/v1/sessions/{parent['session_id']}/forks", params={"limit": 1})

    assert listing.status_code == 200
    forks = listing.json()["forks"]
    assert [f["fork_id"] for f in forks] == [teammate, first] and other not in str(forks)
    assert {k: forks[0][k] for k in ("kind", "name", "description", "status")} == {
        "kind": "spawn",
        "name": "reviewer",
        "description": "review",
        "status": "queued",
    }
    assert (forks[1]["kind"], forks[1]["name"], forks[1]["status"]) == ("fork", None, "cancelled")
    assert forks[1]["updated_ms"] > forks[1]["created_ms"] > 0  # the cancel came after the launch
    assert [f["fork_id"] for f in newest.json()["forks"]] == [teammate]
    index = client.store.keys.session_forks(parent["session_id"])
    assert 0 < redis_client.ttl(index) <= client.settings.record_ttl_s
    assert http.get("/v1/sessions/nobody/forks").json() == {"session_id": "nobody", "forks": []}
    assert error_of(http.get("/v1/sessions/a%20b/forks"), 422)["field"] == "session_id"


# ── health, schema, secrets ───────────────────────────────────────────────────────────────────


def test_healthz_needs_no_token_and_reports_redis_fit(api: Api) -> None:
    with api.client(token=None) as anonymous:
        response = anonymous.get("/healthz")

    assert response.status_code == 200
    assert response.json() == {"ok": True, "redis_reachable": True, "redis_fit": True}


def test_healthz_is_503_when_redis_is_unreachable(serve_api: Callable[..., Api]) -> None:
    api = serve_api(redis_url="redis://127.0.0.1:1/0")

    with api.client(token=None) as anonymous:
        response = anonymous.get("/healthz")

    assert response.status_code == 503
    assert response.json() == {"ok": False, "redis_reachable": False, "redis_fit": False}


def test_a_redis_outage_is_503_in_the_one_error_shape(serve_api: Callable[..., Api]) -> None:
    api = serve_api(redis_url="redis://127.0.0.1:1/0")

    with api.client() as http:
        error = error_of(http.get("/v1/forks/f-1"), 503)

    assert error["message"].startswith("Redis error:")


def test_a_damaged_record_or_an_unexpected_failure_is_500_in_the_one_error_shape(
    http: httpx.Client, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    damaged, odd = launch(http, parent), launch(http, parent)
    # a RecordDecodeError: the pending calls of a parked fork are read, and these are not JSON
    redis_client.hset(client.store.keys.state(damaged), mapping={"status": "awaiting_approval", "pending": "not json"})
    redis_client.hset(client.store.keys.state(odd), "status", "sleeping")  # no Status: a ValueError

    record_error = error_of(http.get(f"/v1/forks/{damaged}"), 500)
    unexpected = error_of(http.get(f"/v1/forks/{odd}"), 500)

    assert record_error["message"].startswith(f"fork {damaged}: the pending calls of its state are not")
    assert unexpected["message"] == "internal error (ValueError); the server's log has the details"


def test_the_openapi_document_is_valid_and_names_every_endpoint_and_the_bearer_scheme(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()

    validate(document)
    assert set(document["paths"]) == {
        "/v1/forks",
        "/v1/forks/{fork_id}",
        "/v1/forks/{fork_id}/result",
        "/v1/forks/{fork_id}/notification",
        "/v1/forks/{fork_id}/events",
        "/v1/forks/{fork_id}/transcript",
        "/v1/forks/{fork_id}/cancel",
        "/v1/forks/{fork_id}/approvals/{call_id}",
        "/v1/sessions/{session_id}/forks",
        "/v1/sessions/{session_id}/cancel",
        "/v1/sessions/{session_id}/budget",
        "/v1/forks/{fork_id}/budget",
        "/v1/forks/{fork_id}/messages",
        "/v1/agents",
        "/v1/providers",
        "/v1/workspaces",
        "/v1/workspaces/blobs/{digest}",
        "/v1/forks/{fork_id}/changes",
        "/healthz",
    }
    assert document["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "A token of FORKQ_API_TOKENS.",
    }
    launch_op = document["paths"]["/v1/forks"]["post"]
    assert launch_op["security"] == [{"HTTPBearer": []}]
    assert "security" not in document["paths"]["/healthz"]["get"]
    assert launch_op["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"
    }
    options = document["components"]["schemas"]["LaunchOptions"]
    assert options["additionalProperties"] is False
    assert options["properties"]["max_turns"]["type"] == "integer"


def test_no_response_carries_an_api_key_of_the_servers_settings(
    serve_api: Callable[..., Api], start_live_worker: Callable[..., WorkController], app: Any, parent: dict[str, Any]
) -> None:
    api = serve_api(openai_api_key=SECRET_KEY, gemini_api_key=SECRET_KEY)
    start_live_worker(app)
    with api.client() as http:
        fork_id = launch(http, parent)
        bodies = [http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20}).text]
        for path in ("", "/notification", "/transcript"):
            bodies.append(http.get(f"/v1/forks/{fork_id}{path}").text)
        bodies += [http.get("/openapi.json").text, http.get("/healthz").text]

    assert all(SECRET_KEY not in body for body in bodies)


def test_a_message_continues_a_succeeded_fork_over_http_and_an_ended_one_is_409(
    http: httpx.Client, scripted_worker: Callable[..., WorkController], parent: dict[str, Any]
) -> None:
    # Given a fork cancelled before any worker ran, a fork that answered once, and an answer for its continuation
    other = launch(http, parent)
    http.post(f"/v1/forks/{other}/cancel")
    scripted_worker([step("first answer"), step("second answer")])
    fork_id = launch(http, parent)
    first = http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20})
    assert first.status_code == 200 and first.json()["output"] == "first answer"

    # When a message is posted to it
    sent = http.post(f"/v1/forks/{fork_id}/messages", json={"text": "And then?"})

    # Then it was continued, and its result is the new answer
    assert sent.status_code == 202 and sent.json() == {"fork_id": fork_id, "outcome": "continued", "waiting": 1}
    second = http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20}).json()
    assert second["output"] == "second answer"

    # and an empty message is 422 naming the field, a cancelled fork's message 409, an unknown fork's 404
    assert error_of(http.post(f"/v1/forks/{fork_id}/messages", json={"text": " "}), 422)["field"] == "message"
    assert (
        "takes no more messages"
        in error_of(http.post(f"/v1/forks/{other}/messages", json={"text": "x"}), 409)["message"]
    )
    error_of(http.post("/v1/forks/f-nope/messages", json={"text": "x"}), 404)


def test_the_transcript_shows_the_message_that_continued_a_fork_between_its_answers(
    http: httpx.Client, scripted_worker: Callable[..., WorkController], parent: dict[str, Any]
) -> None:
    # Given a fork that answered, was sent a message, and answered again
    scripted_worker([step("first answer"), step("second answer")])
    fork_id = launch(http, parent)
    assert http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20}).json()["output"] == "first answer"
    assert http.post(f"/v1/forks/{fork_id}/messages", json={"text": "And then?"}).status_code == 202
    assert http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20}).json()["output"] == "second answer"

    # When its transcript is read
    transcript = http.get(f"/v1/forks/{fork_id}/transcript").json()

    # Then the delivered message stands between the two answers, as a step of its own
    steps = [(s["kind"], s["step"], s.get("text")) for s in transcript["steps"]]
    assert steps == [("model", 0, "first answer"), ("message", 1, "And then?"), ("model", 1, "second answer")]
    message = transcript["steps"][1]
    assert set(message) == {"seq", "step", "kind", "text"}


def test_agents_and_providers_are_listed_over_http(http: httpx.Client) -> None:
    agents = http.get("/v1/agents")
    providers = http.get("/v1/providers")
    assert agents.status_code == providers.status_code == 200
    assert {"Explore", "general-purpose"} <= {a["name"] for a in agents.json()["items"]}
    assert [p["name"] for p in providers.json()["items"]] == ["spawn", "fork"]

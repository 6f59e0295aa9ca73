"""The HTTP API against its contract: its OpenAPI document validates and declares what the server answers.

A property-based run (schemathesis, over the document `make_api` builds, the one `/openapi.json` serves) sends
every operation requests generated from its schema, valid and not, to uvicorn serving the API on the private
Redis beside a live worker: no answer may be a 5xx, a status the document does not declare for the operation,
a body that breaks its declared schema, or a content type it does not declare. The tests after it pin each
thing that run found.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from api_support import FORK, wait_status
from celery.worker import WorkController
from cli_support import step

# ── what the run found ────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"parent": "\xff\xfe"}', "byte 0xff at offset 12 is not UTF-8"),
        (b"[" * 100_000, "it nests too deeply"),
    ],
    ids=["not-utf-8", "nested-too-deep"],
)
def test_a_body_that_cannot_be_decoded_as_json_is_422_saying_why_not_a_400_the_document_does_not_declare(
    http: httpx.Client, body: bytes, message: str
) -> None:
    response = http.post("/v1/forks", content=body, headers={"Content-Type": "application/json"})

    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["status"] == 422 and error["field"] is None
    assert message in error["message"] and error["message"].startswith("the request body is not JSON")


def test_a_transcript_keeps_the_nulls_its_schema_requires(
    http: httpx.Client, scripted_worker: Callable[..., WorkController], parent: dict[str, Any]
) -> None:
    # Given a fork launched without fork_turns, whose model makes a call without an id
    scripted_worker([step({"functionCall": {"name": "list_directory", "args": {"dir_path": "."}}}), step("done")])
    fork_id = http.post("/v1/forks", json={"parent": parent, "agent": FORK}).json()["fork_id"]
    wait_status(http, fork_id, "succeeded")

    transcript = http.get(f"/v1/forks/{fork_id}/transcript").json()

    # Then the nulls the schema requires are there, and a step still has the fields of its kind only
    assert transcript["seed"]["fork_turns"] is None
    first = transcript["steps"][0]
    assert first["kind"] == "model" and first["calls"][0]["call_id"] is None
    assert "output" not in first and "decision" not in first


@pytest.mark.parametrize("control", ["%1C", "%1D", "%1E", "%1F"])
def test_a_session_id_with_a_separator_control_character_is_422_not_a_500(http: httpx.Client, control: str) -> None:
    # Python's `\s` holds these characters, pydantic-core's does not: the path check let them through to the
    # Redis key check, whose ValueError was a 500
    response = http.get(f"/v1/sessions/wr1{control}x/forks")

    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "session_id"

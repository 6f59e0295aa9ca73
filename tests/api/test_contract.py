"""The HTTP API against its contract: its OpenAPI document validates and declares what the server answers.

A property-based run (schemathesis, over the document `make_api` builds, the one `/openapi.json` serves) sends
every operation requests generated from its schema, valid and not, to uvicorn serving the API on the private
Redis beside a live worker: no answer may be a 5xx, a status the document does not declare for the operation,
a body that breaks its declared schema, or a content type it does not declare. The tests after it pin each
thing that run found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from celery.worker import WorkController
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from broker_config.settings import Settings
from tests.api_support import FORK, TOKEN, Api, wait_status
from tests.cli_support import step
from workers.api.app import make_api

AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
# the document of a server that checks tokens; it depends on nothing else of the settings
DOCUMENT = make_api(Settings(api_tokens=TOKEN)).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)


@dataclass(frozen=True)
class Known:
    """Ids that exist on the live server, so that generated requests reach more than the 404 of a random id."""

    fork_ids: tuple[str, ...]
    session_id: str


@pytest.fixture
def live_api(
    serve_api: Callable[..., Api], scripted_worker: Callable[..., WorkController], parent: dict[str, Any]
) -> tuple[Api, Known]:
    """The API beside a live worker, with a succeeded fork and a cancelled one (ended: their event streams end)."""
    scripted_worker([step("done")])
    api = serve_api()
    with api.client() as http:
        ids = [http.post("/v1/forks", json={"parent": parent, "agent": FORK}).json()["fork_id"] for _ in range(2)]
        wait_status(http, ids[0], "succeeded")
        http.post(f"/v1/forks/{ids[1]}/cancel")
        assert http.get(f"/v1/forks/{ids[1]}/result").status_code == 200
    return api, Known(fork_ids=tuple(ids), session_id=str(parent["session_id"]))


def use_known(case: Any, known: Known, pick: int | None) -> None:
    """Point the case's fork id (or session id) at a known one when `pick` says which; None keeps the generated."""
    if pick is None or not case.path_parameters:
        return
    if "fork_id" in case.path_parameters:
        case.path_parameters["fork_id"] = known.fork_ids[pick % len(known.fork_ids)]
    if "session_id" in case.path_parameters:
        case.path_parameters["session_id"] = known.session_id


@schema.parametrize()
@schema.given(pick=st.one_of(st.none(), st.integers(0, 1)))
@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
def test_no_generated_request_gets_a_5xx_or_an_answer_the_document_does_not_declare(
    case: Any, pick: int | None, live_api: tuple[Api, Known]
) -> None:
    api, known = live_api
    use_known(case, known, pick)
    # the events of a fork end with it (both known forks have ended; a generated id is a 404); a long poll
    # waits at most 60 s, and the known forks answer it at once
    case.call_and_validate(base_url=api.url, headers=AUTH, checks=CHECKS, timeout=75)


def test_the_openapi_document_validates_and_is_the_one_served(http: httpx.Client) -> None:
    validate(DOCUMENT)
    assert http.get("/openapi.json").json() == DOCUMENT


def test_every_operation_declares_its_errors_in_the_one_error_shape() -> None:
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, operations in DOCUMENT["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            expected = {"500"} if path == "/healthz" else {"401", "422", "500", "503"}
            if "{fork_id}" in path:
                expected.add("404")
            if method in ("post", "put"):  # a body is read, bounded and decoded before the endpoint sees it
                expected |= {"400", "413", "415"}
            assert expected <= set(responses), f"{method} {path} declares {sorted(responses)}"
            for status in expected:
                assert responses[status]["content"]["application/json"]["schema"] == error_ref, (method, path, status)


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


def test_the_event_stream_is_documented_as_the_event_union_with_each_types_data_typed() -> None:
    from workers.records.events import EVENT_TYPES

    schemas = DOCUMENT["components"]["schemas"]
    ok = DOCUMENT["paths"]["/v1/forks/{fork_id}/events"]["get"]["responses"]["200"]
    union = schemas["ForkEvent"]  # what clients' types are made from
    assert union["discriminator"]["propertyName"] == "type"
    assert set(union["discriminator"]["mapping"]) == EVENT_TYPES
    for kind, ref in union["discriminator"]["mapping"].items():
        member = schemas[ref.rsplit("/", 1)[1]]
        assert member["properties"]["type"]["const"] == kind
        data = schemas[member["properties"]["data"]["$ref"].rsplit("/", 1)[1]]
        assert data["type"] == "object" and "properties" in data, kind
    # and each message of the stream is one of them: `event` its type, `data` its data as JSON
    [media] = ok["content"]
    messages = ok["content"][media]["schema"]["oneOf"]
    assert media == "text/event-stream" and len(messages) == len(EVENT_TYPES)
    for message in messages:
        kind = message["properties"]["event"]["const"]
        member = schemas[union["discriminator"]["mapping"][kind].rsplit("/", 1)[1]]
        assert message["properties"]["data"]["contentSchema"] == member["properties"]["data"], kind

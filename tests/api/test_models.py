"""The API's launch request (workers/api/models.py): the domain's models, and the digest its idempotency keys keep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from workers.api.models import LaunchRequest
from workers.errors import InvalidAgentParams, InvalidParentSnapshot
from workers.history.params import MSG_FORK_TURNS_VALUE, AgentParams, agent_tool_schema
from workers.history.snapshot import ParentSnapshot
from workers.subagents.launch import LaunchOptions

PARENT = json.loads((Path(__file__).resolve().parents[2] / "workers" / "examples" / "parent.json").read_text())
AGENT = {"description": "d", "prompt": "Audit.", "subagent_type": "fork", "fork_turns": "3"}


def test_a_launch_request_holds_the_domains_own_models() -> None:
    request = LaunchRequest.model_validate({"parent": PARENT, "agent": AGENT, "options": {"seed_mode": "fork-turns"}})

    assert isinstance(request.agent, AgentParams) and request.agent.turns == 3
    assert isinstance(request.parent, ParentSnapshot) and isinstance(request.options, LaunchOptions)
    assert request.options.seed_mode == "fork_turns"


def test_the_request_schema_is_made_of_the_domains_schemas_and_the_agent_tools_own() -> None:
    schema = LaunchRequest.model_json_schema()

    refs = {name: schema["properties"][name].get("$ref", "") for name in ("agent", "options", "parent")}
    assert refs == {
        "agent": "#/$defs/AgentParams",
        "options": "#/$defs/LaunchOptions",
        "parent": "#/$defs/ParentSnapshot",
    }
    assert schema["$defs"]["AgentParams"] == agent_tool_schema()


@pytest.mark.parametrize(
    ("body", "error", "field"),
    [
        ({"agent": {**AGENT, "fork_turns": "0"}}, InvalidAgentParams, "fork_turns"),
        ({"options": {"max_turns": "many"}}, InvalidAgentParams, "max_turns"),
        ({"parent": {**PARENT, "depth": "0"}}, InvalidParentSnapshot, "depth"),
    ],
)
def test_a_broken_rule_raises_the_domains_error_not_a_validation_error(
    body: dict[str, Any], error: type[Exception], field: str
) -> None:
    with pytest.raises(error) as caught:
        LaunchRequest.model_validate({"parent": PARENT, "agent": AGENT, **body})

    assert getattr(caught.value, "field", None) == field
    if field == "fork_turns":
        assert str(caught.value) == MSG_FORK_TURNS_VALUE


@pytest.mark.parametrize(
    ("body", "digest"),
    [  # the digests a server computed when the request's parts were plain JSON (an Idempotency-Key keeps one)
        (
            {"parent": PARENT, "agent": AGENT, "options": {"approval_policy": "park", "max_turns": 40}},
            "aa0792cfe34c3cbf453ee163d38600e54089a68a6336c03c17536ac1d2c12ec6",
        ),
        (
            {"parent": PARENT, "agent": {"description": "d", "prompt": "p"}},
            "ddea774f7476e33437a98aaa67b3cbc249b55e446f1c3864d38315ae7d30514c",
        ),
    ],
)
def test_a_bodys_digest_is_the_one_earlier_servers_computed(body: dict[str, Any], digest: str) -> None:
    assert LaunchRequest.model_validate(body).digest == digest


def test_equal_bodies_however_ordered_have_one_digest_and_another_body_another() -> None:
    body = {"parent": PARENT, "agent": AGENT, "options": {"max_turns": 40}}
    reordered = {"options": {"max_turns": 40}, "agent": dict(reversed(AGENT.items())), "parent": PARENT}

    assert LaunchRequest.model_validate(body).digest == LaunchRequest.model_validate(reordered).digest
    other = {**body, "options": {"max_turns": 41}}
    assert LaunchRequest.model_validate(other).digest != LaunchRequest.model_validate(body).digest

"""Launch plans through `ForkClient.launch` on a real Redis: definitions, seed modes, persona, tool filter,
capabilities and max_depth, recorded in the bootstrap record, or refused before anything is written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from broker_config.settings import Settings
from workers.client import ForkClient
from workers.errors import InvalidAgentDefinition, InvalidAgentParams
from workers.history.params import MSG_SEED_MODE_FORK_TOOLS, MSG_SEED_MODE_FORK_TURNS, MSG_SEED_MODE_NOT_FORK
from workers.subagents.capabilities import providers
from workers.subagents.definitions import EXPLORE_PROMPT

REVIEWER = """---
name: code-reviewer
description: Reviews a change.
tools: [read_file, grep_search, no_such_tool]
model: reviewer-model
max_turns: 7
---
You review code.
"""
SPAWN = {"description": "look around", "prompt": "Describe the layout.", "subagent_type": "Explore"}
FORK = {"description": "fork it", "prompt": "Write the tests.", "subagent_type": "fork"}


@pytest.fixture
def agents_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "agents"
    folder.mkdir()
    (folder / "code-reviewer.md").write_text(REVIEWER, encoding="utf-8")
    return folder


@pytest.fixture
def launcher(make_settings: Callable[..., Settings], agents_dir: Path, app: Any) -> ForkClient:
    """A client reading `agents_dir` (the jobs go to the test app's broker; no worker consumes them)."""
    return ForkClient(make_settings(agents_dir=agents_dir), app=app)


def tool_names(record: dict[str, Any]) -> list[str]:
    return [t["name"] for t in record["tools"] if "name" in t]


def keys(redis_client: redis.Redis) -> set[bytes]:
    return set(redis_client.keys("*"))


def test_a_defined_subagent_records_its_persona_tools_model_and_turns(launcher: ForkClient, parent: dict) -> None:
    handle = launcher.launch(parent, {**SPAWN, "subagent_type": "code-reviewer"}, max_turns=50)
    record = launcher.inspect(handle.fork_id)
    assert record["kind"] == "spawn"
    assert record["system_instruction"] == "You review code."
    assert tool_names(record) == ["read_file", "grep_search"]  # the parent's order; undeclared ones left out
    assert record["model"] == "reviewer-model"
    assert record["initial_messages"] == [] and record["task_prompt"] == SPAWN["prompt"]
    assert record["agent"] == "code-reviewer" and record["agent_source"] == "code-reviewer.md"
    assert record["max_turns"] == 7  # the lower of the definition's and the launch's


def test_the_agent_calls_model_overrides_the_definitions(launcher: ForkClient, parent: dict) -> None:
    params = {**SPAWN, "subagent_type": "code-reviewer", "model": "call-model"}
    assert launcher.inspect(launcher.launch(parent, params).fork_id)["model"] == "call-model"


def test_explore_is_read_only_and_general_purpose_keeps_todays_scope(launcher: ForkClient, parent: dict) -> None:
    explore = launcher.inspect(launcher.launch(parent, SPAWN).fork_id)
    assert explore["system_instruction"] == EXPLORE_PROMPT
    assert tool_names(explore) == ["read_file", "list_directory", "glob", "grep_search"]
    general = launcher.inspect(launcher.launch(parent, {**SPAWN, "subagent_type": "general-purpose"}).fork_id)
    assert general["system_instruction"] == parent["system_instruction"]
    assert tool_names(general) == [t["name"] for t in parent["tools"]]  # the Agent tool included, as before
    assert general["model"] == parent["model"]
    teammate = launcher.inspect(launcher.launch(parent, {"description": "d", "prompt": "p", "name": "ann"}).fork_id)
    assert teammate["agent"] == "general-purpose"


def test_an_unknown_subagent_type_is_refused_listing_the_known_ones_and_writes_nothing(
    launcher: ForkClient, parent: dict, redis_client: redis.Redis
) -> None:
    before = keys(redis_client)
    with pytest.raises(InvalidAgentParams) as caught:
        launcher.launch(parent, {**SPAWN, "subagent_type": "reviewer"})
    assert caught.value.field == "subagent_type"
    assert '"code-reviewer", "Explore", "general-purpose", and "fork"' in str(caught.value)
    assert keys(redis_client) == before


def test_a_definition_read_at_launch_is_kept_when_the_file_changes_later(
    launcher: ForkClient, parent: dict, agents_dir: Path
) -> None:
    handle = launcher.launch(parent, {**SPAWN, "subagent_type": "code-reviewer"})
    (agents_dir / "code-reviewer.md").write_text(REVIEWER.replace("You review code.", "Changed."), encoding="utf-8")
    assert launcher.inspect(handle.fork_id)["system_instruction"] == "You review code."
    later = launcher.launch(parent, {**SPAWN, "subagent_type": "code-reviewer"})
    assert launcher.inspect(later.fork_id)["system_instruction"] == "Changed."


def test_a_malformed_definition_file_fails_the_launch_naming_the_file(
    launcher: ForkClient, parent: dict, agents_dir: Path, redis_client: redis.Redis
) -> None:
    (agents_dir / "broken.md").write_text("---\nname: broken\n---\nbody\n", encoding="utf-8")
    before = keys(redis_client)
    with pytest.raises(InvalidAgentDefinition, match=r"broken\.md: `description` is required"):
        launcher.launch(parent, SPAWN)
    assert keys(redis_client) == before


def test_a_completed_turn_fork_runs_in_a_fresh_scope(launcher: ForkClient, parent: dict) -> None:
    yolo = {**parent, "approval_mode": "yolo"}
    record = launcher.inspect(launcher.launch(yolo, FORK, seed_mode="completed_turns").fork_id)
    assert record["kind"] == "fork"
    assert record["seed_mode"] == "completed_turns"
    assert record["approval_mode"] == "default"  # never the parent's permissive mode
    assert record["system_instruction"] == parent["system_instruction"]  # general-purpose's: the parent's
    assert "Agent" not in tool_names(record)  # a fork cannot spawn
    assert tool_names(record) == [t["name"] for t in parent["tools"] if t["name"] != "Agent"]


def test_a_fork_turns_fork_keeps_the_parents_declarations_byte_for_byte(launcher: ForkClient, parent: dict) -> None:
    record = launcher.inspect(launcher.launch({**parent, "approval_mode": "yolo"}, FORK).fork_id)
    assert record["tools"] == parent["tools"]
    assert record["approval_mode"] == "yolo"
    assert record["seed_mode"] == "fork_turns"


def test_persona_and_tool_filter_compose_in_a_completed_turn_forks_scope(launcher: ForkClient, parent: dict) -> None:
    handle = launcher.launch(
        parent, FORK, seed_mode="completed-turns", persona="You are a test writer.", tool_filter=["read_file", "edit"]
    )
    record = launcher.inspect(handle.fork_id)
    assert record["system_instruction"] == "You are a test writer."
    assert tool_names(record) == ["read_file", "edit"]
    assert record["tool_filter"] == ["read_file", "edit"] and record["persona"] is True


@pytest.mark.parametrize(
    "case",
    [
        (FORK, {"persona": "You are x."}, "persona", "keeps the parent's system prompt byte for byte"),
        (FORK, {"tool_filter": ["read_file"]}, "tool_filter", '"fork_tools"'),
        ({**FORK, "fork_turns": "2"}, {"seed_mode": "completed_turns"}, "fork_turns", MSG_SEED_MODE_FORK_TURNS),
        (
            {**FORK, "fork_tools": ["read_file"]},
            {"seed_mode": "completed_turns"},
            "fork_tools",
            MSG_SEED_MODE_FORK_TOOLS,
        ),
        (SPAWN, {"seed_mode": "completed_turns"}, "seed_mode", MSG_SEED_MODE_NOT_FORK),
        (SPAWN, {"seed_mode": "completed"}, "seed_mode", "must be"),
        (SPAWN, {"tool_filter": ["write_file"]}, "tool_filter", "matches none of this subagent's tools"),
        (SPAWN, {"max_depth": 4}, "max_depth", "limit 3"),
        (SPAWN, {"max_depth": 0}, "max_depth", "from 1"),
    ],
)
def test_a_launch_asking_for_what_its_provider_lacks_is_refused_before_anything_is_written(
    launcher: ForkClient,
    parent: dict,
    redis_client: redis.Redis,
    case: tuple[dict, dict, str, str],
) -> None:
    params, options, field, message = case
    before = keys(redis_client)
    with pytest.raises(InvalidAgentParams) as caught:
        launcher.launch(parent, params, **options)
    assert caught.value.field == field
    assert message in str(caught.value)
    assert keys(redis_client) == before


def test_max_depth_is_recorded_and_lowers_the_nesting_limit(launcher: ForkClient, parent: dict) -> None:
    record = launcher.inspect(launcher.launch(parent, SPAWN, max_depth=2).fork_id)
    assert record["max_depth"] == 2
    deep = {**parent, "depth": 1}
    launcher.launch(deep, SPAWN, max_depth=2)  # the child is at depth 2: allowed
    with pytest.raises(InvalidAgentParams, match=r"Nesting depth limit reached \(max 2\)"):
        launcher.launch({**parent, "depth": 2}, SPAWN, max_depth=2)


def test_agents_and_providers_list_what_a_launch_can_ask_for(launcher: ForkClient) -> None:
    assert [a["name"] for a in launcher.agents()] == ["code-reviewer", "Explore", "general-purpose"]
    assert launcher.providers() == providers()
    fork = next(p for p in providers() if p["name"] == "fork")
    assert fork["capabilities"] == {"outputSchema": True, "depthLimit": True, "toolFilter": True, "persona": True}
    assert fork["seedModes"]["fork_turns"]["persona"] is False
    assert fork["seedModes"]["completed_turns"]["persona"] is True
    spawn = next(p for p in providers() if p["name"] == "spawn")
    assert all(spawn["capabilities"].values())

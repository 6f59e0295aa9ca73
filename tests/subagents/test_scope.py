"""A child's scope: persona, tools and model from its definition, the launch's persona and tool filter."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.errors import InvalidAgentParams
from workers.subagents.definitions import AgentDefinition, built_in_catalog
from workers.subagents.scope import ParentContext, check_persona, check_tool_filter, resolve_scope


def decl(name: str, **params: Any) -> dict[str, Any]:
    return {"name": name, "description": f"the {name} tool", "parameters": {"type": "object", "properties": params}}


AGENT = decl("Agent", prompt={"type": "string"}, subagent_type={"type": "string"})
TASK = decl("Task", prompt={"type": "string"}, subagent_type={"type": "string"})  # an Agent tool by its parameters
TOOLS = [decl("read_file"), decl("grep_search"), decl("write_file"), AGENT, decl("mcp__gh__read_issue")]


def parent(tools: list[dict[str, Any]] = TOOLS, system: Any = "You are the parent.") -> ParentContext:
    return ParentContext(system, tools, json.dumps(tools, separators=(",", ":")), "parent-model")


def names(tools_json: str) -> list[str]:
    out: list[str] = []
    for tool in json.loads(tools_json):
        group = tool.get("functionDeclarations")
        out.extend(d["name"] for d in group) if group is not None else out.append(tool.get("name", "<other>"))
    return out


def definition(**fields: Any) -> AgentDefinition:
    return AgentDefinition(name="t", description="d", system_prompt="You are t.", **fields)


def test_general_purpose_keeps_the_parents_prompt_tools_bytes_and_model() -> None:
    general = built_in_catalog().find("general-purpose")
    assert general is not None
    context = parent()
    scope = resolve_scope(general, context)
    assert scope.system_instruction == "You are the parent."
    assert scope.tools_json is context.tools_json  # the very bytes: the context chunk is shared with the parent
    assert scope.model == "parent-model"


def test_a_definition_without_tools_gets_every_tool_but_the_agent_tool() -> None:
    scope = resolve_scope(definition(), parent([*TOOLS, TASK]))
    assert names(scope.tools_json) == ["read_file", "grep_search", "write_file", "mcp__gh__read_issue"]
    assert scope.system_instruction == "You are t."


def test_listed_tools_come_in_the_parents_order_and_undeclared_ones_are_left_out() -> None:
    scope = resolve_scope(definition(tools=("grep_search", "read_file", "no_such_tool")), parent())
    assert names(scope.tools_json) == ["read_file", "grep_search"]
    assert json.loads(scope.tools_json)[0] == TOOLS[0]  # the parent's declaration, unchanged


def test_tools_grouped_gemini_style_are_filtered_inside_their_group() -> None:
    grouped = [{"functionDeclarations": [decl("read_file"), decl("write_file"), AGENT]}, {"googleSearch": {}}]
    scope = resolve_scope(definition(), parent(grouped))
    assert json.loads(scope.tools_json) == [
        {"functionDeclarations": [decl("read_file"), decl("write_file")]},
        {"googleSearch": {}},
    ]
    listed = resolve_scope(definition(tools=("write_file",)), parent(grouped))
    assert json.loads(listed.tools_json) == [{"functionDeclarations": [decl("write_file")]}]


def test_the_agent_calls_model_wins_over_the_definitions_which_wins_over_the_parents() -> None:
    assert resolve_scope(definition(model="def-model"), parent(), model="call-model").model == "call-model"
    assert resolve_scope(definition(model="def-model"), parent()).model == "def-model"
    assert resolve_scope(definition(), parent()).model == "parent-model"


def test_a_persona_replaces_the_system_prompt_and_a_tool_filter_narrows_the_tools() -> None:
    scope = resolve_scope(definition(), parent(), persona="You are a pirate.", tool_filter=["read_file", "mcp__gh__*"])
    assert scope.system_instruction == "You are a pirate."
    assert names(scope.tools_json) == ["read_file", "mcp__gh__read_issue"]


def test_a_tool_filter_naming_a_tool_the_child_lacks_is_refused_with_what_it_has() -> None:
    with pytest.raises(InvalidAgentParams, match=r"tool_filter names 'write_file'.*\(read_file, grep_search\)") as err:
        resolve_scope(definition(tools=("read_file", "grep_search")), parent(), tool_filter=["write_file"])
    assert err.value.field == "tool_filter"


def test_without_agent_drops_the_agent_tool_even_from_general_purpose() -> None:
    general = built_in_catalog().find("general-purpose")
    assert general is not None
    scope = resolve_scope(general, parent([*TOOLS, TASK]), without_agent=True)
    assert names(scope.tools_json) == ["read_file", "grep_search", "write_file", "mcp__gh__read_issue"]


@pytest.mark.parametrize("persona", ["", "   ", 7, "x" * (256 * 1024 + 1), "bad \ud800 surrogate"])
def test_an_invalid_persona_is_refused(persona: object) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        check_persona(persona)
    assert caught.value.field == "persona"


@pytest.mark.parametrize("tool_filter", ["read_file", [""], [" read_file"], ["*"], ["read_*"], [3], ["x"] * 1001])
def test_an_invalid_tool_filter_is_refused(tool_filter: object) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        check_tool_filter(tool_filter)
    assert caught.value.field == "tool_filter"


def test_a_valid_tool_filter_keeps_its_order_without_duplicates() -> None:
    assert check_tool_filter(["b", "a", "b", "mcp__*"]) == ("b", "a", "mcp__*")
    assert check_tool_filter([]) == ()
    assert check_tool_filter(None) is None

"""A child's scope: the system instruction, tool declarations and model it runs with, from its definition.

A regular subagent's scope comes from its definition, resolved against what its parent declares: the
definition's persona (or the parent's system instruction, for the built-in general-purpose), the
parent's declarations of the definition's tools (in the parent's order; a listed tool the parent does
not declare is left out, as the reference agents do), and the definition's model. A launch's `persona`
then replaces the system instruction and its `tool_filter` narrows the tools. A completed-turn fork
gets the general-purpose scope without the Agent tool (a fork cannot spawn).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from workers.base.limits import shown, text_problem
from workers.errors import InvalidAgentParams
from workers.history.params import is_agent_tool, is_valid_tool_pattern, tool_allowed
from workers.subagents.definitions import ALL_TOOLS, AgentDefinition

MAX_PERSONA_CHARS: Final = 256 * 1024
MAX_FILTER_ENTRIES: Final = 1000
GROUP_KEYS: Final = ("functionDeclarations", "function_declarations")  # a Gemini `Tool` grouping declarations

Keep = Callable[[str, Mapping[str, Any]], bool]


@dataclass(frozen=True)
class Scope:
    """What a child runs with: its system instruction, its declarations as stored (JSON), its model."""

    system_instruction: str | dict[str, Any] | None
    tools_json: str
    model: str | None


@dataclass(frozen=True)
class ParentContext:
    """The parent's side of a scope: its system instruction, its declarations (parsed and as stored), its model."""

    system_instruction: str | dict[str, Any] | None
    tools: Sequence[Mapping[str, Any]]
    tools_json: str
    model: str | None


def check_persona(persona: object) -> str | None:
    """A launch's persona: None, or a non-empty string within bounds.

    Raises:
        InvalidAgentParams: it is not (`.field` is `persona`).
    """
    if persona is None:
        return None
    if not isinstance(persona, str) or not persona.strip():
        raise InvalidAgentParams(
            f"persona must be a non-empty string (a system prompt), got {shown(persona)}", field="persona"
        )
    if len(persona) > MAX_PERSONA_CHARS:
        raise InvalidAgentParams(
            f"persona is {len(persona):,} characters, more than {MAX_PERSONA_CHARS:,}; shorten it", field="persona"
        )
    problem = text_problem("persona", persona)
    if problem is not None:
        raise InvalidAgentParams(problem, field="persona")
    return persona


def check_tool_filter(tool_filter: object) -> tuple[str, ...] | None:
    """A launch's tool filter: None, or a list of tool names and `mcp__` prefix patterns.

    Raises:
        InvalidAgentParams: it is not (`.field` is `tool_filter`).
    """
    if tool_filter is None:
        return None
    if (
        isinstance(tool_filter, str)
        or not isinstance(tool_filter, list | tuple)
        or len(tool_filter) > MAX_FILTER_ENTRIES
    ):
        raise InvalidAgentParams(
            f"tool_filter must be a list of at most {MAX_FILTER_ENTRIES} tool names, got {shown(tool_filter)}",
            field="tool_filter",
        )
    for entry in tool_filter:
        if not isinstance(entry, str) or not entry or entry != entry.strip() or len(entry) > 200:
            raise InvalidAgentParams(
                f"tool_filter entry {shown(entry)} is not a tool name (non-empty, no surrounding spaces)",
                field="tool_filter",
            )
        if not is_valid_tool_pattern(entry) or entry == ALL_TOOLS:
            raise InvalidAgentParams(
                f'tool_filter entry {shown(entry)}: use exact tool names, "mcp__*" or an MCP prefix pattern such as '
                '"mcp__github__read_*"',
                field="tool_filter",
            )
    return tuple(dict.fromkeys(tool_filter))


def resolve_scope(
    definition: AgentDefinition,
    parent: ParentContext,
    *,
    model: str | None = None,
    persona: str | None = None,
    tool_filter: Sequence[str] | None = None,
    without_agent: bool = False,
) -> Scope:
    """The scope of a child of `parent` under `definition`; `model` is the Agent call's (it wins).

    Raises:
        InvalidAgentParams: `tool_filter` names a tool this child would not have (`.field` is `tool_filter`).
    """
    tools = list(parent.tools)
    if definition.tools is None:
        tools = _keep(tools, lambda name, decl: not is_agent_tool(name, decl), others=True)
    elif definition.tools != (ALL_TOOLS,):
        listed = set(definition.tools)
        tools = _keep(tools, lambda name, _: name in listed, others=False)
    if without_agent:
        tools = _keep(tools, lambda name, decl: not is_agent_tool(name, decl), others=True)
    if tool_filter is not None:
        _check_filter_names(tool_filter, _names(tools))
        tools = _keep(tools, lambda name, _: tool_allowed(name, list(tool_filter)), others=False)
    unchanged = len(tools) == len(parent.tools) and all(a is b for a, b in zip(tools, parent.tools, strict=True))
    return Scope(
        system_instruction=persona if persona is not None else _instruction(definition, parent),
        tools_json=parent.tools_json if unchanged else json.dumps(tools, ensure_ascii=False, separators=(",", ":")),
        model=model or definition.model or parent.model,
    )


def _instruction(definition: AgentDefinition, parent: ParentContext) -> str | dict[str, Any] | None:
    return parent.system_instruction if definition.system_prompt is None else definition.system_prompt


def _keep(tools: Sequence[Mapping[str, Any]], keep: Keep, *, others: bool) -> list[Mapping[str, Any]]:
    """The declarations `keep` accepts, inside Gemini groups too (a group left empty goes); `others`: whether
    tools that declare no function (such as `googleSearch`) stay. An untouched tool stays the same object."""
    kept: list[Mapping[str, Any]] = []
    for tool in tools:
        group = next((k for k in GROUP_KEYS if isinstance(tool.get(k), list)), None)
        if group is not None:
            declared = [d for d in tool[group] if isinstance(d, Mapping)]
            chosen = [d for d in declared if keep(str(d.get("name")), d)]
            if len(chosen) == len(tool[group]):
                kept.append(tool)
            elif chosen:
                kept.append({**tool, group: chosen})
        elif "name" in tool:
            if keep(str(tool["name"]), tool):
                kept.append(tool)
        elif others:
            kept.append(tool)
    return kept


def _names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    names: list[str] = []
    for tool in tools:
        group = next((k for k in GROUP_KEYS if isinstance(tool.get(k), list)), None)
        declared = tool[group] if group is not None else [tool] if "name" in tool else []
        names.extend(str(d.get("name")) for d in declared if isinstance(d, Mapping))
    return names


def _check_filter_names(tool_filter: Sequence[str], names: Sequence[str]) -> None:
    for entry in tool_filter:
        if not any(tool_allowed(name, [entry]) for name in names):
            have = ", ".join(names[:40]) + (", ..." if len(names) > 40 else "") or "none"
            raise InvalidAgentParams(
                f"tool_filter names {shown(entry)}, which matches none of this subagent's tools ({have}); "
                "remove it or fix its spelling",
                field="tool_filter",
            )

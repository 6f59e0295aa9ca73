"""A launch's plan: its checks (nesting, options, capabilities), the child's scope and the options its record keeps.

`ForkClient.launch` (and the HTTP API through it) runs every check here before anything is written:
the Agent call is already valid; this decides the provider (`spawn` or `fork`) and seed mode, refuses
a capability the provider lacks, resolves a regular subagent's definition, and builds the options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.base.keys import FORK_ID_RE
from workers.base.limits import MAX_LAUNCH_TURNS, MAX_LAUNCH_WALL_S, bad_text, nesting_problem, shown, too_deep
from workers.errors import InvalidAgentParams
from workers.history.params import (
    APPROVAL_POLICIES,
    AgentParams,
    SeedMode,
    check_seed_mode,
    depth_error,
)
from workers.history.snapshot import ApprovalMode, ParentSnapshot
from workers.history.structured import check_schema
from workers.records.fork import BootstrapRecord, ForkOptions
from workers.subagents.capabilities import check_capabilities
from workers.subagents.definitions import GENERAL_PURPOSE, AgentDefinition, Catalog
from workers.subagents.scope import ParentContext, Scope, check_persona, check_tool_filter, resolve_scope


def check_nesting(agent: AgentParams, parent_depth: int, max_depth: int) -> None:
    """Only a top-level session (depth 0) may fork; regular subagents nest up to `max_depth`.

    Raises:
        InvalidAgentParams: the launch breaks a nesting rule.
    """
    if agent.is_fork and parent_depth > 0:
        raise InvalidAgentParams(
            f"Cannot spawn sub-agents from within a fork: only a top-level session (depth 0) may fork, and this "
            f"parent is at depth {parent_depth}. Execute the task directly, or launch a regular subagent.",
            field="subagent_type",
        )
    if not agent.is_fork and parent_depth + 1 > max_depth:
        raise InvalidAgentParams(depth_error(max_depth), field="subagent_type")


def check_fork_id(fork_id: object) -> None:
    """A fork id a caller chose must fit the key pattern (it is part of every key); None means a fresh one.

    Raises:
        InvalidAgentParams: it does not (`.field` is `fork_id`).
    """
    if fork_id is not None and not (isinstance(fork_id, str) and FORK_ID_RE.fullmatch(fork_id)):
        raise InvalidAgentParams(
            f"fork_id {shown(fork_id)} is not valid: use 1-128 letters, digits, '_', '.', '-' "
            "starting with a letter or digit, or leave it out for a fresh one",
            field="fork_id",
        )


def launch_options(
    agent: AgentParams,
    *,
    approval_policy: str = "deny",
    output_schema: dict[str, Any] | None = None,
    max_wall_s: float | None = None,
    max_turns: int | None = None,
) -> ForkOptions:
    """The fork-only and launch options a bootstrap record keeps (only those that differ from the defaults).

    Raises:
        InvalidAgentParams: an option is invalid (`.field` names it).
    """
    options: dict[str, Any] = {}
    if agent.fork_tools is not None:
        options["fork_tools"] = list(agent.fork_tools)
    if approval_policy not in APPROVAL_POLICIES:
        raise InvalidAgentParams(
            f"approval_policy must be one of {', '.join(APPROVAL_POLICIES)}, got {shown(approval_policy)}",
            field="approval_policy",
        )
    if approval_policy != "deny":
        options["approval_policy"] = approval_policy
    if output_schema is not None:
        if too_deep(output_schema):  # jsonschema recurses, canonical msgpack stops at 255 levels
            raise InvalidAgentParams(nesting_problem("output_schema"), field="output_schema")
        problem = bad_text("output_schema", output_schema)  # canonical msgpack stores UTF-8 only
        if problem is not None:
            raise InvalidAgentParams(problem, field="output_schema")
        options["output_schema"] = check_schema(output_schema)
    return ForkOptions.model_validate({**options, **_limits(max_wall_s, max_turns)})


def _limits(max_wall_s: float | None, max_turns: int | None) -> dict[str, Any]:
    """A launch's own limits, checked: each positive, finite, at most its bound (workers.base.limits)."""
    options: dict[str, Any] = {}
    if max_wall_s is not None:
        # `not 0 < x <= max` also refuses NaN and infinity, which compare false or past the bound
        if (
            isinstance(max_wall_s, bool)
            or not isinstance(max_wall_s, int | float)
            or not 0 < max_wall_s <= MAX_LAUNCH_WALL_S
        ):
            raise InvalidAgentParams(
                f"max_wall_s must be a positive number of seconds (finite, at most {MAX_LAUNCH_WALL_S:,.0f}); "
                f"got {shown(max_wall_s)}",
                field="max_wall_s",
            )
        options["max_wall_s"] = max_wall_s
    if max_turns is not None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or not 0 < max_turns <= MAX_LAUNCH_TURNS:
            raise InvalidAgentParams(
                f"max_turns must be a positive number of model calls (a whole number, at most {MAX_LAUNCH_TURNS:,}); "
                f"got {shown(max_turns)}",
                field="max_turns",
            )
        options["max_turns"] = max_turns
    return options


def launch_settings(record: BootstrapRecord) -> dict[str, Any]:
    """The launch's own settings a record keeps, every one named (defaults filled in): what `inspect` shows."""
    options = record.options
    return {
        "subagent_type": record.subagent_type,
        "name": record.name,
        "approval_policy": options.approval_policy or "deny",
        "output_schema": options.output_schema,
        "max_wall_s": options.max_wall_s,
        "max_turns": options.max_turns,
        "fork_tools": options.fork_tools,
        "seed_mode": options.seed_mode or "fork_turns",
        "agent": options.agent,
        "agent_source": options.agent_source,
        "persona": bool(options.persona),
        "tool_filter": options.tool_filter,
        "max_depth": options.max_depth,
    }


@dataclass(frozen=True)
class LaunchPlan:
    """What a valid launch writes: the provider, seed mode, scope, approval mode and options of its record."""

    kind: str  # fork | spawn
    seed_mode: SeedMode
    scope: Scope
    approval_mode: ApprovalMode
    options: ForkOptions


@dataclass(frozen=True)
class LaunchAsks:
    """A launch's options beyond the Agent call, as the caller gave them (checked by `plan_launch`)."""

    approval_policy: str = "deny"
    output_schema: dict[str, Any] | None = None
    max_wall_s: float | None = None
    max_turns: int | None = None
    seed_mode: str | None = None
    persona: str | None = None
    tool_filter: list[str] | tuple[str, ...] | None = None
    max_depth: int | None = None


def plan_launch(
    agent: AgentParams,
    parent: ParentSnapshot,
    asks: LaunchAsks,
    *,
    tools_json: str,
    catalog: Callable[[], Catalog],
    depth_limit: int,
) -> LaunchPlan:
    """Check a launch and plan its record; `depth_limit` is the deployment's (FORKQ_MAX_SUBAGENT_DEPTH).

    Raises:
        InvalidAgentParams: a rule is broken (`.field` names the option or parameter).
        InvalidAgentDefinition: the definitions folder holds a malformed file.
    """
    seed_mode = check_seed_mode(asks.seed_mode, agent)
    persona = check_persona(asks.persona)
    tool_filter = check_tool_filter(asks.tool_filter)
    max_depth = check_max_depth(asks.max_depth, depth_limit)
    provider = "fork" if agent.is_fork else "spawn"
    asked = {
        "outputSchema": asks.output_schema is not None,
        "depthLimit": max_depth is not None,
        "toolFilter": tool_filter is not None,
        "persona": persona is not None,
    }
    check_capabilities(provider, seed_mode if agent.is_fork else None, [name for name, on in asked.items() if on])
    check_nesting(agent, parent.depth, min(depth_limit, max_depth or depth_limit))
    options = launch_options(
        agent,
        approval_policy=asks.approval_policy,
        output_schema=asks.output_schema,
        max_wall_s=asks.max_wall_s,
        max_turns=asks.max_turns,
    )
    context = ParentContext(parent.system_instruction, parent.tools, tools_json, parent.model)
    if agent.is_fork and seed_mode == "fork_turns":
        scope = Scope(parent.system_instruction, tools_json, parent.model)
        definition = None
    else:
        definition = _definition(agent, catalog(), seed_mode)
        scope = resolve_scope(
            definition,
            context,
            model=agent.model,
            persona=persona,
            tool_filter=tool_filter,
            without_agent=agent.is_fork,  # a completed-turn fork cannot spawn
        )
    extra: dict[str, Any] = {
        "seed_mode": "completed_turns" if seed_mode == "completed_turns" else None,
        "persona": True if persona is not None else None,
        "tool_filter": None if tool_filter is None else list(tool_filter),
        "max_depth": max_depth,
    }
    if definition is not None:
        extra |= {"agent": definition.name, "agent_source": definition.source}
        if definition.max_turns is not None:  # the lower of the definition's and the launch's
            extra["max_turns"] = min(definition.max_turns, options.max_turns or definition.max_turns)
    options = options.model_copy(update={k: v for k, v in extra.items() if v is not None})
    # a completed-turn fork runs in a fresh scope: never the parent's permissive approval mode
    mode: ApprovalMode = "default" if seed_mode == "completed_turns" else parent.approval_mode
    return LaunchPlan(provider, seed_mode, scope, mode, ForkOptions.model_validate(options.model_dump()))


def _definition(agent: AgentParams, catalog: Catalog, seed_mode: SeedMode) -> AgentDefinition:
    """The definition a regular subagent (or, as general-purpose, a completed-turn fork) runs under.

    Raises:
        InvalidAgentParams: the `subagent_type` has no definition; the message lists the known ones.
    """
    wanted = GENERAL_PURPOSE if seed_mode == "completed_turns" else agent.subagent_type
    found = catalog.find(wanted)
    if found is None:
        known = ", ".join(f'"{name}"' for name in catalog.names())
        raise InvalidAgentParams(
            f'Unknown subagent_type {shown(wanted)}: the known types are {known}, and "fork" for a fork of this '
            "conversation. Use one of them, or add a definition file to FORKQ_AGENTS_DIR.",
            field="subagent_type",
        )
    return found


def check_max_depth(max_depth: object, depth_limit: int) -> int | None:
    """A launch's `max_depth`: None, or a whole number from 1 to the deployment's limit.

    Raises:
        InvalidAgentParams: it is not (`.field` is `max_depth`).
    """
    if max_depth is None:
        return None
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 1 <= max_depth <= depth_limit:
        raise InvalidAgentParams(
            f"max_depth must be a whole number from 1 to this deployment's limit {depth_limit} "
            f"(FORKQ_MAX_SUBAGENT_DEPTH); got {shown(max_depth)}. It can lower the nesting limit, never raise it.",
            field="max_depth",
        )
    return max_depth

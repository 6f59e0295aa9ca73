"""A launch's options and plan: its checks (options, nesting, capabilities), the child's scope and the options
its record keeps.

`ForkClient.launch` (and the HTTP API, whose request holds a `LaunchOptions`) runs every check here before
anything is written: each option is checked as a `LaunchOptions` is built; with the Agent call (already an
`AgentParams`) and the parent, `plan_launch` decides the provider (`spawn` or `fork`), refuses a seed mode or
capability that does not fit, resolves a regular subagent's definition, and builds the record's options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Final

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from broker_config.settings import DEFAULT_TENANT
from workers.base.keys import FORK_ID_RE, HEX_DIGEST_RE, session_scope
from workers.base.limits import (
    MAX_LAUNCH_TURNS,
    MAX_LAUNCH_WALL_S,
    MAX_TOKENS,
    bad_text,
    nesting_problem,
    shown,
    too_deep,
)
from workers.errors import InvalidAgentParams
from workers.history.params import (
    APPROVAL_POLICIES,
    AgentParams,
    ApprovalPolicy,
    SeedMode,
    check_seed_mode,
    depth_error,
    normalize_seed_mode,
)
from workers.history.snapshot import ApprovalMode, ParentSnapshot
from workers.history.structured import check_schema
from workers.records.fork import BootstrapRecord, ForkOptions
from workers.subagents.capabilities import check_capabilities
from workers.subagents.definitions import GENERAL_PURPOSE, AgentDefinition, Catalog
from workers.subagents.scope import ParentContext, Scope, check_persona, check_tool_filter, resolve_scope
from workers.workspace.ref import WorkspaceMode, WorkspaceRef


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


def _fork_id(value: object) -> object:
    check_fork_id(value)
    return value


def _approval_policy(value: object) -> object:
    if value is not None and value not in APPROVAL_POLICIES:
        raise InvalidAgentParams(
            f"approval_policy must be one of {', '.join(APPROVAL_POLICIES)}, got {shown(value)}",
            field="approval_policy",
        )
    return "deny" if value is None else value


def _output_schema(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if too_deep(value):  # jsonschema recurses, canonical msgpack stops at 255 levels
        raise InvalidAgentParams(nesting_problem("output_schema"), field="output_schema")
    problem = bad_text("output_schema", value)  # canonical msgpack stores UTF-8 only
    if problem is not None:
        raise InvalidAgentParams(problem, field="output_schema")
    return check_schema(value)


def _max_wall_s(value: object) -> object:
    # `not 0 < x <= max` also refuses NaN and infinity, which compare false or past the bound
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_LAUNCH_WALL_S
    ):
        raise InvalidAgentParams(
            f"max_wall_s must be a positive number of seconds (finite, at most {MAX_LAUNCH_WALL_S:,.0f}); "
            f"got {shown(value)}",
            field="max_wall_s",
        )
    return value


def _max_turns(value: object) -> object:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_LAUNCH_TURNS
    ):
        raise InvalidAgentParams(
            f"max_turns must be a positive number of model calls (a whole number, at most {MAX_LAUNCH_TURNS:,}); "
            f"got {shown(value)}",
            field="max_turns",
        )
    return value


def _max_tokens(value: object) -> object:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_TOKENS):
        raise InvalidAgentParams(
            f"max_tokens must be a positive whole number of tokens (input plus output, at most {MAX_TOKENS:,}); "
            f"got {shown(value)}",
            field="max_tokens",
        )
    return value


def _workspace(value: object) -> object:
    if value is not None and value not in tuple(WorkspaceMode):
        raise InvalidAgentParams(
            f"workspace must be `snapshot` (the fork's own copy of the parent's files) or `shared` (the parent's "
            f"files in place); got {shown(value)}",
            field="workspace",
        )
    return value


def _workspace_manifest(value: object) -> object:
    if value is not None and not (isinstance(value, str) and HEX_DIGEST_RE.fullmatch(value)):
        raise InvalidAgentParams(
            f"workspace_manifest must be the digest an upload of the workspace answered (64 lowercase hex digits); "
            f"got {shown(value)}",
            field="workspace_manifest",
        )
    return value


def _network(value: object) -> object:
    if not isinstance(value, bool):
        raise InvalidAgentParams(f"network must be true or false; got {shown(value)}", field="network")
    return value


def _max_depth(value: object) -> object:
    """A whole number, 1 or more; `check_max_depth` bounds it by the deployment's limit once that is known."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidAgentParams(
            f"max_depth must be a whole number from 1 to this deployment's limit (FORKQ_MAX_SUBAGENT_DEPTH); got "
            f"{shown(value)}. It can lower the nesting limit, never raise it.",
            field="max_depth",
        )
    return value


def _seed_mode(value: object) -> SeedMode:
    return normalize_seed_mode(value)


FORK_ID_PATTERN: Final = f"^{FORK_ID_RE.pattern}$"
Whole = Annotated[int, Field(ge=1)]  # the schema's bounds; the checks above refuse with their own messages first
Seconds = Annotated[float, Field(gt=0)]


class LaunchOptions(BaseModel):
    """A launch's options beyond the Agent call; one left out (or None) takes its default.

    Each is checked as the model is built, by the function that names its rule: an invalid one raises
    `InvalidAgentParams` with the option as `.field` (never a pydantic error), from Python and over HTTP.
    `seed_mode` accepts the CLI spellings (`completed-turns`) and holds the mode's own name.
    """

    # built on first use: a process that only follows forks (`forkq status`) never validates one
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    fork_id: Annotated[
        Annotated[str, Field(pattern=FORK_ID_PATTERN)] | SkipJsonSchema[None], BeforeValidator(_fork_id)
    ] = Field(None, description="The fork's id, chosen by the caller (default: a fresh one).")
    seed_mode: Annotated[SeedMode, BeforeValidator(_seed_mode)] = Field(
        "fork_turns", description="How a fork's seed is taken from the parent's history."
    )
    persona: Annotated[str | SkipJsonSchema[None], BeforeValidator(check_persona)] = Field(
        None, description="Persona text of the child's fresh scope."
    )
    tool_filter: Annotated[tuple[str, ...] | SkipJsonSchema[None], BeforeValidator(check_tool_filter)] = Field(
        None, description="Names of the tools the child may use."
    )
    max_depth: Annotated[Whole | SkipJsonSchema[None], BeforeValidator(_max_depth)] = Field(
        None, description="Deepest nesting of the child's own subagents."
    )
    approval_policy: Annotated[ApprovalPolicy, BeforeValidator(_approval_policy)] = Field(
        "deny", description="A call that needs approval: `deny` it (default), or `park` the fork until approve/deny."
    )
    output_schema: Annotated[dict[str, Any] | SkipJsonSchema[None], BeforeValidator(_output_schema)] = Field(
        None, description="JSON schema the final answer must match."
    )
    # an int stays an int: the record keeps the number the launch gave (ForkOptions)
    max_wall_s: Annotated[Whole | Seconds | SkipJsonSchema[None], BeforeValidator(_max_wall_s)] = Field(
        None, description="Wall-clock limit in seconds (below the workers' own limit)."
    )
    max_turns: Annotated[Whole | SkipJsonSchema[None], BeforeValidator(_max_turns)] = Field(
        None, description="Model calls at most (below the workers' own limit)."
    )
    max_tokens: Annotated[Whole | SkipJsonSchema[None], BeforeValidator(_max_tokens)] = Field(
        None,
        description="Tokens at most (input plus output, cached input as the provider bills it); at it the fork "
        "pauses (`budget_reached`) before its next model call.",
    )
    workspace: Annotated[WorkspaceMode | SkipJsonSchema[None], BeforeValidator(_workspace)] = Field(
        None,
        description="The fork's files: `snapshot`, its own copy (the default, FORKQ_WORKSPACE), or `shared`, the "
        "parent's cwd in place.",
    )
    workspace_manifest: Annotated[str | SkipJsonSchema[None], BeforeValidator(_workspace_manifest)] = Field(
        None, description="A snapshot workspace uploaded to `forkq serve` (the digest its upload answered)."
    )
    network: Annotated[bool, BeforeValidator(_network)] = Field(
        True, description="false: a snapshot fork's tools have no network."
    )


def record_options(agent: AgentParams, options: LaunchOptions) -> dict[str, Any]:
    """The record's options (`ForkOptions` fields) of the Agent call and the launch options (None: the default, not
    kept)."""
    return {
        "fork_tools": None if agent.fork_tools is None else list(agent.fork_tools),
        "approval_policy": None if options.approval_policy == "deny" else options.approval_policy,
        "output_schema": options.output_schema,
        "max_wall_s": options.max_wall_s,
        "max_turns": options.max_turns,
        "max_tokens": options.max_tokens,
        "seed_mode": "completed_turns" if options.seed_mode == "completed_turns" else None,
        "persona": True if options.persona is not None else None,
        "tool_filter": None if options.tool_filter is None else list(options.tool_filter),
        "max_depth": options.max_depth,
    }


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
        "max_tokens": options.max_tokens,
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

    def record(
        self,
        fork_id: str,
        parent: ParentSnapshot,
        agent: AgentParams,
        *,
        seed_chunks: list[bytes],
        message_count: int,
        task_prompt: str,
        workspace: WorkspaceRef | None = None,
        tenant: str | None = None,
    ) -> BootstrapRecord:
        """The bootstrap record of this launch, with its seed's chunk digests, message count and task prompt, for
        `tenant` (None: `default`), its parent session in that tenant's space (`session_scope`)."""
        return BootstrapRecord(
            fork_id=fork_id,
            parent_session=session_scope(parent.session_id, tenant or DEFAULT_TENANT),
            kind="fork" if self.kind == "fork" else "spawn",
            seed_chunks=seed_chunks,
            message_count=message_count,
            task_prompt=task_prompt,
            directive=agent.prompt,
            description=agent.description,
            subagent_type=agent.subagent_type,
            name=agent.name,
            system_instruction=self.scope.system_instruction,
            tools_json=self.scope.tools_json,
            model=self.scope.model,
            approval_mode=self.approval_mode,
            cwd=parent.cwd,
            depth=parent.depth + 1,
            fork_turns=agent.fork_turns,
            options=self.options,
            workspace=workspace,
            tenant=tenant,
        )


def plan_launch(
    agent: AgentParams,
    parent: ParentSnapshot,
    asks: LaunchOptions,
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
    persona, tool_filter = asks.persona, asks.tool_filter
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
    options = record_options(agent, asks)
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
    if definition is not None:
        options |= {"agent": definition.name, "agent_source": definition.source}
        if definition.max_turns is not None:  # the lower of the definition's and the launch's
            options["max_turns"] = min(definition.max_turns, asks.max_turns or definition.max_turns)
    # a completed-turn fork runs in a fresh scope: never the parent's permissive approval mode
    mode: ApprovalMode = "default" if seed_mode == "completed_turns" else parent.approval_mode
    return LaunchPlan(provider, seed_mode, scope, mode, ForkOptions(**options))


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


def check_max_depth(max_depth: int | None, depth_limit: int) -> int | None:
    """A launch's `max_depth` (already a whole number from 1, `LaunchOptions`), bounded by the deployment's limit.

    Raises:
        InvalidAgentParams: it is above the limit (`.field` is `max_depth`).
    """
    if max_depth is not None and max_depth > depth_limit:
        raise InvalidAgentParams(
            f"max_depth must be a whole number from 1 to this deployment's limit {depth_limit} "
            f"(FORKQ_MAX_SUBAGENT_DEPTH); got {shown(max_depth)}. It can lower the nesting limit, never raise it.",
            field="max_depth",
        )
    return max_depth

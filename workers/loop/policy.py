"""What a fork may do with a tool call: nesting rules, the `fork_tools` allowlist, and approval.

Every call of a model response passes this gate before anything runs, in this order:
1. an Agent call (spawning a sub-agent): refused inside a fork and from a teammate, and beyond the
   configured depth for regular subagents; otherwise the loop launches the nested subagent;
2. the fork's own tool declarations (the parent's, from the bootstrap record): a call to a tool the
   fork was not given is answered with an error naming the declared tools, whatever the worker
   could execute, before any approval or side effect (an Agent call too, unless step 1 refused it);
3. the `fork_tools` execution allowlist (forks only): a call outside it is answered with an error
   naming the list, before any approval or side effect;
4. approval: the fork's mode is the parent's when that is permissive (`yolo`, `auto-edit`); under
   any other mode (`default`, `plan`) every mutating call needs a decision. A detached fork never
   blocks waiting for a person: the launch's approval policy either denies the call with an error
   the model can read (`deny`, the default) or parks the fork until `forkq approve`/`forkq deny`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from workers.history.params import ApprovalPolicy, depth_error, is_agent_tool, tool_allowed
from workers.history.snapshot import ApprovalMode
from workers.tools.registry import Tool

PERMISSIVE_MODES: Final[tuple[ApprovalMode, ...]] = ("yolo", "auto-edit")

FORK_NESTING_ERROR: Final = "Error: Cannot spawn sub-agents from within a fork. Please execute tasks directly."
TEAMMATE_NESTING_ERROR: Final = (
    "Error: Teammates cannot spawn sub-agents. Complete this task directly with your own tools."
)
SUBAGENT_FORK_ERROR: Final = (
    'Error: Only a top-level session can fork (subagent_type "fork"). Complete this task directly with your '
    "own tools, or launch a regular subagent."
)


def allowlist_error(name: str, allowlist: Sequence[str]) -> str:
    """The answer to a call outside `fork_tools`."""
    allowed = ", ".join(allowlist) if allowlist else "none: fork_tools is [], so this fork may run no tool"
    return (
        f"Error: tool {name!r} is not in this fork's execution allowlist (fork_tools: {allowed}); it was not run. "
        "Use an allowed tool, or do without it and say so in your answer."
    )


MAX_LISTED_TOOLS: Final = 40  # a parent may declare hundreds of MCP tools: name the first ones only


def undeclared_error(name: str, declared: Sequence[str]) -> str:
    """The answer to a call of a tool the fork's parent did not declare."""
    shown = ", ".join(declared[:MAX_LISTED_TOOLS]) if declared else "none"
    if len(declared) > MAX_LISTED_TOOLS:
        shown += f" and {len(declared) - MAX_LISTED_TOOLS} more"
    return (
        f"Error: tool {name!r} is not one of this fork's tools (declared: {shown}); it was not run. "
        "Use one of the declared tools, or do without it and say so in your answer."
    )


def denied_by_policy(name: str, mode: ApprovalMode) -> str:
    """The answer to a call that needs approval when the launch's policy is `deny`."""
    return (
        f"Error: tool {name!r} needs approval in approval mode {mode!r}, and this background fork has no one "
        "to ask, so the call was denied and did not run. Continue without it, or report in your final answer "
        "what you needed to do and why."
    )


def denied_by_user(name: str, reason: str | None) -> str:
    """The answer to a call a person denied."""
    why = f": {reason}" if reason else ""
    return f"Error: tool {name!r} was denied by the user{why}. The call did not run; do not retry it as is."


def effective_mode(parent_mode: ApprovalMode) -> ApprovalMode:
    """The fork's approval mode: a permissive parent mode carries over, otherwise each mutating call is confirmed."""
    return parent_mode if parent_mode in PERMISSIVE_MODES else "default"


def needs_approval(tool: Tool, mode: ApprovalMode) -> bool:
    """Whether a call of `tool` must be confirmed under `mode` (`auto-edit` approves file edits only)."""
    if not tool.mutating or mode == "yolo":
        return False
    return not (mode == "auto-edit" and tool.edit)


def is_agent_call(name: str | None, declarations: Mapping[str, Mapping[str, Any]]) -> bool:
    """An Agent tool call: the Agent tool's name (`agent`, any case), or a declared tool taking `prompt` and
    `subagent_type` (`Task` and the like are recognized by their parameters, not their name)."""
    return is_agent_tool(name, declarations.get(name or ""))


@dataclass(frozen=True)
class Gate:
    """The rules one fork's calls pass, from its bootstrap record and the worker's settings."""

    kind: str  # fork | spawn
    teammate: bool
    depth: int  # the fork's own depth (a top-level session's child is 1)
    max_depth: int
    mode: ApprovalMode  # effective approval mode
    policy: ApprovalPolicy
    allowlist: tuple[str, ...] | None  # fork_tools, None: every inherited tool

    def nesting_error(self, args: Mapping[str, Any]) -> str | None:
        """Why an Agent call from this fork is refused, or None when it may launch a subagent."""
        if self.kind == "fork":
            return FORK_NESTING_ERROR
        if self.teammate:
            return TEAMMATE_NESTING_ERROR
        subagent_type = args.get("subagent_type")
        if isinstance(subagent_type, str) and subagent_type.lower() == "fork":
            return SUBAGENT_FORK_ERROR
        if self.depth + 1 > self.max_depth:
            return depth_error(self.max_depth)
        return None

    def allowlist_error(self, name: str) -> str | None:
        """The error for a call outside `fork_tools`, or None when it may run."""
        if self.allowlist is None or tool_allowed(name, self.allowlist):
            return None
        return allowlist_error(name, self.allowlist)

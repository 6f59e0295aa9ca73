"""The fork's capabilities as pure rules: the gate (nesting, allowlist, approval) and the launch options.

Structured output and the parent's notification, pure rules too, are in tests/history/test_structured.py and
tests/records/test_notification.py. No Redis, no workers.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.history.test_structured import SCHEMA
from workers.errors import InvalidAgentParams
from workers.history.params import (
    MSG_FORK_TOOLS_LIST,
    MSG_FORK_TOOLS_NOT_FORK,
    MSG_FORK_TOOLS_STAR,
    MSG_FORK_TOOLS_TEAMMATE,
    MSG_FORK_TOOLS_WILDCARD,
    AgentParams,
    agent_tool_schema,
    tool_allowed,
    validate_agent_params,
)
from workers.loop.policy import (
    FORK_NESTING_ERROR,
    SUBAGENT_FORK_ERROR,
    TEAMMATE_NESTING_ERROR,
    Gate,
    denied_by_policy,
    denied_by_user,
    effective_mode,
    is_agent_call,
    needs_approval,
)
from workers.records.fork import ForkOptions
from workers.subagents.launch import LaunchOptions, check_nesting, record_options
from workers.tools.builtins import builtin_tools
from workers.tools.registry import Tool

BUILTINS = builtin_tools()
READ_ONLY = ("read_file", "list_directory", "glob", "grep_search")
FILE_EDITS = ("write_file", "edit")
FORK = {"description": "audit", "prompt": "Audit the limiter.", "subagent_type": "fork"}


def gate(**overrides: Any) -> Gate:
    values: dict[str, Any] = {
        "kind": "spawn",
        "teammate": False,
        "depth": 1,
        "max_depth": 3,
        "mode": "default",
        "policy": "deny",
        "allowlist": None,
    }
    return Gate(**{**values, **overrides})


def custom(name: str, *, mutating: bool = False, edit: bool = False) -> Tool:
    return Tool(name, "a custom tool", {"type": "object"}, lambda args, ctx: "ok", mutating=mutating, edit=edit)


# ── approval modes ────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("parent_mode", "fork_mode"),
    [("yolo", "yolo"), ("auto-edit", "auto-edit"), ("default", "default"), ("plan", "default")],
)
def test_a_permissive_parent_mode_carries_over_and_any_other_confirms_each_mutating_call(
    parent_mode: str, fork_mode: str
) -> None:
    assert effective_mode(parent_mode) == fork_mode


@pytest.mark.parametrize("mode", ["yolo", "auto-edit", "default", "plan"])
@pytest.mark.parametrize("name", READ_ONLY)
def test_a_read_only_tool_never_needs_approval(mode: str, name: str) -> None:
    tool = BUILTINS.get(name)
    assert tool is not None and not tool.mutating
    assert needs_approval(tool, effective_mode(mode)) is False


@pytest.mark.parametrize(
    ("mode", "edits_need_approval", "others_need_approval"),
    [("yolo", False, False), ("auto-edit", False, True), ("default", True, True), ("plan", True, True)],
)
def test_which_mutating_calls_need_approval_in_each_mode(
    mode: str, edits_need_approval: bool, others_need_approval: bool
) -> None:
    fork_mode = effective_mode(mode)
    for name in FILE_EDITS:
        tool = BUILTINS.get(name)
        assert tool is not None and tool.edit
        assert needs_approval(tool, fork_mode) is edits_need_approval, name
    shell = BUILTINS.get("run_shell_command")
    assert shell is not None and not shell.edit
    assert needs_approval(shell, fork_mode) is others_need_approval
    assert needs_approval(custom("mcp__db__drop", mutating=True), fork_mode) is others_need_approval


def test_the_policy_denial_names_the_tool_and_the_mode_and_says_nothing_ran() -> None:
    text = denied_by_policy("run_shell_command", "plan")
    assert text.startswith("Error:")
    assert "'run_shell_command' needs approval in approval mode 'plan'" in text
    assert "denied and did not run" in text


def test_a_user_denial_names_the_tool_and_carries_the_reason_when_given() -> None:
    assert "'write_file' was denied by the user: not on main" in denied_by_user("write_file", "not on main")
    bare = denied_by_user("write_file", None)
    assert "'write_file' was denied by the user." in bare and "did not run" in bare


# ── nesting ───────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("name", ["Agent", "agent", "AGENT"])
def test_the_agent_tool_is_recognised_by_name_whatever_its_case(name: str) -> None:
    assert is_agent_call(name, {}) is True


@pytest.mark.parametrize("name", ["task", "Task", "agents"])
def test_a_plain_tool_with_another_name_is_not_an_agent_call(name: str) -> None:
    plain = {name: {"name": name, "parameters": {"type": "object", "properties": {"title": {"type": "string"}}}}}
    assert is_agent_call(name, plain) is False


@pytest.mark.parametrize("key", ["parameters", "parametersJsonSchema"])
def test_any_declared_tool_taking_prompt_and_subagent_type_is_an_agent_call(key: str) -> None:
    declarations = {
        "delegate": {"name": "delegate", key: agent_tool_schema()},
        "ask": {"name": "ask", key: {"type": "object", "properties": {"prompt": {"type": "string"}}}},
    }
    assert is_agent_call("delegate", declarations) is True
    assert is_agent_call("ask", declarations) is False  # a prompt alone is not an Agent tool
    assert is_agent_call("read_file", declarations) is False
    assert is_agent_call(None, declarations) is False


def test_a_fork_may_not_spawn_anything() -> None:
    fork = gate(kind="fork")
    assert fork.nesting_error({"description": "d", "prompt": "p", "subagent_type": "general-purpose"}) == (
        FORK_NESTING_ERROR
    )
    assert FORK_NESTING_ERROR == "Error: Cannot spawn sub-agents from within a fork. Please execute tasks directly."


def test_a_named_teammate_may_not_spawn_subagents() -> None:
    error = gate(teammate=True).nesting_error({"description": "d", "prompt": "p"})
    assert error == TEAMMATE_NESTING_ERROR and "Teammates cannot spawn sub-agents" in error


@pytest.mark.parametrize("subagent_type", ["fork", "FORK"])
def test_a_regular_subagent_may_not_fork(subagent_type: str) -> None:
    error = gate().nesting_error({"description": "d", "prompt": "p", "subagent_type": subagent_type})
    assert error == SUBAGENT_FORK_ERROR and "Only a top-level session can fork" in error


@pytest.mark.parametrize(("depth", "max_depth", "allowed"), [(1, 3, True), (2, 3, True), (3, 3, False), (1, 1, False)])
def test_a_regular_subagent_nests_up_to_the_depth_limit(depth: int, max_depth: int, allowed: bool) -> None:
    error = gate(depth=depth, max_depth=max_depth).nesting_error({"description": "d", "prompt": "p"})
    if allowed:
        assert error is None
    else:
        assert error is not None and f"Nesting depth limit reached (max {max_depth})" in error


def test_only_a_top_level_session_may_launch_a_fork() -> None:
    fork = validate_agent_params(FORK)
    check_nesting(fork, parent_depth=0, max_depth=3)
    with pytest.raises(InvalidAgentParams, match="Cannot spawn sub-agents from within a fork") as caught:
        check_nesting(fork, parent_depth=1, max_depth=3)
    assert caught.value.field == "subagent_type"


def test_a_regular_subagent_launch_is_refused_from_a_parent_at_the_depth_limit() -> None:
    regular = validate_agent_params({"description": "d", "prompt": "p", "subagent_type": "general-purpose"})
    check_nesting(regular, parent_depth=2, max_depth=3)
    with pytest.raises(InvalidAgentParams, match=r"Nesting depth limit reached \(max 3\)"):
        check_nesting(regular, parent_depth=3, max_depth=3)


# ── the fork_tools allowlist ──────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "fork_tools",
    [[], ["read_file"], ["read_file", "grep_search"], ["mcp__*"], ["mcp__github__read_*"], ["mcp__github__*"]],
)
def test_a_fork_accepts_exact_names_and_mcp_patterns_as_fork_tools(fork_tools: list[str]) -> None:
    assert validate_agent_params({**FORK, "fork_tools": fork_tools}).fork_tools == tuple(fork_tools)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"description": "d", "prompt": "p", "fork_tools": ["read_file"]}, MSG_FORK_TOOLS_NOT_FORK),
        (
            {"description": "d", "prompt": "p", "subagent_type": "general-purpose", "fork_tools": []},
            MSG_FORK_TOOLS_NOT_FORK,
        ),
        ({**FORK, "name": "reviewer", "fork_tools": ["read_file"]}, MSG_FORK_TOOLS_TEAMMATE),
        ({**FORK, "fork_tools": "read_file"}, MSG_FORK_TOOLS_LIST),
        ({**FORK, "fork_tools": [""]}, MSG_FORK_TOOLS_LIST),
        ({**FORK, "fork_tools": [" read_file"]}, MSG_FORK_TOOLS_LIST),
        ({**FORK, "fork_tools": ["read_file\n"]}, MSG_FORK_TOOLS_LIST),
        ({**FORK, "fork_tools": [1]}, MSG_FORK_TOOLS_LIST),
        ({**FORK, "fork_tools": None}, MSG_FORK_TOOLS_LIST),
        ({**FORK, "fork_tools": ["*"]}, MSG_FORK_TOOLS_STAR),
        ({**FORK, "fork_tools": ["read_*"]}, MSG_FORK_TOOLS_WILDCARD),
        ({**FORK, "fork_tools": ["mcp__gh*"]}, MSG_FORK_TOOLS_WILDCARD),
        ({**FORK, "fork_tools": ["mcp__*__read"]}, MSG_FORK_TOOLS_WILDCARD),
        ({**FORK, "fork_tools": ["mcp__github__*_issue"]}, MSG_FORK_TOOLS_WILDCARD),
    ],
    ids=[
        "no-type",
        "regular-subagent",
        "teammate",
        "not-a-list",
        "empty-name",
        "leading-space",
        "trailing-newline",
        "not-a-string",
        "null",
        "star",
        "non-mcp-wildcard",
        "no-server",
        "inner-star",
        "middle-star",
    ],
)
def test_an_invalid_fork_tools_is_refused_with_the_spec_message(params: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        validate_agent_params(params)
    assert str(caught.value) == message
    assert caught.value.field == "fork_tools"


def test_the_fork_tools_message_for_a_non_fork_is_the_spec_text() -> None:
    assert MSG_FORK_TOOLS_NOT_FORK == 'Parameter "fork_tools" can only be used with subagent_type "fork".'


@pytest.mark.parametrize(
    ("name", "allowlist", "allowed"),
    [
        ("read_file", ("read_file",), True),
        ("read_files", ("read_file",), False),
        ("write_file", ("read_file", "grep_search"), False),
        ("read_file", (), False),
        ("mcp__github__read_issue", ("mcp__github__read_*",), True),
        ("mcp__github__write_issue", ("mcp__github__read_*",), False),
        ("mcp__jira__read_issue", ("mcp__github__read_*",), False),
        ("mcp__jira__anything", ("mcp__*",), True),
        ("read_file", ("mcp__*",), False),
    ],
)
def test_a_call_is_allowed_only_by_an_exact_name_or_a_matching_mcp_prefix(
    name: str, allowlist: tuple[str, ...], allowed: bool
) -> None:
    assert tool_allowed(name, allowlist) is allowed


def test_a_call_outside_the_allowlist_is_answered_with_an_error_naming_the_allowlist() -> None:
    error = gate(kind="fork", allowlist=("read_file", "mcp__github__read_*")).allowlist_error("write_file")
    assert error is not None
    assert "'write_file'" in error and "fork_tools: read_file, mcp__github__read_*" in error
    assert "not run" in error


def test_an_empty_allowlist_refuses_every_tool_and_says_so() -> None:
    error = gate(kind="fork", allowlist=()).allowlist_error("read_file")
    assert error is not None and "fork_tools is []" in error and "'read_file'" in error


def test_without_fork_tools_every_inherited_tool_may_run() -> None:
    assert gate(kind="fork", allowlist=None).allowlist_error("run_shell_command") is None


# ── launch options ────────────────────────────────────────────────────────────────────────────


def launch_options(agent: AgentParams, **options: Any) -> ForkOptions:
    """The options a bootstrap record keeps for `LaunchOptions(**options)` without a subagent definition."""
    return ForkOptions(**record_options(agent, LaunchOptions(**options)))


def test_launch_options_keep_only_what_differs_from_the_defaults() -> None:
    agent = validate_agent_params({**FORK, "fork_tools": []})
    assert launch_options(agent).model_dump() == {"fork_tools": []}
    options = launch_options(agent, approval_policy="park", output_schema=SCHEMA, max_wall_s=30, max_turns=5)
    assert options.model_dump() == {
        "fork_tools": [],
        "approval_policy": "park",
        "output_schema": SCHEMA,
        "max_wall_s": 30,
        "max_turns": 5,
    }


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"approval_policy": "ask"}, "approval_policy"),
        ({"output_schema": {"type": "no-such-type"}}, "output_schema"),
        ({"output_schema": ["not", "an", "object"]}, "output_schema"),
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": True}, "max_turns"),
        ({"max_wall_s": -1.0}, "max_wall_s"),
        ({"max_wall_s": "60"}, "max_wall_s"),
    ],
)
def test_an_invalid_launch_option_is_refused_naming_its_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        launch_options(validate_agent_params(FORK), **options)
    assert caught.value.field == field

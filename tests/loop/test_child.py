"""The child loop (workers/loop/child.py) over an in-memory journal, fast and exact: the gate's decisions.

What runs, is denied or parks; the `fork_tools` allowlist and the nesting rules (workers/loop/policy.py);
structured output; the turn and wall-clock limits; cancellation; and a revived loop replaying the
decisions a person made. The same capabilities through a worker's delivery and live workers are in
tests/subagents/test_capabilities.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.loop_support import (
    MIXED,
    ONLY_READ_FILE,
    REGULAR,
    SCHEMA,
    UNDECLARED,
    VALID,
    Recording,
    call,
    ran,
    scripted,
    started,
    step,
    tool_results,
    workdir,
)
from tests.records.test_journal import MemoryJournal
from workers.history.params import agent_tool_schema
from workers.history.selection import ForkSeed
from workers.loop.child import ChildLoop, Parked, Stopped, Workspace
from workers.loop.policy import FORK_NESTING_ERROR, SUBAGENT_FORK_ERROR, TEAMMATE_NESTING_ERROR
from workers.loop.replay import replay
from workers.providers import ModelRequest, ModelResponse
from workers.records.fork import BootstrapRecord, Status
from workers.records.journal import JournalEntry
from workers.records.notification import NO_OUTPUT
from workers.tools.builtins import builtin_tools
from workers.tools.registry import Tool, ToolRegistry

# ── the child loop over an in-memory journal ──────────────────────────────────────────────────

FORK_ID = "f-capabilities"
DECLARATIONS = [t.declaration for t in builtin_tools().tools.values()] + [
    {"name": "Agent", "description": "Launch a sub-agent.", "parameters": agent_tool_schema()},
    {"name": "delegate", "description": "Hand work to a helper.", "parameters": agent_tool_schema()},
]


@dataclass
class SpawnRecorder:
    """A spawner that records what it was asked to launch and answers for the nested subagent."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def spawn(
        self,
        record: BootstrapRecord,
        args: Mapping[str, Any],
        child_id: str,
        *,
        cancelled: Callable[[], bool],
        deadline: float,
        workspace: Workspace | None = None,
    ) -> dict[str, Any]:
        self.calls.append((child_id, dict(args)))
        return {"output": f"nested report from {child_id}"}


@dataclass
class Loop:
    loop: ChildLoop
    journal: MemoryJournal
    provider: Recording
    work: Path

    @property
    def entries(self) -> list[JournalEntry]:
        return self.journal.entries


def child_loop(
    tmp_path: Path,
    steps: list[dict[str, Any]],
    *,
    kind: str = "fork",
    name: str | None = None,
    depth: int = 1,
    mode: str = "yolo",
    options: dict[str, Any] | None = None,
    tools: ToolRegistry | None = None,
    declarations: list[dict[str, Any]] | None = None,
    stop_reason: Callable[[], str | None] = lambda: None,
    **loop_options: Any,
) -> Loop:
    work = workdir(tmp_path)
    record = BootstrapRecord(
        fork_id=FORK_ID,
        parent_session="s-capabilities",
        kind=kind,
        name=name,
        seed_chunks=[],
        message_count=0,
        task_prompt="Begin.",
        directive="Fix the rate limiter.",
        description="capabilities",
        tools_json=json.dumps(declarations or DECLARATIONS, separators=(",", ":")),
        model="test-model",
        approval_mode=mode,
        cwd=str(work),
        depth=depth,
        options=options or {},
    )
    provider = scripted(steps)
    journal = MemoryJournal(stop_reason=stop_reason)
    loop = ChildLoop(
        record=record,
        seed=ForkSeed(initial_messages=[], task_prompt="Begin."),
        provider=provider,
        tools=tools or builtin_tools(),
        io=journal,
        **loop_options,
    )
    return Loop(loop, journal, provider, work)


def mcp_tools() -> ToolRegistry:
    registry = builtin_tools()
    for name, mutating in (("mcp__github__read_issue", False), ("mcp__github__close_issue", True)):
        registry.register(Tool(name, "GitHub.", {"type": "object"}, lambda a, c: "ok", mutating=mutating))
    return registry


@pytest.mark.parametrize(("mode", "policy"), [("yolo", "deny"), ("default", "park")])
def test_a_call_to_a_tool_the_parent_never_declared_is_refused_before_approval_or_any_side_effect(
    tmp_path: Path, mode: str, policy: str
) -> None:
    # Given a regular subagent whose parent declared only read_file, on a worker that has every built-in
    spawner = SpawnRecorder()
    steps = [
        step(
            call("r1", "read_file", path="notes.txt"),
            call("s1", "run_shell_command", command="touch shell.txt"),
            call("a1", "Agent", **REGULAR),
        ),
        step("done"),
    ]
    run = child_loop(
        tmp_path,
        steps,
        kind="spawn",
        mode=mode,
        options={"approval_policy": policy},
        declarations=ONLY_READ_FILE,
        spawner=spawner,
    )

    # When it runs (it does not park: an undeclared call never waits for a person)
    result = run.loop.run()

    # Then only the declared tool ran; the others were refused with the declared list, and nothing started
    assert result.status is Status.SUCCEEDED and result.output == "done"
    responses = tool_results(run.entries)
    assert responses["s1"] == {"error": UNDECLARED}
    assert responses["a1"]["error"].startswith("Error: tool 'Agent' is not one of this fork's tools")
    assert ran(run.entries) == started(run.entries) == {"r1"}
    assert spawner.calls == [] and not (run.work / "shell.txt").exists()


def test_an_empty_allowlist_answers_every_call_with_an_error_and_runs_nothing(tmp_path: Path) -> None:
    # Given a fork with fork_tools [] whose launch would park calls that need approval
    run = child_loop(tmp_path, MIXED, mode="default", options={"fork_tools": [], "approval_policy": "park"})

    # When it runs: nothing parks, because the allowlist answers first
    result = run.loop.run()

    # Then every call got the allowlist error, and nothing ran or even started
    assert result.status is Status.SUCCEEDED and result.output == "done"
    responses = tool_results(run.entries)
    assert set(responses) == {"r1", "w1", "s1"}
    for response in responses.values():
        assert "not in this fork's execution allowlist" in response["error"]
        assert "fork_tools is []" in response["error"]
    assert started(run.entries) == set()
    assert not (run.work / "edited.txt").exists() and not (run.work / "shell.txt").exists()


def test_a_call_outside_the_allowlist_is_refused_naming_the_list_while_allowed_calls_run(tmp_path: Path) -> None:
    run = child_loop(tmp_path, MIXED, options={"fork_tools": ["read_file", "grep_search"]})

    run.loop.run()

    responses = tool_results(run.entries)
    assert ran(run.entries) == {"r1"} and "INCR then EXPIRE" in responses["r1"]["output"]
    for cid in ("w1", "s1"):
        assert "fork_tools: read_file, grep_search" in responses[cid]["error"]
    assert started(run.entries) == {"r1"}
    assert not (run.work / "edited.txt").exists() and not (run.work / "shell.txt").exists()


def test_an_mcp_prefix_pattern_allows_only_the_tools_it_matches(tmp_path: Path) -> None:
    declarations = [*DECLARATIONS, {"name": "mcp__github__read_issue"}, {"name": "mcp__github__close_issue"}]
    steps = [
        step(
            call("m1", "mcp__github__read_issue"),
            call("m2", "mcp__github__close_issue"),
            call("r1", "read_file", path="notes.txt"),
        ),
        step("done"),
    ]
    run = child_loop(
        tmp_path, steps, options={"fork_tools": ["mcp__github__read_*"]}, tools=mcp_tools(), declarations=declarations
    )

    run.loop.run()

    responses = tool_results(run.entries)
    assert ran(run.entries) == {"m1"}
    assert "fork_tools: mcp__github__read_*" in responses["m2"]["error"]
    assert "fork_tools: mcp__github__read_*" in responses["r1"]["error"]


def test_the_allowlist_leaves_the_declarations_the_model_sees_byte_identical(tmp_path: Path) -> None:
    run = child_loop(tmp_path, MIXED, options={"fork_tools": []})

    run.loop.run()

    assert len(run.provider.requests) == 2
    for request in run.provider.requests:
        assert json.dumps(request.tools, separators=(",", ":")) == run.loop.record.tools_json
        assert {t["name"] for t in request.tools} >= {"read_file", "write_file", "run_shell_command", "Agent"}


def test_a_parked_step_lists_only_the_calls_that_passed_the_allowlist_and_the_nesting_rules(tmp_path: Path) -> None:
    # Given a parking fork allowed to read and write, whose step also calls the shell and the Agent tool
    steps = [
        step(
            call("s1", "run_shell_command", command="touch shell.txt"),
            call("a1", "Agent", **REGULAR),
            call("r1", "read_file", path="notes.txt"),
            call("w1", "write_file", path="edited.txt", content="x"),
            call(None, "edit", path="notes.txt", old_string="INCR", new_string="SET"),
        )
    ]
    run = child_loop(
        tmp_path,
        steps,
        mode="plan",
        options={"fork_tools": ["read_file", "write_file", "edit"], "approval_policy": "park"},
    )

    # When it runs, it parks on the first call that needs a person
    with pytest.raises(Parked) as parked:
        run.loop.run()

    # Then the refused calls were answered first, the read ran, and the parked calls are the two edits
    responses = tool_results(run.entries)
    assert "fork_tools: read_file, write_file, edit" in responses["s1"]["error"]
    assert responses["a1"] == {"error": FORK_NESTING_ERROR}
    assert ran(run.entries) == {"r1"}
    assert [c.wire() for c in parked.value.calls] == [
        {"call_id": "w1", "index": 3, "step": 0, "name": "write_file", "args": {"path": "edited.txt", "content": "x"}},
        {
            "call_id": "0.4",  # a call without an id is named by its step and index
            "index": 4,
            "step": 0,
            "name": "edit",
            "args": {"path": "notes.txt", "old_string": "INCR", "new_string": "SET"},
        },
    ]
    assert not (run.work / "edited.txt").exists() and not (run.work / "shell.txt").exists()


@pytest.mark.parametrize("name", ["Agent", "delegate"])
def test_a_forks_agent_call_is_refused_and_launches_nothing(tmp_path: Path, name: str) -> None:
    spawner = SpawnRecorder()
    run = child_loop(tmp_path, [step(call("a1", name, **REGULAR)), step("done")], spawner=spawner)

    result = run.loop.run()

    assert result.status is Status.SUCCEEDED
    assert tool_results(run.entries)["a1"] == {
        "error": "Error: Cannot spawn sub-agents from within a fork. Please execute tasks directly."
    }
    assert spawner.calls == [] and started(run.entries) == set()


@pytest.mark.parametrize(
    ("record", "args", "expected"),
    [
        ({"kind": "spawn", "name": "reviewer", "depth": 1}, REGULAR, TEAMMATE_NESTING_ERROR),
        ({"kind": "spawn", "depth": 3}, REGULAR, "Error: Nesting depth limit reached (max 3)"),
        ({"kind": "spawn", "depth": 1}, {**REGULAR, "subagent_type": "fork"}, SUBAGENT_FORK_ERROR),
    ],
    ids=["teammate", "depth-limit", "subagent-fork"],
)
def test_a_subagents_agent_call_is_refused_by_the_nesting_rules(
    tmp_path: Path, record: dict[str, Any], args: dict[str, Any], expected: str
) -> None:
    spawner = SpawnRecorder()
    run = child_loop(tmp_path, [step(call("a1", "Agent", **args)), step("done")], spawner=spawner, **record)

    run.loop.run()

    assert tool_results(run.entries)["a1"]["error"].startswith(expected)
    assert spawner.calls == []


def test_a_subagent_within_the_depth_limit_launches_a_nested_one_and_reads_its_output(tmp_path: Path) -> None:
    spawner = SpawnRecorder()
    steps = [step("Delegating.", call("a1", "Agent", **REGULAR)), step("done")]
    run = child_loop(tmp_path, steps, kind="spawn", depth=2, spawner=spawner, max_depth=3)

    run.loop.run()

    assert spawner.calls == [(f"{FORK_ID}.0.0", REGULAR)]
    assert tool_results(run.entries)["a1"] == {"output": f"nested report from {FORK_ID}.0.0"}
    assert started(run.entries) == {"a1"}  # journaled before the launch, so a revival rejoins it


def test_a_final_answer_failing_the_schema_goes_back_to_the_model_until_it_validates(tmp_path: Path) -> None:
    steps = [step("I fixed it."), step('{"fixed": "yes", "files": []}'), step(f"```json\n{VALID}\n```")]
    run = child_loop(tmp_path, steps, options={"output_schema": SCHEMA})

    result = run.loop.run()

    assert result.status is Status.SUCCEEDED
    assert json.loads(result.output or "") == json.loads(VALID)
    feedbacks = [e for e in run.entries if e.kind == "feedback"]
    assert len(feedbacks) == 2
    texts = [e.content.parts[0].text for e in feedbacks if e.content]
    assert "the answer is not JSON" in texts[0]
    assert "at fixed: 'yes' is not of type 'boolean'" in texts[1]
    # the model read each error: the feedback is the last message of the next request
    assert [r.messages[-1].parts[0].text for r in run.provider.requests[1:]] == texts


@pytest.mark.parametrize("retries", [0, 2])
def test_a_fork_whose_answers_keep_failing_the_schema_fails_after_the_retries(tmp_path: Path, retries: int) -> None:
    steps = [step(f"attempt {i}: not JSON") for i in range(5)]
    run = child_loop(tmp_path, steps, options={"output_schema": SCHEMA}, schema_retries=retries)

    result = run.loop.run()

    assert result.status is Status.FAILED and result.output is None
    assert result.error is not None and result.error.startswith("output_schema:")
    assert f"after {retries + 1} tries" in result.error
    assert len(run.provider.requests) == retries + 1
    assert sum(e.kind == "feedback" for e in run.entries) == retries


LOOPING = [step(call(f"l{i}", "list_directory")) for i in range(20)]


@pytest.mark.parametrize(
    ("worker_limit", "launch_limit", "calls"),
    [(3, None, 3), (200, 2, 2), (3, 10, 3)],
    ids=["worker", "launch", "lowest"],
)
def test_a_fork_that_keeps_calling_tools_fails_at_the_lowest_turn_limit(
    tmp_path: Path, worker_limit: int, launch_limit: int | None, calls: int
) -> None:
    options = {} if launch_limit is None else {"max_turns": launch_limit}
    run = child_loop(tmp_path, LOOPING, options=options, max_turns=worker_limit)

    result = run.loop.run()

    assert result.status is Status.FAILED
    assert result.error == f"max_turns: stopped after {calls} model calls"
    assert len(run.provider.requests) == calls and result.usage.model_calls == calls


def test_a_fork_past_its_wall_clock_limit_fails_and_makes_no_further_call(tmp_path: Path) -> None:
    slow = [step(call(f"l{i}", "list_directory"), delay_s=0.2) for i in range(20)]
    run = child_loop(tmp_path, slow, options={"max_wall_s": 0.5})

    began = time.monotonic()
    result = run.loop.run()

    assert result.status is Status.FAILED
    assert result.error is not None and result.error.startswith("wall_clock:")
    assert 0.5 <= time.monotonic() - began < 2.0
    assert len(run.provider.requests) == 3  # 0.2 s each: the third ends past the limit


def test_the_wall_clock_limit_counts_the_time_spent_before_a_revival(tmp_path: Path) -> None:
    run = child_loop(tmp_path, MIXED, running_s=10.0, max_wall_s=10.0)

    result = run.loop.run()

    assert result.status is Status.FAILED and (result.error or "").startswith("wall_clock:")
    assert run.provider.requests == [] and result.usage.duration_ms >= 10_000


def test_a_cancel_noticed_after_the_model_answered_runs_none_of_its_calls(tmp_path: Path) -> None:
    # Given a fork cancelled while its model call was in flight (seen at the next boundary)
    cancelled = {"now": False}

    class CancelledDuringTheCall(Recording):
        def generate(self, request: ModelRequest) -> ModelResponse:
            response = super().generate(request)
            cancelled["now"] = True
            return response

    run = child_loop(tmp_path, MIXED, stop_reason=lambda: "cancelled" if cancelled["now"] else None)
    run.loop.provider = CancelledDuringTheCall(run.provider.script)

    # When it goes on, it stops before the first side effect
    with pytest.raises(Stopped) as stopped:
        run.loop.run()

    # Then no call started and nothing ran
    assert stopped.value.reason == "cancelled"
    assert [e.kind for e in run.entries] == ["model"]
    assert not (run.work / "edited.txt").exists() and not (run.work / "shell.txt").exists()


def test_an_empty_final_answer_is_the_no_output_text(tmp_path: Path) -> None:
    run = child_loop(tmp_path, [step({"text": "thinking", "thought": True}, "  ")])

    result = run.loop.run()

    assert result.status is Status.SUCCEEDED and result.output == NO_OUTPUT


def test_replaying_a_denied_journal_rebuilds_the_denial_the_model_read(tmp_path: Path) -> None:
    # Given a loop parked on a shell command, and a person's denial appended to its journal
    steps = [step(call("s1", "run_shell_command", command="touch shell.txt")), step("ok")]
    first = child_loop(tmp_path, steps, mode="default", options={"approval_policy": "park"})
    with pytest.raises(Parked):
        first.loop.run()
    entries = [
        *first.entries,
        JournalEntry(
            seq=len(first.entries), step=0, kind="approval", call_index=0, call_id="s1", decision="deny", reason="no"
        ),
    ]

    # When a revived loop runs from that journal
    second = child_loop(tmp_path, steps, mode="default", options={"approval_policy": "park"}, entries=entries)
    second.journal.entries = list(entries)
    result = second.loop.run()

    # Then the denial answered the call, nothing ran, and a replay rebuilds the same messages
    assert result.status is Status.SUCCEEDED and not (second.work / "shell.txt").exists()
    assert "denied by the user: no" in tool_results(second.entries)["s1"]["error"]
    state = replay(ForkSeed(initial_messages=[], task_prompt="Begin."), second.entries)
    assert state.messages[:-1] == second.provider.requests[-1].messages


def test_an_approval_answers_only_the_call_it_was_given_for_not_a_later_steps_call_at_the_same_index(
    tmp_path: Path,
) -> None:
    # Given two steps that each make one shell call at index 0, under `default` with the park policy
    steps = [
        step(call("s1", "run_shell_command", command="touch first.txt")),
        step(call("s2", "run_shell_command", command="touch second.txt")),
        step("ok"),
    ]
    options = {"approval_policy": "park"}
    first = child_loop(tmp_path, steps, mode="default", options=options)
    with pytest.raises(Parked):
        first.loop.run()
    approved = JournalEntry(
        seq=len(first.entries), step=0, kind="approval", call_index=0, call_id="s1", decision="approve"
    )
    entries = [*first.entries, approved]

    # When the resumed loop runs the approved call and the model answers with the second one
    second = child_loop(tmp_path, steps, mode="default", options=options, entries=entries)
    second.journal.entries = list(entries)
    with pytest.raises(Parked) as parked:
        second.loop.run()

    # Then the first call ran, and the second parks for its own decision instead of riding on the first's
    assert (second.work / "first.txt").exists() and not (second.work / "second.txt").exists()
    assert [c.call_id for c in parked.value.calls] == ["s2"]
    # and a replay of that journal does not carry the step-0 decision over to step 1's call either
    state = replay(ForkSeed(initial_messages=[], task_prompt="Begin."), second.entries)
    assert state.decisions == {} and [p.call.id for p in state.pending] == ["s2"]

"""The fork's capabilities (issue #4): approval modes and policies, the `fork_tools` allowlist, nesting,
structured output, limits, cancellation and what the parent receives.

Two levels here: one worker delivery without a broker (`run_fork_job` on the real Redis: parking,
approvals, revivals); and live Celery workers, in-process or as subprocesses, for what needs a broker,
a heartbeat or a second worker. The first level, the child loop over an in-memory journal (the gate's
decisions, fast and exact), is in tests/loop/test_child.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from broker_config.settings import Settings
from tests.conftest import TEST_NAMESPACE, WorkerProcess
from tests.live import wait_until
from tests.loop_support import (
    FORK,
    MIXED,
    ONLY_READ_FILE,
    REGULAR,
    SCHEMA,
    UNDECLARED,
    VALID,
    Recording,
    call,
    parent_for,
    ran,
    scripted,
    started,
    step,
    tool_results,
    workdir,
    write_script,
)
from workers.app import runtime_of
from workers.base.keys import Keys
from workers.cli import main
from workers.client import ForkClient
from workers.errors import ForkNotEnded, InvalidAgentParams, InvalidApproval
from workers.loop.child import Stopped
from workers.providers import ModelRequest, ModelResponse
from workers.records.fork import BootstrapRecord, Status
from workers.records.journal import JournalEntry
from workers.records.notification import NO_OUTPUT
from workers.service.job import RunForkJob
from workers.service.runner import WorkerRuntime, run_fork_job
from workers.service.spawn import SubagentSpawner, nested_record
from workers.tools.builtins import builtin_tools

# ── one worker delivery on the real Redis (no broker) ─────────────────────────────────────────


@pytest.fixture
def runtimes() -> Iterator[list[WorkerRuntime]]:
    """Runtimes built by the test; their heartbeat threads stop afterwards."""
    built: list[WorkerRuntime] = []
    yield built
    for runtime in built:
        runtime.keeper.stop()


@pytest.fixture
def deliver(settings: Settings, runtimes: list[WorkerRuntime]) -> Callable[..., str]:
    """Run one delivery of a fork's job on a fresh worker runtime (scripted model, built-in tools)."""

    def run(fork_id: str, digest: str, steps: list[dict[str, Any]], provider: Any = None) -> str:
        runtime = WorkerRuntime(settings)
        runtime.provider = provider or scripted(steps)
        runtime.tools = builtin_tools()
        runtimes.append(runtime)
        return str(run_fork_job(runtime, RunForkJob(fork_id=fork_id, digest=digest)))  # the task's return value

    return run


def journal(settings: Settings, fork_id: str) -> list[JournalEntry]:
    return WorkerRuntime(settings).leases.journal(fork_id)


@dataclass(frozen=True)
class Expected:
    """What one approval mode and policy do with MIXED: the calls that ran, were denied, or parked."""

    mode: str
    policy: str
    ran: frozenset[str]
    denied: frozenset[str] = frozenset()
    parked: tuple[str, ...] = ()


APPROVAL_MATRIX = [
    Expected("yolo", "deny", ran=frozenset({"r1", "w1", "s1"})),
    Expected("yolo", "park", ran=frozenset({"r1", "w1", "s1"})),
    Expected("auto-edit", "deny", ran=frozenset({"r1", "w1"}), denied=frozenset({"s1"})),
    Expected("auto-edit", "park", ran=frozenset({"r1", "w1"}), parked=("s1",)),
    Expected("default", "deny", ran=frozenset({"r1"}), denied=frozenset({"w1", "s1"})),
    Expected("default", "park", ran=frozenset({"r1"}), parked=("w1", "s1")),
    Expected("plan", "deny", ran=frozenset({"r1"}), denied=frozenset({"w1", "s1"})),
    Expected("plan", "park", ran=frozenset({"r1"}), parked=("w1", "s1")),
]


@pytest.mark.parametrize("expected", APPROVAL_MATRIX, ids=[f"{e.mode}-{e.policy}" for e in APPROVAL_MATRIX])
def test_what_runs_is_denied_or_parks_in_each_approval_mode_and_policy(
    client: ForkClient, parent: dict[str, Any], tmp_path: Path, deliver: Callable[..., str], expected: Expected
) -> None:
    # Given a fork whose first step reads a file, edits a file and runs a shell command
    mode, ran_calls, denied, parked = expected.mode, expected.ran, expected.denied, list(expected.parked)
    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work, mode), FORK, approval_policy=expected.policy, workspace="shared")

    # When a worker runs it
    outcome = deliver(handle.fork_id, handle.digest, MIXED)

    # Then exactly the expected calls ran, with their side effects, and the others never started
    entries = journal(client.settings, handle.fork_id)
    responses = tool_results(entries)
    assert ran(entries) == ran_calls
    assert started(entries) == ran_calls
    assert (work / "edited.txt").exists() is ("w1" in ran_calls)
    assert (work / "shell.txt").exists() is ("s1" in ran_calls)
    for cid in denied:
        assert f"needs approval in approval mode {mode!r}" in responses[cid]["error"]
        assert "denied and did not run" in responses[cid]["error"]
    state = client.status(handle.fork_id)
    if not parked:
        assert outcome == "succeeded" and state.status is Status.SUCCEEDED
        assert set(responses) == {"r1", "w1", "s1"}
        return
    # and a parked fork waits holding no worker: no lease, out of the running index, calls in status and events
    keys = Keys(TEST_NAMESPACE)
    assert outcome == "awaiting_approval" and state.status is Status.AWAITING_APPROVAL
    assert [c.call_id for c in state.pending_approval] == parked
    assert set(responses) == ran_calls | denied
    assert client.redis.exists(keys.lease(handle.fork_id)) == 0
    assert client.redis.zscore(keys.running, handle.fork_id) is None
    [event] = [e for e in client.events(handle.fork_id) if e.type == "awaiting_approval"]
    assert event.data.calls == state.pending_approval
    assert client.result(handle.fork_id) is None


@pytest.mark.usefixtures("forkq_env")
def test_cli_approve_and_deny_decide_parked_calls_and_the_fork_goes_on_with_both_answers(
    client: ForkClient,
    parent: dict[str, Any],
    tmp_path: Path,
    deliver: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a fork parked on a file edit and a shell command
    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work, "default"), FORK, approval_policy="park", workspace="shared")
    fid = handle.fork_id
    assert deliver(fid, handle.digest, MIXED) == "awaiting_approval"
    assert main(["status", fid]) == 0
    assert "awaiting approval: w1 write_file" in capsys.readouterr().out

    # When a person approves the edit (the shell command still waits) and denies the shell command
    assert main(["approve", fid, "w1"]) == 0
    assert capsys.readouterr().out.strip() == "recorded: other calls still wait"
    assert client.status(fid).status is Status.AWAITING_APPROVAL
    assert main(["approve", fid, "w1"]) == 1  # decided already: no longer pending
    assert "no pending call 'w1'" in capsys.readouterr().err
    assert main(["deny", fid, "nope"]) == 1
    assert "calls awaiting approval: s1 (run_shell_command)" in capsys.readouterr().err
    assert main(["deny", fid, "s1", "--reason", "no shell on the shared box"]) == 0
    assert capsys.readouterr().out.strip() == "resumed: the fork is queued again"
    assert client.status(fid).status is Status.QUEUED
    assert main(["approve", fid, "s1"]) == 1
    assert "not awaiting approval" in capsys.readouterr().err

    # Then the next worker replays both decisions: the edit runs, the model reads the denial and its reason
    provider = scripted(MIXED)
    assert deliver(fid, handle.digest, [], provider=provider) == "succeeded"
    entries = journal(client.settings, fid)
    assert [(e.call_id, e.decision, e.reason) for e in entries if e.kind == "approval"] == [
        ("w1", "approve", None),
        ("s1", "deny", "no shell on the shared box"),
    ]
    assert (work / "edited.txt").read_text() == "edited" and not (work / "shell.txt").exists()
    denial = tool_results(entries)["s1"]["error"]
    assert "'run_shell_command' was denied by the user: no shell on the shared box" in denial
    [request] = provider.requests
    answers = {
        p.function_response.id: p.function_response.response for p in request.messages[-1].parts if p.function_response
    }
    assert answers["s1"] == {"error": denial} and "output" in answers["w1"]


def test_a_call_without_an_id_is_approved_by_its_step_and_index(
    settings: Settings, client: ForkClient, parent: dict[str, Any], tmp_path: Path, deliver: Callable[..., str]
) -> None:
    work = workdir(tmp_path)
    steps = [step(call(None, "run_shell_command", command="echo ok > shell.txt")), step("done")]
    handle = client.launch(parent_for(parent, work, "plan"), FORK, approval_policy="park", workspace="shared")
    assert deliver(handle.fork_id, handle.digest, steps) == "awaiting_approval"
    assert [c.call_id for c in client.status(handle.fork_id).pending_approval] == ["0.0"]

    assert client.approve(handle.fork_id, "0.0") == "queued"

    assert deliver(handle.fork_id, handle.digest, steps) == "succeeded"
    assert (work / "shell.txt").read_text() == "ok\n"


def test_approving_a_fork_that_is_not_parked_or_an_unknown_call_is_refused(
    client: ForkClient, parent: dict[str, Any], tmp_path: Path, deliver: Callable[..., str]
) -> None:
    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work, "default"), FORK, approval_policy="park", workspace="shared")
    with pytest.raises(InvalidApproval, match="is queued, not awaiting approval"):
        client.approve(handle.fork_id, "w1")
    assert deliver(handle.fork_id, handle.digest, MIXED) == "awaiting_approval"
    with pytest.raises(InvalidApproval, match="no pending call 'r1'"):
        client.deny(handle.fork_id, "r1", "read-only calls never wait")
    assert len([e for e in journal(client.settings, handle.fork_id) if e.kind == "approval"]) == 0


class Died(BaseException):
    """Stands for the worker process dying mid-call (nothing after it runs)."""


def test_the_wall_clock_limit_counts_from_the_first_start_across_a_revival(
    settings: Settings, client: ForkClient, parent: dict[str, Any], tmp_path: Path, deliver: Callable[..., str]
) -> None:
    # Given a fork with a 1.5 s limit whose first worker died 1 s into its first model call
    class DiesDuringTheCall:
        name = "dies"

        def generate(self, request: ModelRequest) -> ModelResponse:
            time.sleep(1.0)  # not a synchronization: the call takes 1 s of the fork's wall-clock limit
            raise Died

    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work), FORK, max_wall_s=1.5)
    with pytest.raises(Died):
        deliver(handle.fork_id, handle.digest, [], provider=DiesDuringTheCall())
    leases = WorkerRuntime(settings).leases
    leases.client.delete(leases.keys.lease(handle.fork_id))
    assert leases.revive(handle.fork_id, max_attempts=3) == "revive"

    # When another worker revives it, and its first model call takes 0.6 s (well within 1.5 s on its own)
    outcome = deliver(handle.fork_id, handle.digest, [step(call("l1", "list_directory"), delay_s=0.6), step("done")])

    # Then the fork fails at its limit, counted from the first start
    result = client.result(handle.fork_id)
    assert outcome == "failed" and result is not None
    assert (result.error or "").startswith("wall_clock:")
    assert result.usage.duration_ms >= 1500  # the second run alone took about 600 ms
    assert "l1" not in tool_results(journal(settings, handle.fork_id))


def test_a_notification_is_refused_until_the_fork_has_ended(client: ForkClient, parent: dict[str, Any]) -> None:
    handle = client.launch(parent, FORK)
    with pytest.raises(ForkNotEnded, match="no result to notify yet"):
        client.notification(handle.fork_id)


# ── launch refusals: nothing reaches Redis ────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("depth", "launch", "message"),
    [
        (1, {"params": FORK}, "Cannot spawn sub-agents from within a fork"),
        (2, {"params": FORK}, "Cannot spawn sub-agents from within a fork"),
        (3, {"params": REGULAR}, r"Nesting depth limit reached \(max 3\)"),
        (
            0,
            {"params": FORK, "output_schema": {"type": "object", "required": "fixed"}},
            "output_schema is not a valid JSON schema",
        ),
        (0, {"params": {**REGULAR, "fork_tools": ["read_file"]}}, 'can only be used with subagent_type "fork"'),
        (0, {"params": FORK, "approval_policy": "ask"}, "approval_policy must be one of deny, park"),
        (0, {"params": FORK, "max_turns": 0}, "max_turns must be a positive number"),
    ],
    ids=["fork-at-depth-1", "fork-at-depth-2", "subagent-past-limit", "bad-schema", "fork-tools", "policy", "turns"],
)
def test_a_launch_breaking_a_capability_rule_is_refused_and_writes_nothing(
    client: ForkClient, parent: dict[str, Any], depth: int, launch: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidAgentParams, match=message):
        client.launch({**parent, "depth": depth}, **launch)
    assert client.redis.dbsize() == 0


def test_a_regular_subagent_may_be_launched_below_the_depth_limit_without_history(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    handle = client.launch({**parent, "depth": 2}, REGULAR)

    record = client.inspect(handle.fork_id)
    assert (record["kind"], record["depth"], record["initial_messages"]) == ("spawn", 3, [])


@pytest.mark.usefixtures("forkq_env")
def test_cli_launch_records_the_approval_policy_schema_limits_and_allowlist(
    client: ForkClient, parent: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent_file, schema_file = tmp_path / "parent.json", tmp_path / "schema.json"
    parent_file.write_text(json.dumps(parent), encoding="utf-8")
    schema_file.write_text(json.dumps(SCHEMA), encoding="utf-8")
    common = ["launch", "--parent", str(parent_file), "--prompt", "Fix it.", "--subagent-type", "fork", "--json"]

    code = main(
        [
            *common,
            *("--approval-policy", "park", "--output-schema", str(schema_file)),
            *("--max-turns", "7", "--max-wall-s", "90", "--fork-tools", "read_file,mcp__github__read_*"),
        ]
    )

    assert code == 0
    fork_id = json.loads(capsys.readouterr().out)["fork_id"]
    record = client.store.get_record(fork_id, None)
    assert record.options.model_dump() == {
        "approval_policy": "park",
        "output_schema": SCHEMA,
        "max_turns": 7,
        "max_wall_s": 90.0,
        "fork_tools": ["read_file", "mcp__github__read_*"],
    }
    # an invalid schema file is a usage error naming the option, and launches nothing
    schema_file.write_text(json.dumps({"type": "strin"}), encoding="utf-8")
    assert main([*common, "--output-schema", str(schema_file)]) == 2
    assert "output_schema is not a valid JSON schema" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse: not one of deny, park
        main([*common, "--approval-policy", "ask"])
    assert usage.value.code == 2
    assert len(client.redis.keys("*:state")) == 1


# ── live workers ──────────────────────────────────────────────────────────────────────────────


def recording_provider(app: Celery, steps: list[dict[str, Any]]) -> Recording:
    """Replace the in-process worker's provider with a recording one over the same script."""
    provider = scripted(steps)
    runtime_of(app).provider = provider  # a cached property: the instance attribute replaces it
    return provider


def test_a_parked_fork_denied_by_a_person_goes_on_and_its_model_reads_the_denial(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a live worker and a fork that parks on a shell command
    steps = [step(call("s1", "run_shell_command", command="touch denied.txt")), step("done without the shell")]
    client = live(steps)
    provider = recording_provider(client.app, steps)
    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work, "default"), FORK, approval_policy="park", workspace="shared")
    wait_until(lambda: handle.status().status is Status.AWAITING_APPROVAL, what="the fork to park")
    assert [c.wire() for c in handle.status().pending_approval] == [
        {"call_id": "s1", "index": 0, "step": 0, "name": "run_shell_command", "args": {"command": "touch denied.txt"}}
    ]

    # When a person denies it
    assert client.deny(handle.fork_id, "s1", "not on this machine") == "queued"

    # Then the fork resumes, the shell never ran, and the next model request carries the denial
    result = handle.wait(timeout=20)
    assert result.status is Status.SUCCEEDED and result.output == "done without the shell"
    assert not (work / "denied.txt").exists()
    last = provider.requests[-1]
    assert last.step == 1
    [part] = last.messages[-1].parts
    assert part.function_response is not None and part.function_response.id == "s1"
    assert "was denied by the user: not on this machine" in part.function_response.response["error"]
    types = [e.type for e in client.events(handle.fork_id)]
    assert types.count("started") == 2  # one run before the decision, one after
    assert types.index("awaiting_approval") < types.index("denied") < len(types) - 1


@pytest.mark.slow
def test_a_worker_process_refuses_a_forks_call_to_a_tool_its_parent_never_declared(
    client: ForkClient,
    parent: dict[str, Any],
    tmp_path: Path,
    worker_process: Callable[..., WorkerProcess],
) -> None:
    # Given a parent in yolo that declared only read_file, and a model that calls run_shell_command anyway
    steps = [step(call("s1", "run_shell_command", command="touch escaped.txt")), step("could not run it")]
    worker = worker_process(FORKQ_SCRIPT=str(write_script(tmp_path, steps)), FORKQ_HEARTBEAT_FILE=str(tmp_path / "hb"))
    work = workdir(tmp_path)

    # When a worker process, which has run_shell_command, runs the fork
    handle = client.launch(parent_for(parent, work, "yolo", tools=ONLY_READ_FILE), FORK)
    result = handle.wait(timeout=30)

    # Then the call was answered with an error naming the declared tools, and never started or ran
    assert result.status is Status.SUCCEEDED and result.output == "could not run it", worker.log()
    entries = journal(client.settings, handle.fork_id)
    assert tool_results(entries)["s1"] == {"error": UNDECLARED}
    assert started(entries) == set() and not (work / "escaped.txt").exists()


@pytest.mark.slow
def test_a_parked_fork_approved_by_a_person_resumes_on_another_worker(
    client: ForkClient,
    parent: dict[str, Any],
    tmp_path: Path,
    worker_process: Callable[..., WorkerProcess],
) -> None:
    # Given a worker process that parks a fork on a file edit, and then stops
    steps = [step(call("w1", "write_file", path="approved.txt", content="approved")), step("wrote it")]
    env = {"FORKQ_SCRIPT": str(write_script(tmp_path, steps)), "FORKQ_HEARTBEAT_FILE": str(tmp_path / "hb")}
    first = worker_process(**env)
    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work, "default"), FORK, approval_policy="park", workspace="shared")
    wait_until(lambda: handle.status().status is Status.AWAITING_APPROVAL, timeout=30, what="the fork to park")
    assert not (work / "approved.txt").exists()
    [parked] = [e for e in client.events(handle.fork_id) if e.type == "awaiting_approval"]
    assert [c.call_id for c in parked.data.calls] == ["w1"]
    first.stop()

    # When a person approves the call and a second worker process starts
    assert client.approve(handle.fork_id, "w1") == "queued"
    second = worker_process(**env)
    result = handle.wait(timeout=30)

    # Then the second worker ran the approved call and finished the fork
    assert result.status is Status.SUCCEEDED and result.output == "wrote it", second.log()
    assert (work / "approved.txt").read_text() == "approved"
    owners = [e.data.owner for e in client.events(handle.fork_id) if e.type == "started"]
    assert [int(owner.split(":")[1]) for owner in owners] == [first.process.pid, second.process.pid]
    assert first.process.poll() is not None


def test_a_regular_subagent_runs_a_nested_subagent_whose_output_answers_its_agent_call(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given workers allowing two levels, and a script whose first step calls the Agent tool
    nested_args = {"description": "count calls", "prompt": "Count the INCR calls.", "subagent_type": "general-purpose"}
    steps = [step(call("a1", "Agent", **nested_args)), step("report: 1 INCR call")]
    client = live(steps, max_subagent_depth=2)
    work = workdir(tmp_path)

    # When a top-level session launches a regular subagent (depth 1)
    handle = client.launch(parent_for(parent, work), REGULAR)
    result = handle.wait(timeout=30)

    # Then its Agent call launched a nested subagent (depth 2, no history) and got its output
    assert result.status is Status.SUCCEEDED, result.error
    nested_id = f"{handle.fork_id}.0.0"
    nested = client.result(nested_id)
    assert nested is not None and nested.status is Status.SUCCEEDED
    record = client.inspect(nested_id)
    assert (record["kind"], record["depth"], record["initial_messages"]) == ("spawn", 2, [])
    assert record["task_prompt"] == "Count the INCR calls."
    assert tool_results(journal(client.settings, handle.fork_id))["a1"] == {"output": nested.output}
    # and the nested subagent, at the limit, was refused its own Agent call
    assert tool_results(journal(client.settings, nested_id))["a1"]["error"].startswith(
        "Error: Nesting depth limit reached (max 2)"
    )


def test_a_launch_max_depth_lowers_the_nesting_limit_for_the_whole_tree(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given workers allowing three levels, and a script whose first step calls the Agent tool for Explore
    nested_args = {"description": "look", "prompt": "Find the limiter.", "subagent_type": "Explore"}
    steps = [step(call("a1", "Agent", **nested_args)), step("found it")]
    client = live(steps, max_subagent_depth=3)

    # When a regular subagent is launched with max_depth 2, and another with max_depth 1
    two = client.launch(parent_for(parent, workdir(tmp_path)), REGULAR, max_depth=2)
    one = client.launch(parent_for(parent, workdir(tmp_path)), REGULAR, max_depth=1)
    assert two.wait(timeout=30).status is Status.SUCCEEDED
    assert one.wait(timeout=30).status is Status.SUCCEEDED

    # Then the first ran a nested Explore subagent (its persona and read-only tools, the limit carried over)
    nested = client.inspect(f"{two.fork_id}.0.0")
    assert (nested["agent"], nested["max_depth"], nested["depth"]) == ("Explore", 2, 2)
    assert [t["name"] for t in nested["tools"]] == ["read_file", "list_directory", "glob", "grep_search"]
    # which, at the lowered limit, was refused its own Agent call
    assert tool_results(journal(client.settings, f"{two.fork_id}.0.0"))["a1"]["error"].startswith(
        "Error: Nesting depth limit reached (max 2)"
    )
    # and the second's Agent call was refused at once: depth 2 is past its max_depth 1
    assert tool_results(journal(client.settings, one.fork_id))["a1"]["error"].startswith(
        "Error: Nesting depth limit reached (max 1)"
    )


def test_a_nested_agent_call_naming_an_unknown_type_is_answered_with_the_known_types(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    spawner, record = nested_wait_setup(client, parent)
    outcome = spawner.spawn(
        record,
        {"description": "d", "prompt": "p", "subagent_type": "reviewer"},
        f"{record.fork_id}.0.0",
        cancelled=lambda: False,
        deadline=time.monotonic() + 5,
    )
    assert outcome["error"].startswith("Error: Unknown subagent_type 'reviewer': the known types are")
    assert '"Explore", "general-purpose"' in outcome["error"]


def test_a_nested_subagent_gets_its_definition_within_its_callers_tools(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a caller launched with only read_file and glob
    caller = client.launch(
        {**parent, "history": []}, {"description": "c", "prompt": "Delegate."}, tool_filter=["read_file", "glob"]
    )
    record = client.store.get_record(caller.fork_id, caller.digest)

    # When it asks for Explore (four read-only tools) and for general-purpose (everything)
    explore = nested_record(record, {**REGULAR, "subagent_type": "Explore"}, f"{caller.fork_id}.0.0")
    general = nested_record(record, REGULAR, f"{caller.fork_id}.0.1")

    # Then neither gets a tool its caller lacks
    assert [t["name"] for t in explore.tools] == ["read_file", "glob"]
    assert explore.system_instruction != record.system_instruction and explore.options.agent == "Explore"
    assert [t["name"] for t in general.tools] == ["read_file", "glob"]
    assert general.system_instruction == record.system_instruction


def test_a_nested_subagent_belongs_to_its_callers_tenant_and_session(
    make_settings: Callable[..., Settings], parent: dict[str, Any]
) -> None:
    # Given a caller launched by tenant acme
    with ForkClient(make_settings(tenant="acme")) as acme:
        caller = acme.launch({**parent, "history": []}, {"description": "c", "prompt": "Delegate."})
        record = acme.store.get_record(caller.fork_id, caller.digest)

    # When it asks for a subagent, Then the subagent is acme's, in acme's scope of the caller's session
    child = nested_record(record, REGULAR, f"{caller.fork_id}.0.0")
    assert (record.tenant, child.tenant) == ("acme", "acme")
    assert child.parent_session == record.parent_session == f"{parent['session_id']} @acme"


def test_structured_output_retries_through_a_live_worker_and_fails_when_exhausted(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a script answering prose, then JSON of the wrong shape, then a valid answer
    client = live([step("It is fixed."), step('{"fixed": true}'), step(VALID)])
    work = workdir(tmp_path)
    strict = {**SCHEMA, "properties": {**SCHEMA["properties"], "fixed": {"const": False}}}

    # When one fork asks for SCHEMA and another for a schema no answer meets
    ok = client.launch(parent_for(parent, work), FORK, output_schema=SCHEMA)
    exhausted = client.launch(parent_for(parent, work), FORK, output_schema=strict)

    # Then the first succeeds with the valid JSON after two feedbacks, the second fails after three tries
    result = ok.wait(timeout=20)
    assert result.status is Status.SUCCEEDED and json.loads(result.output or "") == json.loads(VALID)
    assert [e.kind for e in journal(client.settings, ok.fork_id)].count("feedback") == 2
    failed = exhausted.wait(timeout=20)
    assert failed.status is Status.FAILED
    assert (failed.error or "").startswith("output_schema:") and "after 3 tries" in (failed.error or "")


def test_launch_limits_stop_a_looping_fork_through_a_live_worker(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    client = live([step(call(f"l{i}", "list_directory"), delay_s=0.4) for i in range(30)])
    work = workdir(tmp_path)

    turns = client.launch(parent_for(parent, work), FORK, max_turns=2)
    wall = client.launch(parent_for(parent, work), FORK, max_wall_s=1.0)  # calls end at 0.4, 0.8, 1.2 s

    by_turns, by_wall = turns.wait(timeout=20), wall.wait(timeout=20)
    assert (by_turns.status, by_turns.error) == (Status.FAILED, "max_turns: stopped after 2 model calls")
    assert by_wall.status is Status.FAILED and (by_wall.error or "").startswith("wall_clock:")
    assert by_wall.usage.model_calls == 3


def test_a_fork_cancelled_during_its_model_call_runs_none_of_that_responses_tools(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path, finished: dict[str, Any]
) -> None:
    # Given a fork whose first model call takes 1.5 s and asks for a file edit and a shell command
    slow = step(
        call("w1", "write_file", path="edited.txt", content="x"),
        call("s1", "run_shell_command", command="touch shell.txt"),
        delay_s=1.5,
    )
    client = live([slow, step("done")])
    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work), FORK)
    wait_until(lambda: any(e.type == "model_call" for e in handle.events()), what="the model call to start")

    # When it is cancelled while the call is in flight
    assert handle.cancel() is Status.CANCELLED
    wait_until(lambda: f"{handle.fork_id}.1" in finished, what="the worker to finish the delivery")

    # Then the response was never recorded, no tool started, nothing happened, and the fork stays cancelled
    assert finished[f"{handle.fork_id}.1"] == "cancelled"  # not a lease loss: metrics and Flower say so
    assert [e.kind for e in journal(client.settings, handle.fork_id)] == ["surface"]
    assert not (work / "edited.txt").exists() and not (work / "shell.txt").exists()
    assert handle.status().status is Status.CANCELLED
    result = client.result(handle.fork_id)
    assert result is not None and result.status is Status.CANCELLED


def process_alive(pid: int) -> bool:
    """A process exists and is not a zombie (a killed orphan may wait for a reaper that never comes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_fork_cancelled_during_a_shell_command_kills_it_and_does_nothing_more(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path, finished: dict[str, Any]
) -> None:
    # Given a worker with a fast heartbeat, and a fork running a 30 s shell command, then an edit
    command = "sleep 30 & echo $! > sleep.pid; touch started; wait; touch after.txt"
    steps = [
        step(call("s1", "run_shell_command", command=command, timeout_s=60)),
        step(call("w1", "write_file", path="next.txt", content="x")),
    ]
    client = live(steps, heartbeat_s=0.5, lease_ttl_s=2)
    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work), FORK, workspace="shared")
    wait_until(lambda: (work / "started").exists() and (work / "sleep.pid").stat().st_size > 0, what="the command")
    sleeper = int((work / "sleep.pid").read_text())
    assert process_alive(sleeper)

    # When the fork is cancelled
    began = time.monotonic()
    assert handle.cancel() is Status.CANCELLED

    # Then the heartbeat notices, the command's process group is killed long before its 30 s
    wait_until(lambda: not process_alive(sleeper), timeout=10, what="the shell's process group to be killed")
    assert time.monotonic() - began < 5
    wait_until(lambda: f"{handle.fork_id}.1" in finished, what="the worker to finish the delivery")
    # and nothing more happened: the command did not go on, the next step was never asked for or run
    assert finished[f"{handle.fork_id}.1"] == "cancelled"  # not a lease loss: metrics and Flower say so
    assert not (work / "after.txt").exists() and not (work / "next.txt").exists()
    entries = journal(client.settings, handle.fork_id)
    assert [e.kind for e in entries] == ["surface", "model", "tool_started"]
    assert handle.status().status is Status.CANCELLED


def test_the_parent_is_notified_of_only_the_final_output_with_escaped_fields(
    live: Callable[..., ForkClient],
    parent: dict[str, Any],
    tmp_path: Path,
    forkq_env: Settings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a fork that lists a directory, thinks aloud, and ends without any visible text
    steps = [step(call("l1", "list_directory")), step({"text": "<private & thoughtful>", "thought": True})]
    client = live(steps)
    work = workdir(tmp_path)
    handle = client.launch(parent_for(parent, work), {**FORK, "description": 'check <limits> & "quotas"'})
    result = handle.wait(timeout=20)
    assert result.status is Status.SUCCEEDED

    # When the parent asks for its notification, from Python and from the CLI
    notification = client.notification(handle.fork_id)
    assert main(["result", handle.fork_id, "--notification"]) == 0

    # Then it is the same text: the escaped description, the no-output text, the usage; never the work
    assert capsys.readouterr().out.strip() == notification
    assert f"<task-id>{handle.fork_id}</task-id>" in notification
    assert "<status>completed</status>" in notification
    assert '<summary>Agent "check &lt;limits&gt; &amp; "quotas"" completed</summary>' in notification
    assert f"<result>{NO_OUTPUT}</result>" in notification
    assert "<tool_uses>1</tool_uses>" in notification
    assert "thoughtful" not in notification and "notes.txt" not in notification


def test_only_the_final_answer_and_usage_are_in_the_result(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    client = live([step("Reading first.", call("r1", "read_file", path="notes.txt")), step("final answer")])
    work = workdir(tmp_path)

    result = client.launch(parent_for(parent, work), FORK).wait(timeout=20)

    assert result.output == "final answer"
    assert result.usage.tool_uses == 1 and result.usage.model_calls == 2
    assert result.usage.total_tokens == result.usage.input_tokens + result.usage.output_tokens > 0
    assert result.usage.duration_ms > 0


def nested_wait_setup(client: ForkClient, parent: dict[str, Any]) -> tuple[SubagentSpawner, BootstrapRecord]:
    """A regular subagent's record (launched, never run) and a spawner over the same store that enqueues nothing."""
    caller = client.launch({**parent, "history": []}, {"description": "caller", "prompt": "Delegate the review."})
    record = client.store.get_record(caller.fork_id, caller.digest)
    return SubagentSpawner(client.store, lambda *_: None, threading.Event()), record


def test_a_caller_that_lost_its_lease_stops_waiting_and_leaves_its_subagent_running(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a caller waiting for its nested subagent, whose lease is lost (it is not cancelled)
    spawner, record = nested_wait_setup(client, parent)
    child_id = f"{record.fork_id}.0.0"

    # When the wait notices the loss
    with pytest.raises(Stopped) as stopped:
        spawner.spawn(record, REGULAR, child_id, cancelled=lambda: True, deadline=time.monotonic() + 60)

    # Then the caller stops (its revival waits again) and the subagent was not cancelled
    assert stopped.value.reason == "lease_lost"
    assert client.status(child_id).status is Status.QUEUED


def test_a_cancelled_caller_cancels_the_subagent_it_waits_for(client: ForkClient, parent: dict[str, Any]) -> None:
    spawner, record = nested_wait_setup(client, parent)
    child_id = f"{record.fork_id}.0.0"
    client.cancel(record.fork_id)

    outcome = spawner.spawn(record, REGULAR, child_id, cancelled=lambda: True, deadline=time.monotonic() + 60)

    assert client.status(child_id).status is Status.CANCELLED
    assert "the subagent cancelled" in outcome["error"]


def test_a_caller_past_its_wall_clock_stops_waiting_and_cancels_its_subagent(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    spawner, record = nested_wait_setup(client, parent)
    child_id = f"{record.fork_id}.0.0"

    outcome = spawner.spawn(record, REGULAR, child_id, cancelled=lambda: False, deadline=time.monotonic())

    assert "wall-clock limit" in outcome["error"]
    assert client.status(child_id).status is Status.CANCELLED


def test_a_nested_subagent_never_parks_even_when_its_caller_may(client: ForkClient, parent: dict[str, Any]) -> None:
    caller = client.launch(
        {**parent, "history": []}, {"description": "caller", "prompt": "Delegate."}, approval_policy="park"
    )
    record = client.store.get_record(caller.fork_id, caller.digest)

    child = nested_record(record, REGULAR, f"{caller.fork_id}.0.0")

    assert record.options.approval_policy == "park" and "approval_policy" not in child.options.model_dump()


def test_time_spent_waiting_for_a_person_does_not_count_against_the_wall_clock_limit(
    client: ForkClient, redis_client: Any, parent: dict[str, Any], tmp_path: Path, deliver: Callable[..., str]
) -> None:
    # Given a fork with a 60 s wall clock, parked on a shell command, that has waited an hour for a person
    work = workdir(tmp_path)
    steps = [step(call("s1", "run_shell_command", command="echo ok > shell.txt")), step("done")]
    handle = client.launch(
        parent_for(parent, work, "default"), FORK, approval_policy="park", max_wall_s=60, workspace="shared"
    )
    assert deliver(handle.fork_id, handle.digest, steps) == "awaiting_approval"
    state_key = client.store.keys.state(handle.fork_id)
    hour_ms = 3_600_000
    for field_name in ("first_started_ms", "parked_ms"):
        redis_client.hincrby(state_key, field_name, -hour_ms)

    # When the person approves and the fork runs again
    assert client.approve(handle.fork_id, "s1") == "queued"
    outcome = deliver(handle.fork_id, handle.digest, steps)

    # Then the hour parked was not charged: the approved call ran and the fork finished
    result = client.result(handle.fork_id)
    assert outcome == "succeeded", result
    assert (work / "shell.txt").read_text() == "ok\n"

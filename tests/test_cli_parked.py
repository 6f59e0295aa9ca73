"""`forkq` on forks a person must act on, run by real workers: parked (result, approve, deny), paused (resume),
and cancelled mid-run (the usage it keeps)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery.worker import WorkController
from celery.worker import state as worker_state

from tests.cli_support import PARENT, Run, call, events_of, launch, parent_file, step, wait_for
from tests.conftest import REPO_ROOT

PARKING = [step(call("w1", "write_file", path="a.txt", content="a"), call("s1", "run_shell_command", command="true"))]


def parked_fork(forkq: Run, tmp_path: Path) -> str:
    """A fork launched through the CLI and parked on a file edit and a shell command (approval mode default)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    parent = parent_file(tmp_path, cwd=str(work), approval_mode="default")
    fork_id = launch(forkq, "--approval-policy", "park", "--parent", parent)
    wait_for(lambda: forkq("status", fork_id)[1].startswith(f"{fork_id} awaiting_approval"), "the fork to park")
    return fork_id


def test_result_wait_on_a_fork_awaiting_approval_exits_3_at_once_with_its_pending_calls(
    forkq: Run, tmp_path: Path, scripted_worker: Callable[..., WorkController]
) -> None:
    scripted_worker([*PARKING, step("done")])
    fork_id = parked_fork(forkq, tmp_path)

    started = time.monotonic()
    code, out, _ = forkq("result", fork_id, "--wait", "--timeout", "20", "--json")
    text_code, _, err = forkq("result", fork_id, "--wait", "--timeout", "20")
    waited = time.monotonic() - started

    assert (code, text_code) == (3, 3)
    assert waited < 10  # at once, not at the end of the timeout
    printed = json.loads(out)
    assert (printed["status"], printed["output"], printed["usage"]) == ("awaiting_approval", None, None)
    assert [(c["call_id"], c["name"]) for c in printed["pending_approval"]] == [
        ("w1", "write_file"),
        ("s1", "run_shell_command"),
    ]
    assert "awaiting_approval" in err and f"forkq approve {fork_id} CALL_ID" in err
    assert "awaiting approval: w1 write_file" in err and "worker" not in err.split("\n")[0].split(":")[-1]
    # what it waits for has its own field, and the error is only for errors
    calls = [{"call_id": "w1", "name": "write_file"}, {"call_id": "s1", "name": "run_shell_command"}]
    assert printed["waiting_for"] == {"kind": "approval", "calls": calls} and printed["error"] is None


def test_status_and_inspect_say_what_a_parked_fork_waits_for_in_the_cli_words(
    forkq: Run, tmp_path: Path, scripted_worker: Callable[..., WorkController]
) -> None:
    scripted_worker([*PARKING, step("done")])
    fork_id = parked_fork(forkq, tmp_path)

    _, status, _ = forkq("status", fork_id)
    _, state, _ = forkq("status", fork_id, "--json")
    _, inspected, _ = forkq("inspect", fork_id)
    _, record, _ = forkq("inspect", fork_id, "--json")

    waits = f"  waiting for approval of w1 (write_file), s1 (run_shell_command): `forkq approve|deny {fork_id} CALL_ID`"
    assert status.splitlines()[:2] == [f"{fork_id} awaiting_approval attempt=1", waits]  # no error= on the first line
    assert waits in inspected.splitlines()
    assert json.loads(state)["waiting_for"]["kind"] == json.loads(record)["waiting_for"]["kind"] == "approval"
    assert json.loads(state)["error"] is None


def test_approve_and_deny_json_print_the_decision_and_the_fork_then_succeeds(
    forkq: Run, tmp_path: Path, scripted_worker: Callable[..., WorkController]
) -> None:
    scripted_worker([*PARKING, step("done")])
    fork_id = parked_fork(forkq, tmp_path)

    approved = forkq("approve", fork_id, "w1", "--json")
    denied = forkq("deny", fork_id, "s1", "--reason", "not here", "--json")

    assert approved[0] == 0 and json.loads(approved[1]) == {
        "fork_id": fork_id,
        "call_id": "w1",
        "decision": "approve",
        "outcome": "recorded",
    }
    assert denied[0] == 0 and json.loads(denied[1]) == {
        "fork_id": fork_id,
        "call_id": "s1",
        "decision": "deny",
        "outcome": "queued",
    }
    code, out, err = forkq("result", fork_id, "--wait", "--timeout", "30", "--json")
    assert code == 0, err
    assert json.loads(out)["status"] == "succeeded"


def test_a_fork_cancelled_after_two_model_calls_keeps_their_usage_in_its_result_and_notification(
    forkq: Run, tmp_path: Path, scripted_worker: Callable[..., WorkController]
) -> None:
    # Given a fork whose model answers twice with a tool call, then takes its time over the third answer
    work = tmp_path / "work"
    work.mkdir()
    listing = [step(call("l1", "list_directory")), step(call("l2", "list_directory")), step("late", delay_s=4)]
    scripted_worker(listing)
    fork_id = launch(forkq, "--parent", parent_file(tmp_path, cwd=str(work)))
    wait_for(lambda: [e["type"] for e in events_of(forkq, fork_id)].count("model_call") == 3, "the third model call")

    # When it is cancelled during that third call
    code, out, _ = forkq("cancel", fork_id, "--json")

    # Then its result and notification report the two model calls it made and their tokens
    assert code == 0 and json.loads(out) == {"fork_id": fork_id, "status": "cancelled"}
    steps = [e["data"] for e in events_of(forkq, fork_id) if e["type"] == "step"]
    tokens = sum(s["input_tokens"] + s["output_tokens"] for s in steps)
    _, out, _ = forkq("result", fork_id, "--json")
    usage = json.loads(out)["usage"]
    assert len(steps) == 2 and tokens > 0
    assert (usage["model_calls"], usage["tool_uses"], usage["total_tokens"]) == (2, 2, tokens)
    assert usage["input_tokens"] == sum(s["input_tokens"] for s in steps)
    assert usage["duration_ms"] > 0
    _, notification, _ = forkq("result", fork_id, "--notification")
    assert "<status>cancelled</status>" in notification
    assert f"<total_tokens>{tokens}</total_tokens><tool_uses>2</tool_uses>" in notification
    assert "<duration_ms>0</duration_ms>" not in notification
    finished = [e for e in events_of(forkq, fork_id) if e["type"] == "finished"]
    assert finished[-1]["data"]["usage"]["model_calls"] == 2
    wait_for(lambda: not worker_state.active_requests, "the cancelled run to see the cancel and end")


# ── a paused fork: its first worker killed, revived on a worker that lacks a tool it started with ──

PROBE = {"name": "cli_probe", "description": "Answers ok.", "parameters": {"type": "object", "properties": {}}}
PROBE_PLUGIN = f'''
"""A `forkq.tools` plugin some workers of test_cli_parked.py have and others lack."""

from workers.tools import Tool


def tools():
    return [Tool("cli_probe", "Answers ok.", {PROBE["parameters"]!r}, lambda args, ctx: "ok")]
'''


@pytest.fixture
def probe_plugin(tmp_path: Path) -> Path:
    """A directory with the `cli_probe` tool as an installed distribution (dist-info, `forkq.tools` entry point)."""
    root = tmp_path / "plugin"
    dist = root / "forkq_cli_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (root / "forkq_cli_probe.py").write_text(PROBE_PLUGIN, encoding="utf-8")
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: forkq-cli-probe\nVersion: 0.0\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text("[forkq.tools]\nprobe = forkq_cli_probe:tools\n", encoding="utf-8")
    return root


def model_calls(forkq: Run, fork_id: str) -> int:
    return [e["type"] for e in events_of(forkq, fork_id)].count("model_call")


def revived(forkq: Run) -> bool:
    code, out, err = forkq("sweep", "--once", "--json")
    assert code == 0, err
    return bool(json.loads(out)["outcomes"].get("revive"))


@pytest.fixture
def paused_fork(forkq: Run, tmp_path: Path, worker_process: Callable[..., Any], probe_plugin: Path) -> str:
    """A fork launched through the CLI whose first worker (with the `cli_probe` plugin) is killed mid-run,
    then revived by a worker process without the plugin, which pauses it: the fork started with that tool."""
    work = tmp_path / "work"
    work.mkdir()
    tools = [*json.loads(Path(PARENT).read_text(encoding="utf-8"))["tools"], PROBE]
    fork_id = launch(forkq, "--fork-turns", "1", "--parent", parent_file(tmp_path, cwd=str(work), tools=tools))
    # the first run lists the directory (its tool surface is journaled with that step), then dwells on its next answer
    script = tmp_path / "first-run.json"
    script.write_text(json.dumps({"steps": [step(call("l1", "list_directory")), step("late", delay_s=300)]}))
    lease = {"FORKQ_SCRIPT": str(script), "FORKQ_LEASE_TTL_S": "2", "FORKQ_HEARTBEAT_S": "1"}
    first = worker_process(PYTHONPATH=os.pathsep.join([str(probe_plugin), str(REPO_ROOT)]), **lease)
    wait_for(lambda: model_calls(forkq, fork_id) == 2, "the first worker's second model call", timeout=60)
    first.process.kill()  # SIGKILL: the worker dies mid-fork
    first.process.wait(timeout=10)
    second = worker_process(**lease)  # no plugin: it lacks cli_probe
    wait_for(lambda: revived(forkq), "the sweep to revive the fork once its lease lapsed", timeout=30)
    wait_for(lambda: forkq("status", fork_id)[1].startswith(f"{fork_id} paused"), "the reviving worker to pause it", 60)
    assert second.stop(timeout=30) == 0, second.log()  # it would take the resumed job and pause it again
    return fork_id


@pytest.mark.slow
def test_resume_queues_a_paused_fork_and_a_worker_runs_it_to_success(
    forkq: Run,
    paused_fork: str,
    probe_plugin: Path,
    scripted_worker: Callable[..., WorkController],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a fork paused because its reviving worker lacked a tool it started with
    fork_id = paused_fork
    code, out, _ = forkq("result", fork_id, "--wait", "--timeout", "20", "--json")
    assert code == 3
    parked = json.loads(out)
    assert parked["status"] == "paused" and parked["error"] is None
    assert parked["waiting_for"]["kind"] == "resume" and "cli_probe" in parked["waiting_for"]["reason"]
    status = forkq("status", fork_id)[1].splitlines()
    assert status[0] == f"{fork_id} paused attempt=2" and status[1].startswith("  waiting for resume: declared tool")
    assert status[1].endswith(f"once that is fixed, `forkq resume {fork_id}`") and "cli_probe" in status[1]

    # When an operator resumes it and a worker with the plugin consumes the queue
    code, out, err = forkq("resume", fork_id, "--json")
    assert code == 0, err
    assert json.loads(out) == {"fork_id": fork_id, "resumed": True, "status": "queued"}
    monkeypatch.syspath_prepend(str(probe_plugin))  # this process's worker loads the plugin's entry point
    scripted_worker([step(call("l1", "list_directory")), step("resumed and done")])

    # Then it runs to success from its journal, and a second resume finds nothing to do
    code, out, err = forkq("result", fork_id, "--wait", "--timeout", "30", "--json")
    assert code == 0, err
    assert (json.loads(out)["status"], json.loads(out)["output"]) == ("succeeded", "resumed and done")
    assert model_calls(forkq, fork_id) == 3  # two before the kill, one after the resume
    again = forkq("resume", fork_id, "--json")
    assert again[0] == 1 and json.loads(again[1]) == {"fork_id": fork_id, "resumed": False, "status": "succeeded"}
    assert forkq("resume", fork_id)[:2] == (1, f"fork {fork_id} is succeeded, not paused: nothing to resume\n")

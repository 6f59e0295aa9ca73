"""The `forkq` command, in-process through `main` and once as the installed script with a worker process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.worker import WorkController
from celery.worker import state as worker_state

import workers
from broker_config.settings import Settings
from workers.cli import main
from workers.history import build_fork_seed
from workers.params import MSG_FORK_TURNS_VALUE
from workers.snapshot import load_parent_snapshot

PARENT = str(Path(workers.__file__).parent / "examples" / "parent.json")
FORKQ = str(Path(sys.executable).parent / "forkq")
PROMPT = "Write the expiry tests."
INSPECT_KEYS = {
    "fork_id",
    "digest",
    "kind",
    "initial_messages",
    "task_prompt",
    "directive",
    "system_instruction",
    "tools",
    "model",
    "approval_mode",
    "cwd",
    "depth",
    "fork_turns",
}


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def forkq(forkq_env: Settings, capsys: pytest.CaptureFixture[str]) -> Run:
    """Run `forkq ARGS...` in-process with the test's FORKQ_* environment: (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def launch(forkq: Run, *extra: str) -> str:
    code, out, err = forkq("launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork", *extra)
    assert code == 0, err
    return out.strip()


# ── launch ────────────────────────────────────────────────────────────────────────────────────


def test_launch_json_prints_the_fork_id_and_its_status(forkq: Run) -> None:
    code, out, err = forkq(
        "launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork", "--fork-turns", "3", "--json"
    )

    assert (code, err) == (0, "")
    printed = json.loads(out)
    assert set(printed) == {"fork_id", "status"}
    assert printed["status"] == "queued"
    assert printed["fork_id"].startswith("f-")


def test_launch_prints_just_the_fork_id_without_json(forkq: Run) -> None:
    fork_id = launch(forkq, "--fork-turns", "all")

    code, out, _ = forkq("status", fork_id)
    assert code == 0
    assert out.startswith(f"{fork_id} queued attempt=0")


def test_an_invalid_fork_turns_exits_2_with_the_validation_message_and_writes_nothing(
    forkq: Run, redis_client: redis.Redis, forkq_env: Settings
) -> None:
    code, out, err = forkq(
        "launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork", "--fork-turns", "0"
    )

    assert (code, out) == (2, "")
    assert err == f"forkq launch: {MSG_FORK_TURNS_VALUE}\n"
    assert redis_client.dbsize() == 0


def test_an_invalid_parent_file_exits_2_naming_the_field(forkq: Run, tmp_path: Path, redis_client: redis.Redis) -> None:
    bad = tmp_path / "parent.json"
    bad.write_text(json.dumps({"session_id": "s-1", "approval_mode": "sometimes"}))

    code, _, err = forkq("launch", "--parent", str(bad), "--prompt", PROMPT)

    assert code == 2
    assert "approval_mode" in err and str(bad) in err
    assert redis_client.dbsize() == 0


# ── following a fork ──────────────────────────────────────────────────────────────────────────


def test_status_json_shows_the_state(forkq: Run) -> None:
    fork_id = launch(forkq, "--fork-turns", "1")

    code, out, _ = forkq("status", fork_id, "--json")

    state = json.loads(out)
    assert code == 0
    assert (state["fork_id"], state["status"], state["attempt"], state["kind"]) == (fork_id, "queued", 0, "fork")


def test_result_wait_json_prints_fork_id_status_output_and_usage(forkq: Run, live_worker: WorkController) -> None:
    fork_id = launch(forkq, "--fork-turns", "3")

    code, out, err = forkq("result", fork_id, "--wait", "--timeout", "15", "--json")

    assert code == 0, err
    result = json.loads(out)
    assert {"fork_id", "status", "output", "usage"} <= set(result)
    assert (result["fork_id"], result["status"]) == (fork_id, "succeeded")
    assert "received" in result["output"]
    assert result["usage"]["model_calls"] == 1


def test_result_without_wait_says_there_is_no_result_yet(forkq: Run) -> None:
    fork_id = launch(forkq)

    code, _, err = forkq("result", fork_id)
    json_code, out, _ = forkq("result", fork_id, "--json")

    assert code == 1
    assert f"fork {fork_id} is queued: no result yet" in err
    assert json_code == 1
    assert json.loads(out) == {"fork_id": fork_id, "status": "queued", "output": None, "usage": None}


def test_result_wait_times_out_with_exit_1_when_no_worker_runs(forkq: Run) -> None:
    fork_id = launch(forkq)

    code, _, err = forkq("result", fork_id, "--wait", "--timeout", "0.2")

    assert code == 1
    assert "still queued" in err


def test_events_prints_the_lifecycle_in_order(forkq: Run, live_worker: WorkController) -> None:
    fork_id = launch(forkq, "--fork-turns", "1")
    forkq("result", fork_id, "--wait", "--timeout", "15")

    code, out, _ = forkq("events", fork_id)

    kinds = [line.split()[1] for line in out.splitlines()]
    assert code == 0
    assert [k for k in kinds if k in ("queued", "started", "step", "finished")] == [
        "queued",
        "started",
        "step",
        "finished",
    ]


def test_events_follow_prints_until_the_fork_ends(forkq: Run, live_worker: WorkController) -> None:
    fork_id = launch(forkq, "--fork-turns", "1")

    code, out, _ = forkq("events", fork_id, "--follow")

    assert code == 0
    assert out.splitlines()[-1].split()[1] == "finished"
    assert '"status": "succeeded"' in out.splitlines()[-1]


def test_inspect_json_prints_the_bootstrap_record_in_wire_form(forkq: Run) -> None:
    fork_id = launch(forkq, "--fork-turns", "3")

    code, out, _ = forkq("inspect", fork_id, "--json")

    record = json.loads(out)
    parent = load_parent_snapshot(Path(PARENT))
    seed = build_fork_seed(parent.history, fork_turns="3", directive=PROMPT)
    assert code == 0
    assert set(record) >= INSPECT_KEYS
    assert (record["fork_id"], record["kind"], record["fork_turns"], record["directive"]) == (
        fork_id,
        "fork",
        "3",
        PROMPT,
    )
    assert record["initial_messages"] == seed.to_wire()["initial_messages"]
    assert record["task_prompt"] == seed.task_prompt
    assert (record["depth"], record["model"], record["cwd"]) == (parent.depth + 1, parent.model, parent.cwd)
    assert len(record["digest"]) == 64


def test_cancel_prints_the_new_status(forkq: Run) -> None:
    fork_id = launch(forkq)

    code, out, _ = forkq("cancel", fork_id)

    assert (code, out) == (0, "cancelled\n")
    assert forkq("status", fork_id)[1].startswith(f"{fork_id} cancelled")


@pytest.mark.parametrize("command", ["status", "cancel", "inspect", "events", "result"])
def test_an_unknown_fork_exits_1_saying_it_was_not_found(forkq: Run, command: str) -> None:
    code, _, err = forkq(command, "f-missing")

    assert code == 1
    assert "f-missing" in err and "not found" in err


# ── check ─────────────────────────────────────────────────────────────────────────────────────


def test_check_exits_0_against_a_fit_redis(forkq: Run) -> None:
    code, out, _ = forkq("check")

    assert code == 0
    assert out.startswith("forkq check: ok")


def test_check_exits_1_with_a_message_for_an_unreachable_redis(
    forkq: Run, monkeypatch: pytest.MonkeyPatch, redis_server: Any
) -> None:
    monkeypatch.setenv("FORKQ_REDIS_URL", "redis://:hunter2@127.0.0.1:1/0")

    code, _, err = forkq("check")

    assert code == 1
    assert "not reachable" in err and "FORKQ_REDIS_URL" in err
    assert "hunter2" not in err


@pytest.mark.parametrize(
    ("name", "value", "named"),
    [
        ("FORKQ_REDIS_URL", "http://localhost:6379", "FORKQ_REDIS_URL"),
        ("FORKQ_QUEUE", "a:b", "FORKQ_QUEUE"),
        ("FORKQ_HEARTBEAT_S", "60", "FORKQ_HEARTBEAT_S"),
    ],
)
def test_an_invalid_setting_exits_2_with_a_message_starting_with_the_variable(
    forkq: Run, monkeypatch: pytest.MonkeyPatch, name: str, value: str, named: str
) -> None:
    monkeypatch.setenv(name, value)

    code, _, err = forkq("check")

    assert code == 2
    assert err.startswith(f"forkq check: {named}")


# ── the installed script, with a worker process ──────────────────────────────────────────────


def test_the_forkq_script_launches_a_fork_that_a_worker_process_runs(
    forkq_env: Settings, worker_process: Callable[..., Any]
) -> None:
    env = {
        **os.environ,
        "FORKQ_REDIS_URL": forkq_env.redis_url,
        "FORKQ_NAMESPACE": forkq_env.namespace,
        "FORKQ_QUEUE": forkq_env.queue,
    }

    def forkq_script(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([FORKQ, *argv], check=False, env=env, capture_output=True, text=True, timeout=60)

    launched = forkq_script(
        "launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork", "--fork-turns", "1", "--json"
    )
    assert launched.returncode == 0, launched.stderr
    fork_id = json.loads(launched.stdout)["fork_id"]

    worker = worker_process()
    done = forkq_script("result", fork_id, "--wait", "--timeout", "30", "--json")

    assert done.returncode == 0, f"{done.stderr}\n{worker.log()}"
    assert json.loads(done.stdout)["status"] == "succeeded"
    rejected = forkq_script("launch", "--parent", PARENT, "--prompt", PROMPT, "--fork-turns", "0")
    assert rejected.returncode == 2
    assert MSG_FORK_TURNS_VALUE in rejected.stderr


# ── bad input at launch: exit 2, one line naming the field, nothing written ───────────────────


def nested(levels: int, leaf: Any = "x") -> Any:
    """A value `levels` objects deep, built without recursion."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def parent_file(tmp_path: Path, name: str = "parent.json", **overrides: Any) -> str:
    """The example parent with `overrides`, written as a JSON file."""
    data = {**json.loads(Path(PARENT).read_text(encoding="utf-8")), **overrides}
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def deep_history_parent(tmp_path: Path) -> str:
    history = json.loads(Path(PARENT).read_text(encoding="utf-8"))["history"]
    deep_call = {"role": "model", "parts": [{"functionCall": {"name": "read_file", "args": nested(600)}}]}
    return parent_file(tmp_path, history=[*history[:-1], deep_call, history[-1]])


def written(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


FORK_ARGS = ["--prompt", PROMPT, "--subagent-type", "fork"]
DEEP_TOOL = {"name": "deep", "description": "d", "parameters": nested(300, {"type": "object"})}
LATIN1 = '{"session_id": "s-1", "cwd": "/tmp/caf\xe9"}'.encode("latin-1")
DEEP_JSON = ('{"session_id": "s-1", "tools": ' + "[" * 200_000 + "]" * 200_000 + "}").encode()

# each bad input of a launch: (launch arguments built in a temporary directory, what the message must name)
BAD_LAUNCHES: dict[str, Callable[[Path], tuple[list[str], str]]] = {
    "parent-not-utf8": lambda d: (["--parent", written(d / "latin1.json", LATIN1), *FORK_ARGS], "UTF-8"),
    "json-200000-deep": lambda d: (
        ["--parent", written(d / "deep.json", DEEP_JSON), *FORK_ARGS],
        "nested more than 100 levels",
    ),
    "history-600-deep": lambda d: (["--parent", deep_history_parent(d), *FORK_ARGS], "history[43]"),
    "fork-turns-5000-digits": lambda d: (["--parent", PARENT, *FORK_ARGS, "--fork-turns", "9" * 5000], "fork_turns"),
    "max-wall-s-nan": lambda d: (["--parent", PARENT, *FORK_ARGS, "--max-wall-s", "nan"], "max_wall_s"),
    "max-wall-s-inf": lambda d: (["--parent", PARENT, *FORK_ARGS, "--max-wall-s", "inf"], "max_wall_s"),
    "depth-string": lambda d: (["--parent", parent_file(d, depth="0"), *FORK_ARGS], "depth"),
    "number-5000-digits": lambda d: (
        ["--parent", written(d / "n.json", b'{"session_id": "s-1", "depth": ' + b"1" * 5000 + b"}"), *FORK_ARGS],
        "4,300 digits",
    ),
    "tool-schema-300-deep": lambda d: (["--parent", parent_file(d, tools=[DEEP_TOOL]), *FORK_ARGS], "tools[0]"),
    "output-schema-300-deep": lambda d: (
        ["--parent", PARENT, *FORK_ARGS, "--output-schema", written(d / "s.json", json.dumps(DEEP_TOOL).encode())],
        "output_schema",
    ),
    "fork-tools-200000-deep": lambda d: (
        ["--parent", PARENT, *FORK_ARGS, "--fork-tools", "[" * 200_000 + "]" * 200_000],
        "--fork-tools",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LAUNCHES))
def test_bad_launch_input_exits_2_with_one_line_naming_the_field_and_writes_nothing(
    forkq: Run, tmp_path: Path, redis_client: redis.Redis, case: str
) -> None:
    argv, named = BAD_LAUNCHES[case](tmp_path)

    code, out, err = forkq("launch", *argv)

    assert (code, out) == (2, ""), err
    assert err.startswith("forkq launch: ") and err.count("\n") == 1, err
    assert named in err
    assert redis_client.dbsize() == 0


def test_a_tool_schema_at_the_nesting_limit_is_accepted(forkq: Run, tmp_path: Path) -> None:
    # 99 levels under the declaration object: 100 in all, the documented bound
    tool = {"name": "deep", "description": "d", "parameters": nested(98, {"type": "object"})}

    code, out, err = forkq("launch", "--parent", parent_file(tmp_path, tools=[tool]), "--prompt", PROMPT)

    assert code == 0, err
    assert out.startswith("f-")


# ── live workers on a script: parked, paused, cancelled forks ─────────────────────────────────


def step(*parts: dict[str, Any] | str, delay_s: float = 0.0) -> dict[str, Any]:
    """One scripted model answer: texts and function calls."""
    wire = [{"text": p} if isinstance(p, str) else p for p in parts]
    return {"delay_s": delay_s, "content": {"role": "model", "parts": wire}}


def call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": name, "args": args}}


@pytest.fixture
def scripted_worker(
    make_settings: Callable[..., Settings], start_live_worker: Callable[..., WorkController], tmp_path: Path
) -> Callable[[list[dict[str, Any]]], WorkController]:
    """Start an in-process worker whose model answers with `steps` (on the CLI's Redis, namespace and queue)."""

    def start(steps: list[dict[str, Any]]) -> WorkController:
        script = tmp_path / "script.json"
        script.write_text(json.dumps({"steps": steps}), encoding="utf-8")
        from workers.app import make_app

        return start_live_worker(make_app(make_settings(script=script, provider="scripted")))

    return start


def events_of(forkq: Run, fork_id: str) -> list[dict[str, Any]]:
    code, out, err = forkq("events", fork_id, "--json")
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


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


class Died(BaseException):
    """Stands for a worker process dying in the middle of a model call."""


class DiesInTheModelCall:
    name = "dies"

    def generate(self, request: Any) -> Any:
        raise Died


def paused_fork(forkq: Run, settings: Settings) -> str:
    """A fork launched through the CLI whose first worker died, revived by a worker that lacks its tools."""
    from workers.runner import RunForkJob, WorkerRuntime, run_fork_job
    from workers.tools import ToolRegistry

    fork_id = launch(forkq, "--fork-turns", "1")
    _, out, _ = forkq("status", fork_id, "--json")
    job = RunForkJob(fork_id=fork_id, digest=json.loads(out)["digest"])
    first = WorkerRuntime(settings)
    first.provider = DiesInTheModelCall()  # cached properties: an instance attribute replaces them
    with pytest.raises(Died):  # the first run records its tool surface (the built-in tools) and dies
        run_fork_job(first, job)
    first.leases.client.delete(first.leases.keys.lease(fork_id))  # its lease runs out
    assert first.leases.revive(fork_id, max_attempts=3) == "revive"
    second = WorkerRuntime(settings)
    second.tools = ToolRegistry()  # a worker without the built-in tools the fork started with
    assert run_fork_job(second, job) == "paused"
    return fork_id


def test_resume_queues_a_paused_fork_and_a_worker_runs_it_to_success(
    forkq: Run, settings: Settings, scripted_worker: Callable[..., WorkController]
) -> None:
    # Given a fork paused because its reviving worker lacked tools it started with
    fork_id = paused_fork(forkq, settings)
    code, out, _ = forkq("result", fork_id, "--wait", "--timeout", "20", "--json")
    assert code == 3
    assert json.loads(out)["status"] == "paused" and "read_file" in json.loads(out)["error"]

    # When an operator resumes it and a worker with the tools consumes the queue
    code, out, err = forkq("resume", fork_id, "--json")
    assert code == 0, err
    assert json.loads(out) == {"fork_id": fork_id, "resumed": True, "status": "queued"}
    scripted_worker([step("resumed and done")])

    # Then it runs to success, and a second resume finds nothing to do
    code, out, err = forkq("result", fork_id, "--wait", "--timeout", "30", "--json")
    assert code == 0, err
    assert (json.loads(out)["status"], json.loads(out)["output"]) == ("succeeded", "resumed and done")
    again = forkq("resume", fork_id, "--json")
    assert again[0] == 1 and json.loads(again[1]) == {"fork_id": fork_id, "resumed": False, "status": "succeeded"}
    assert forkq("resume", fork_id)[:2] == (1, f"fork {fork_id} is succeeded, not paused: nothing to resume\n")


# ── --json everywhere, and --version ──────────────────────────────────────────────────────────


def test_events_json_prints_one_json_object_per_line(forkq: Run) -> None:
    fork_id = launch(forkq)
    forkq("cancel", fork_id)

    code, out, _ = forkq("events", fork_id, "--json")

    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [e["type"] for e in lines] == ["queued", "finished"]
    assert all(set(e) == {"id", "at_ms", "type", "data"} for e in lines)
    assert lines[1]["data"]["status"] == "cancelled" and lines[0]["at_ms"] <= lines[1]["at_ms"]


def test_cancel_json_prints_the_fork_id_and_its_status(forkq: Run) -> None:
    fork_id = launch(forkq)

    first, second = forkq("cancel", fork_id, "--json"), forkq("cancel", fork_id, "--json")

    assert first[0] == second[0] == 0
    assert json.loads(first[1]) == json.loads(second[1]) == {"fork_id": fork_id, "status": "cancelled"}


def test_check_json_reports_ok_or_the_problems(forkq: Run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    code, out, _ = forkq("check", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["ok"], report["problems"], report["queue"], report["worker_heartbeat"]) == (
        True,
        [],
        "forks-test",
        None,
    )

    monkeypatch.setenv("FORKQ_HEARTBEAT_FILE", str(tmp_path / "no-worker.heartbeat"))
    code, out, err = forkq("check", "--worker", "--json")
    report = json.loads(out)
    assert (code, err, report["ok"]) == (1, "", False)
    assert report["worker_heartbeat"] == str(tmp_path / "no-worker.heartbeat")
    assert len(report["problems"]) == 1 and "no-worker.heartbeat" in report["problems"][0]


def test_sweep_once_json_prints_the_outcomes_of_the_pass(forkq: Run) -> None:
    code, out, _ = forkq("sweep", "--once", "--json")

    assert code == 0
    assert json.loads(out) == {"outcomes": {}}


def test_version_prints_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])

    assert exited.value.code == 0
    assert capsys.readouterr().out == f"forkq {version('forkq')}\n"


def test_inspect_shows_the_launch_options_in_text_and_json(forkq: Run, tmp_path: Path) -> None:
    schema = {"type": "object", "required": ["verdict"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    options = ["--approval-policy", "park", "--output-schema", str(tmp_path / "schema.json")]
    fork_id = launch(forkq, *options, "--max-wall-s", "30", "--max-turns", "5", "--fork-tools", "read_file,glob")
    code, out, _ = forkq(
        "launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "reviewer", "--name", "rev"
    )
    assert code == 0
    teammate = out.strip()

    record = json.loads(forkq("inspect", fork_id, "--json")[1])
    text = forkq("inspect", fork_id)[1]
    plain = json.loads(forkq("inspect", teammate, "--json")[1])

    assert (record["approval_policy"], record["output_schema"], record["max_wall_s"], record["max_turns"]) == (
        "park",
        schema,
        30.0,
        5,
    )
    assert (record["subagent_type"], record["name"], record["fork_tools"]) == ("fork", None, ["read_file", "glob"])
    assert "approval_policy=park max_wall_s=30.0 max_turns=5" in text
    assert f"output_schema: {json.dumps(schema, sort_keys=True)}" in text and "subagent_type='fork'" in text
    assert (plain["subagent_type"], plain["name"], plain["approval_policy"], plain["output_schema"]) == (
        "reviewer",
        "rev",
        "deny",
        None,
    )
    assert (plain["max_wall_s"], plain["max_turns"], plain["fork_tools"]) == (None, None, None)


# ── the worker's exit code ────────────────────────────────────────────────────────────────────


@pytest.mark.slow
def test_the_worker_exits_1_when_start_up_fails_and_0_after_a_warm_shutdown(
    worker_process: Callable[..., Any], tmp_path: Path
) -> None:
    # Given a port something else listens on
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]

        # When a worker is started with its metrics on that port
        failed = worker_process(
            FORKQ_METRICS_PORT=str(port), FORKQ_HEARTBEAT_FILE=str(tmp_path / "failed.hb"), FORKQ_PROVIDER="scripted"
        )
        code = failed.process.wait(timeout=60)

    # Then it exits 1 (not 0), naming the variable, so a supervisor restarts it
    assert code == 1, failed.log()
    assert f"FORKQ_METRICS_PORT={port}" in failed.log()
    # and a worker that started exits 0 after a warm shutdown (SIGTERM)
    heartbeat = tmp_path / "ok.hb"
    healthy = worker_process(FORKQ_HEARTBEAT_FILE=str(heartbeat), FORKQ_PROVIDER="scripted")
    wait_for(heartbeat.exists, "the worker to beat", timeout=60)
    assert healthy.stop(timeout=30) == 0, healthy.log()

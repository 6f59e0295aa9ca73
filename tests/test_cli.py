"""The `forkq` command, in-process through `main` and once as the installed script with a worker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.worker import WorkController

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

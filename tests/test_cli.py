"""The `forkq` command, in-process through `main` and once as the installed script with a worker process.

Launch and its bad input: test_cli_launch.py; forks parked, paused and cancelled on live workers:
test_cli_parked.py; the argument types: test_cli_args.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.worker import WorkController

from broker_config.settings import Settings
from tests.cli_support import FORKQ, PARENT, PROMPT, Run, launch, wait_for
from workers.base.keys import Keys
from workers.cli import main
from workers.history.params import MSG_FORK_TURNS_VALUE
from workers.history.selection import build_fork_seed
from workers.history.snapshot import load_parent_snapshot
from workers.records.parked import AdmissionLimit, ModelWait
from workers.store.admission import AdmissionStore, wait_shown
from workers.store.lease import Claim, Leases

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


# ── following a fork ──────────────────────────────────────────────────────────────────────────


def test_status_json_shows_the_state(forkq: Run) -> None:
    fork_id = launch(forkq, "--fork-turns", "1")

    code, out, _ = forkq("status", fork_id, "--json")

    state = json.loads(out)
    assert code == 0
    assert (state["fork_id"], state["status"], state["attempt"], state["kind"]) == (fork_id, "queued", 0, "fork")


def test_status_shows_a_running_forks_wait_for_its_model(forkq: Run, settings: Settings) -> None:
    fork_id = launch(forkq, "--fork-turns", "1")
    client = redis.Redis.from_url(settings.redis_url)
    keys = Keys(settings.namespace)
    claim = Leases(client, keys, ttl_ms=10_000, retention_s=3600).claim(fork_id, "worker-a")
    assert isinstance(claim, Claim)
    wait = ModelWait(model="gpt-4.1", limit=AdmissionLimit.TPM, since_ms=1764900000000)
    store = AdmissionStore(client, keys, token="host:1:ab", hold_ttl_ms=10_000, alive_ttl_ms=10_000)
    store.write_waits([wait_shown(fork_id, claim.epoch, claim.owner, wait, 1)])

    _, text, _ = forkq("status", fork_id)
    code, out, _ = forkq("status", fork_id, "--json")

    assert code == 0
    assert "waiting for model gpt-4.1: its tpm limit (FORKQ_MODEL_LIMITS)" in text
    assert json.loads(out)["waiting_for"] == {
        "kind": "model",
        "model": "gpt-4.1",
        "limit": "tpm",
        "since_ms": 1764900000000,
    }


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
    assert json.loads(out) == {"fork_id": fork_id, "status": "queued", "output": None, "usage": None, "error": None}


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


@pytest.mark.parametrize("command", ["check", "demo"])
def test_check_and_demo_refuse_an_invalid_setting_with_the_same_message(
    forkq: Run, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.setenv("FORKQ_MAX_ATTEMPTS", "0")

    code, _, err = forkq(command)

    assert code == 2
    assert err == (
        f"forkq {command}: FORKQ_MAX_ATTEMPTS: Input should be greater than or equal to 1; set it to a valid value "
        "(Runs a fork gets before a lost worker fails it (worker_lost)), or unset it for its default\n"
    )


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
    # a prompt holding the byte 0xff, which is not UTF-8, as a shell passes it: exit 2 and one line, no traceback
    not_utf8 = forkq_script("launch", "--parent", PARENT, "--prompt", os.fsdecode(b"bad \xff byte"))
    assert (not_utf8.returncode, not_utf8.stderr.count("\n")) == (2, 1), not_utf8.stderr
    assert 'Parameter "prompt" is not valid Unicode text' in not_utf8.stderr


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
    assert report["sandbox"].startswith("landlock ")  # what this host can do to sandbox commands


def test_result_notification_json_prints_the_notification_with_the_fork_id_and_status(forkq: Run) -> None:
    fork_id = launch(forkq)
    forkq("cancel", fork_id)

    code, out, err = forkq("result", fork_id, "--notification", "--json")
    _, text, _ = forkq("result", fork_id, "--notification")

    printed = json.loads(out)
    assert (code, err) == (1, "")  # cancelled: not succeeded
    assert printed == {"fork_id": fork_id, "status": "cancelled", "notification": text.rstrip("\n")}
    assert "<status>cancelled</status>" in printed["notification"]


@pytest.mark.slow
def test_sweep_json_prints_json_lines_while_it_runs_and_stops_with_0_on_sigterm(
    forkq: Run, forkq_env: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    # Given a fork whose worker claimed it and went silent past its lease
    fork_id = launch(forkq)
    leases = Leases(redis_client, Keys(forkq_env.namespace), ttl_ms=200, retention_s=60)
    assert isinstance(leases.claim(fork_id, "gone-worker"), Claim)

    # When `forkq sweep --json` runs (a pass every 0.2 s)
    out = tmp_path / "sweep.out"
    env = {**os.environ, "FORKQ_REDIS_URL": forkq_env.redis_url, "FORKQ_NAMESPACE": forkq_env.namespace}
    with out.open("wb") as stdout:
        sweep = subprocess.Popen(
            [FORKQ, "sweep", "--json"],
            env={**env, "FORKQ_QUEUE": forkq_env.queue, "FORKQ_SWEEP_S": "0.2"},
            stdout=stdout,
        )
    try:
        wait_for(lambda: out.read_text().count("\n") >= 2, "the start line and a pass that revived the fork")
    finally:
        sweep.send_signal(signal.SIGTERM)
        code = sweep.wait(timeout=30)

    # Then every line it printed is a JSON object: the start, then the pass that revived the fork
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0
    assert lines[0] == {
        "event": "started",
        "every_s": 0.2,
        "connections_every_s": forkq_env.presence_check_s,
        "redis": forkq_env.redis_url,
        "queue": forkq_env.queue,
    }
    assert lines[1:] == [{"event": "pass", "outcomes": {"revive": 1}}]


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
        "launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "Explore", "--name", "rev"
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
        "Explore",
        "rev",
        "deny",
        None,
    )
    assert (plain["max_wall_s"], plain["max_turns"], plain["fork_tools"]) == (None, None, None)
    assert (plain["agent"], plain["agent_source"], plain["seed_mode"]) == ("Explore", "built-in", "fork_turns")
    assert "agent=Explore (built-in)" in forkq("inspect", teammate)[1]


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


def test_the_worker_exits_1_when_redis_is_unreachable_and_2_when_settings_or_redis_are_unfit(
    forkq: Run, forkq_env: Settings, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
) -> None:
    # Redis down is an outage a supervisor waits out by restarting the worker: exit 1, as documented
    monkeypatch.setenv("FORKQ_PROVIDER", "scripted")
    monkeypatch.setenv("FORKQ_REDIS_URL", "redis://127.0.0.1:1/0")
    down = forkq("worker")
    # a Redis that may evict records, or no provider, are settings to fix: exit 2
    monkeypatch.setenv("FORKQ_REDIS_URL", forkq_env.redis_url)
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        evicting = forkq("worker")
    finally:
        redis_client.config_set("maxmemory-policy", "noeviction")
    monkeypatch.delenv("FORKQ_PROVIDER")
    no_provider = forkq("worker")

    assert down[0] == 1 and down[2].startswith("forkq worker: cannot start: Redis at redis://127.0.0.1:1/0 is not")
    assert evicting[0] == 2 and "maxmemory-policy 'allkeys-lru'" in evicting[2]
    assert no_provider[0] == 2 and "FORKQ_PROVIDER" in no_provider[2]

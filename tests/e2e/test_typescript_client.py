"""The TypeScript client (clients/typescript): built with tsc, then node's test runner on its compiled JS.

The SSE parser's tests run alone; the live ones against `forkq serve` (uvicorn in a thread, the `serve_api`
fixture) and an in-process worker whose scripted model answers every fork alike, since a script's k-th step
answers each fork's k-th model call: a write_file call (parked under the `park` policy, denied under the
default one, the parent's approval mode being `default`), then the final text. A missing node or npm skips
these tests, or fails them when the CI variable is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery.worker import WorkController

from tests.api_support import TOKEN, Api
from tests.cli_support import call, step
from tests.conftest import missing_tool

CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "typescript"
SCRIPT = [step(call("w1", "write_file", path="a.txt", content="written"), delay_s=0.3), step("all done")]
NODE_TIMEOUT_S = 150.0


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing_tool(name, f"the TypeScript client's tests need {name} (Node.js 18.20 or later) on PATH")
    return path


@pytest.fixture(scope="module")
def built_client() -> str:
    """Install the client's one devDependency (typescript, from its lockfile) if missing, compile it; node's path."""
    node, npm = _tool("node"), _tool("npm")
    if not (CLIENT_DIR / "node_modules" / ".bin" / "tsc").exists():
        _run([npm, "ci", "--no-audit", "--no-fund"], "npm ci")
    _run([node, str(CLIENT_DIR / "node_modules" / "typescript" / "bin" / "tsc"), "-p", str(CLIENT_DIR)], "tsc")
    return node


def _run(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        argv, cwd=CLIENT_DIR, env=env, capture_output=True, text=True, timeout=NODE_TIMEOUT_S, check=False
    )
    output = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{output}"
    return output


def node_test(node: str, test_file: str, **env: str) -> str:
    """Run one of the client's node test files; its report (a non-zero exit fails the test, showing the report)."""
    argv = [node, "--test", "--test-reporter=spec", f"test/{test_file}"]
    report = _run(argv, f"node --test test/{test_file}", env={**os.environ, "NO_COLOR": "1", **env})
    return report


def test_the_sse_parser_gives_each_message_once_however_the_stream_is_cut(built_client: str) -> None:
    report = node_test(built_client, "sse.test.mjs")

    assert "pass 5" in report and "fail 0" in report, report


@pytest.fixture
def live_server(
    api: Api, scripted_worker: Callable[..., WorkController], parent: dict[str, Any], work: Path, tmp_path: Path
) -> dict[str, str]:
    """The API and a worker whose model first calls write_file, then answers; the variables that tell node of them."""
    scripted_worker(SCRIPT)
    parent_path = tmp_path / "parent.json"
    parent_path.write_text(json.dumps(parent), encoding="utf-8")
    return {
        "FORKQ_TEST_API_URL": api.url,
        "FORKQ_TEST_API_TOKEN": TOKEN,
        "FORKQ_TEST_PARENT": str(parent_path),
        "FORKQ_TEST_CWD": str(work),
    }


@pytest.mark.parametrize(
    ("test_file", "count"), [("forks.test.mjs", 8), ("stream.test.mjs", 3), ("workspace.test.mjs", 4)]
)
def test_the_client_launches_follows_and_acts_on_the_forks_of_a_live_server(
    built_client: str, live_server: dict[str, str], test_file: str, count: int
) -> None:
    report = node_test(built_client, test_file, **live_server)

    assert f"pass {count}" in report and "fail 0" in report, report

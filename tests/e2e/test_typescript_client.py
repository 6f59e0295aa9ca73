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
    ("test_file", "count"),
    [("forks.test.mjs", 9), ("stream.test.mjs", 3), ("workspace.test.mjs", 4), ("sessions.test.mjs", 2)],
)
def test_the_client_launches_follows_and_acts_on_the_forks_of_a_live_server(
    built_client: str, live_server: dict[str, str], test_file: str, count: int
) -> None:
    report = node_test(built_client, test_file, **live_server)

    assert f"pass {count}" in report and "fail 0" in report, report


UPLOAD_AND_LAUNCH = """
import { readFileSync, rmSync } from "node:fs";
import { ForkqClient } from "./dist/index.js";
const [url, token, parentPath, dir] = process.argv.slice(1);
const api = new ForkqClient({ baseUrl: url, token });
const first = await api.uploadWorkspace(dir);
const second = await api.uploadWorkspace(dir);
rmSync(dir, { recursive: true });  // from now on the tree exists only as the upload
const parent = { ...JSON.parse(readFileSync(parentPath, "utf-8")), cwd: dir, approval_mode: "yolo" };
const agent = { description: "read", prompt: "Read the notes.", subagent_type: "general-purpose" };
const launched = await api.launch({ parent, agent, options: { workspace_manifest: first.manifest } });
const outcome = await api.result(launched.fork_id, { wait: 30 });
console.log(JSON.stringify({ first, second, fork_id: launched.fork_id, outcome }));
"""


def test_a_fork_launched_with_a_tree_the_typescript_client_uploaded_runs_on_it_after_the_folder_is_gone(
    built_client: str,
    api: Api,
    scripted_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given a parent's folder, and a worker whose model reads a file of it by the parent's absolute path, then edits it
    folder = tmp_path / "laptop" / "proj"
    folder.mkdir(parents=True)
    (folder / "notes.md").write_text("uploaded notes\n", encoding="utf-8")
    scripted_worker(
        [
            step(call("r1", "run_shell_command", command=f"cat {folder}/notes.md && echo more >> notes.md")),
            step("all done"),
        ]
    )
    parent_path = tmp_path / "parent.json"
    parent_path.write_text(json.dumps(parent), encoding="utf-8")

    # When the TypeScript client uploads it twice, the folder is removed, and a fork is launched naming the upload
    script = [built_client, "--input-type=module", "-e", UPLOAD_AND_LAUNCH, api.url, TOKEN, str(parent_path)]
    report = json.loads(_run([*script, str(folder)], "the upload script").strip().splitlines()[-1])

    # Then the second upload sent nothing, and the fork read the uploaded file and changed it in its own copy
    assert report["first"]["uploaded"] == 1
    assert report["second"] == {"manifest": report["first"]["manifest"], "uploaded": 0}
    assert report["outcome"]["ended"] and report["outcome"]["result"]["status"] == "succeeded", report
    with api.client() as http:
        transcript = http.get(f"/v1/forks/{report['fork_id']}/transcript").json()
        patch = http.get(f"/v1/forks/{report['fork_id']}/changes").text
    [result] = [s for s in transcript["steps"] if s["kind"] == "tool_result"]
    assert result["output"].startswith("uploaded notes") and result["changed"] == ["notes.md"]
    assert "+more" in patch and not folder.exists()

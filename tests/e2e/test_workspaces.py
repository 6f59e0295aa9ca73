"""Snapshot workspaces across machines: two workers, each in its own mount namespace, never see the parent's folder.

Each worker runs under `unshare --mount` with an empty tmpfs over the folder that holds the parent's tree, so
the only way a fork reaches the parent's files is its snapshot in Redis; each keeps its workspaces in a folder
of its own. The script writes with the file tool and with the shell, the worker is SIGKILLed, and the fork is
revived on the other "machine" with both writes in place; then `forkq apply` gives the parent the fork's tree.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, missing_tool
from tests.e2e.test_revival import (  # noqa: F401  (fixtures: the cluster of real worker and sweeper processes)
    REVIVAL_S,
    Cluster,
    Proc,
    step,
    testtools_dir,
    text,
)
from workers.records.journal import EntryKind

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

APP = "def main():\n    return 42\n"


def tool(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": name, "args": args}}


def git(folder: Path, *argv: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *argv],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def parent_tree(root: Path) -> Path:
    """A parent's project in git: a README, a module, a binary file and an ignored build folder."""
    project = root / "proj"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("# proj\n", encoding="utf-8")
    (project / "src" / "app.py").write_text(APP, encoding="utf-8")
    (project / "logo.bin").write_bytes(bytes(range(256)) * 4)
    (project / ".gitignore").write_text("build/\n", encoding="utf-8")
    (project / "build").mkdir()
    (project / "build" / "out.o").write_bytes(b"\0" * 1000)
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "base")
    return project


class Machines(Cluster):
    """A cluster whose workers each run in a mount namespace where `hidden` (the parent's machine) is an empty tmpfs."""

    @property
    def hidden(self) -> Path:
        return Path(self.env_overrides["FORKQ_TEST_HIDDEN"])

    def spawn(self, name: str, argv: list[str], ready_marker: str, env: dict[str, str] | None = None) -> Proc:
        if argv[0] != "worker":
            return super().spawn(name, argv, ready_marker, env)
        own = self.directory / f"{name}-workspaces"
        own.mkdir()
        log_path = self.directory / f"{name}.log"
        # the tmpfs hides the parent's folder; `exec` keeps the worker's pid the one the test kills
        shell = 'mount -t tmpfs -o mode=0755 forkq-test "$0" && exec "$@"'
        command = [sys.executable, "-m", "workers.cli", *argv]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, str(self.hidden), *command],
                cwd=REPO_ROOT,
                env={**self.env, **(env or {}), "FORKQ_WORKSPACE_DIR": str(own)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(name, process, log_path, ready_marker)
        self.procs.append(proc)
        return proc


@pytest.fixture
def machines(redis_url: str, tmp_path: Path, testtools_dir: Path) -> Iterator[tuple[Machines, Path]]:  # noqa: F811
    """A cluster on the session's Redis whose workers stand for other machines; the parent's tree, hidden from them."""
    if shutil.which("unshare") is None:
        missing_tool("unshare", "util-linux's unshare makes each worker's mount namespace")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        missing_tool("a mount namespace", probe.stderr.decode(errors="replace"))
    hidden = tmp_path / "parent-machine"
    project = parent_tree(hidden)
    directory = tmp_path / "cluster"
    directory.mkdir()
    cluster = Machines(redis_url, directory, testtools_dir, {"FORKQ_TEST_HIDDEN": str(hidden)})
    cluster.parent = {**cluster.parent, "cwd": str(project)}
    try:
        yield cluster, project
    finally:
        cluster.close()


def results_of(cluster: Cluster, fid: str) -> dict[str, dict[str, Any]]:
    """The tool results of the fork's journal, by call id."""
    return {e.call_id or "": e.response or {} for e in cluster.leases.journal(fid) if e.kind is EntryKind.TOOL_RESULT}


def test_a_snapshot_fork_is_revived_on_another_machine_with_its_file_tool_and_shell_writes(
    machines: tuple[Machines, Path],
) -> None:
    cluster, project = machines
    # Given a fork that reads the parent's file, writes one with the file tool and edits one with the shell, then
    # makes a slow model call; and two workers that cannot see the parent's folder
    cluster.script(
        step(0.1, tool("w", "write_file", path=str(project / "new.txt"), content="hello\n")),
        step(0.1, tool("s", "run_shell_command", command=f"echo edited >> {project}/README.md && cat src/app.py")),
        step(2.5, tool("c", "run_shell_command", command=f"cat {project}/new.txt {project}/README.md; git status -s")),
        step(0.1, text("done")),
    )
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch(workspace="snapshot")

    # When the worker running it is SIGKILLed during the slow model call, after both writes were journaled
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=3), 20, "the third model call", fid)
    victim = cluster.proc_of(cluster.owner_pid(fid, attempt=1))
    victim.send(signal.SIGKILL)

    # Then it finishes on the other machine, where both writes are in place, and git shows exactly them
    cluster.result(fid, timeout=REVIVAL_S + 15)
    cluster.assert_ended_once(fid)
    assert cluster.owner_pid(fid, attempt=2) != victim.pid
    results = results_of(cluster, fid)
    assert APP.strip() in results["s"]["output"], results
    output = results["c"]["output"]
    assert "hello" in output and "# proj\nedited" in output, results
    assert " M README.md" in output and "?? new.txt" in output, results
    # the parent's tree was never written by the fork
    assert not (project / "new.txt").exists() and (project / "README.md").read_text() == "# proj\n"

    # When the parent applies the fork's changes
    forkq = [sys.executable, "-m", "workers.cli"]
    env = {**cluster.env}
    patch = subprocess.run([*forkq, "changes", fid], env=env, capture_output=True, check=True, cwd=REPO_ROOT).stdout
    assert b"+edited" in patch and b"new.txt" in patch
    applied = subprocess.run(
        [*forkq, "apply", fid], env=env, capture_output=True, text=True, cwd=REPO_ROOT, check=False
    )
    assert applied.returncode == 0, applied.stderr

    # Then the parent's tree is the fork's
    assert (project / "new.txt").read_text() == "hello\n"
    assert (project / "README.md").read_text() == "# proj\nedited\n"
    assert git(project, "status", "--porcelain", "--untracked-files=all").split("\n") == [
        " M README.md",
        "?? new.txt",
        "",
    ]
    notification = cluster.client.notification(fid)
    assert '<changed-files count="2"' in notification and "new.txt" in notification


def test_a_conflicting_apply_exits_2_naming_the_file_and_writes_nothing(machines: tuple[Machines, Path]) -> None:
    cluster, project = machines
    # Given a fork that edited the README and added a file
    cluster.script(
        step(0.1, tool("s", "run_shell_command", command="echo fork >> README.md && echo x > added.txt")),
        step(0.1, text("done")),
    )
    cluster.start("w1")
    fid = cluster.launch(workspace="snapshot")
    assert cluster.result(fid, timeout=30).status.value == "succeeded", cluster.diagnostics(fid)

    # When the parent changed the README meanwhile, and applies
    (project / "README.md").write_text("# proj, edited by the parent\n", encoding="utf-8")
    forkq = [sys.executable, "-m", "workers.cli"]
    applied = subprocess.run(
        [*forkq, "apply", fid], env=cluster.env, capture_output=True, text=True, cwd=REPO_ROOT, check=False
    )

    # Then it exits 2 naming the README, and writes nothing (not even the file that would apply)
    assert applied.returncode == 2, (applied.stdout, applied.stderr)
    assert "README.md" in applied.stderr
    assert not (project / "added.txt").exists()
    assert (project / "README.md").read_text() == "# proj, edited by the parent\n"


def test_sibling_snapshot_forks_do_not_see_each_others_writes(machines: tuple[Machines, Path]) -> None:
    cluster, project = machines
    # Given two sibling forks on two workers: each writes its own file, then (later) lists the tree
    cluster.script(
        step(0.1, tool("w", "run_shell_command", command="echo $RANDOM > mine-$(date +%s%N).txt")),
        step(1.5, tool("l", "run_shell_command", command=f"ls {project}")),
        step(0.1, text("done")),
    )
    cluster.start("w1", "w2", concurrency=1)
    first = cluster.launch(workspace="snapshot")
    second = cluster.launch(workspace="snapshot")

    # Then each sees its own file only, and the parent's tree is untouched
    for fid in (first, second):
        assert cluster.result(fid, timeout=40).status.value == "succeeded", cluster.diagnostics(fid)
    listings = [results_of(cluster, fid)["l"]["output"] for fid in (first, second)]
    assert [sum(line.startswith("mine-") for line in listing.split()) for listing in listings] == [1, 1], listings
    assert sorted(os.listdir(project)) == sorted([".git", ".gitignore", "README.md", "build", "logo.bin", "src"])
    changes = [cluster.client.changes(fid).paths for fid in (first, second)]
    assert all(len(paths) == 1 and paths[0].startswith("mine-") for paths in changes) and changes[0] != changes[1]


def test_the_snapshot_leaves_out_ignored_files_and_a_second_launch_stores_nothing_new(
    machines: tuple[Machines, Path],
) -> None:
    cluster, project = machines
    # Given a fork launched once (its snapshot stored)
    cluster.script(step(0.1, tool("l", "run_shell_command", command="ls -a; ls build || true")), step(0.1, text("ok")))
    cluster.start("w1")
    fid = cluster.launch(workspace="snapshot")
    assert cluster.result(fid, timeout=30).status.value == "succeeded", cluster.diagnostics(fid)
    blob_keys = set(cluster.redis.scan_iter(match=f"{cluster.keys.namespace}:{{ws:*}}:blob:*"))

    # When a sibling is launched from the unchanged tree, and then one after editing one file
    cluster.launch(workspace="snapshot")
    assert set(cluster.redis.scan_iter(match=f"{cluster.keys.namespace}:{{ws:*}}:blob:*")) == blob_keys
    (project / "src" / "app.py").write_text(APP + "# one line more\n", encoding="utf-8")
    cluster.launch(workspace="snapshot")

    # Then the ignored build folder never reached the fork, and only the edited file was stored again
    listing = results_of(cluster, fid)["l"]["output"]
    assert "README.md" in listing and "out.o" not in listing
    assert len(set(cluster.redis.scan_iter(match=f"{cluster.keys.namespace}:{{ws:*}}:blob:*")) - blob_keys) == 1
    record = json.loads(
        subprocess.run(
            [sys.executable, "-m", "workers.cli", "inspect", fid, "--json"],
            env=cluster.env,
            capture_output=True,
            check=True,
            cwd=REPO_ROOT,
        ).stdout
    )
    assert record["workspace"]["mode"] == "snapshot" and record["workspace"]["git"] is True

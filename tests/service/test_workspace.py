"""A snapshot fork's run on a worker: its folder, its journaled changes, its nested subagents, its cleanup."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker_config.settings import Settings
from tests.live import wait_until
from tests.loop_support import REGULAR, call, parent_for, step, tool_results, workdir
from workers.app import runtime_of
from workers.client import ForkClient
from workers.records.conversation import fold
from workers.records.fork import Status
from workers.service.runner import WorkerRuntime
from workers.service.workspace import RUNS, sweep_stale_runs, workspaces_dir
from workers.workspace.manifest import decode_changes


def journal(client: ForkClient, fork_id: str) -> list[Any]:
    return WorkerRuntime(client.settings).leases.journal(fork_id)


def test_a_snapshot_forks_tools_act_on_its_copy_and_each_calls_changes_are_journaled(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a fork that edits a file with the file tool, then removes one with the shell
    work = workdir(tmp_path)
    (work / "old.txt").write_text("old\n", encoding="utf-8")
    steps = [
        step(call("e1", "edit", path=str(work / "notes.txt"), old_string="INCR", new_string="SET")),
        step(call("s1", "run_shell_command", command="rm old.txt && pwd && echo $HOME")),
        step("done"),
    ]
    client = live(steps, workspace_dir=tmp_path / "ws")
    handle = client.launch(parent_for(parent, work), {**REGULAR}, workspace="snapshot")

    # When it runs
    assert handle.wait(timeout=30).status is Status.SUCCEEDED

    # Then the parent's tree is untouched, each call's journal entry holds the files it changed
    assert (work / "notes.txt").read_text() == "the limiter uses INCR then EXPIRE\n" and (work / "old.txt").exists()
    entries = journal(client, handle.fork_id)
    changed = {e.call_id: decode_changes(e.changes) for e in entries if e.changes is not None}
    assert list(changed["e1"]) == ["notes.txt"] and changed["s1"] == {"old.txt": None}
    output = tool_results(entries)["s1"]["output"]
    assert str(work) in output  # the shell starts at the parent's path (the workspace mounted there)
    assert str(tmp_path / "ws") in output  # and HOME is the run's private folder, never the worker's
    # and the run's folder is gone once the run ended
    assert os.listdir(tmp_path / "ws" / RUNS) == []
    assert client.changes(handle.fork_id).paths == ["notes.txt", "old.txt"]


def test_a_nested_subagent_works_in_its_callers_workspace_and_its_changes_come_back_with_the_call(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given one script for caller and subagent: an Agent call (the subagent, at the depth limit, is refused its
    # own), then a command that writes a file unless it is there already
    nested = {"description": "write", "prompt": "Write the file.", "subagent_type": "general-purpose"}
    command = "cat from-child.txt 2>/dev/null && echo SEEN || (echo child > from-child.txt && echo WROTE)"
    steps = [step(call("a1", "Agent", **nested)), step(call("s1", "run_shell_command", command=command)), step("ok")]
    client = live(steps, max_subagent_depth=2, workspace_dir=tmp_path / "ws")
    work = workdir(tmp_path)

    # When a snapshot subagent runs it
    handle = client.launch(parent_for(parent, work), REGULAR, workspace="snapshot")
    assert handle.wait(timeout=40).status is Status.SUCCEEDED

    # Then the nested subagent wrote the file in its own run, and the caller found it after its Agent call
    child_id = f"{handle.fork_id}.0.0"
    assert tool_results(journal(client, child_id))["s1"]["output"].splitlines()[0] == "WROTE"
    caller = journal(client, handle.fork_id)
    assert tool_results(caller)["s1"]["output"].splitlines()[:2] == ["child", "SEEN"]
    agent_result = next(e for e in caller if e.call_id == "a1" and e.changes is not None)
    assert list(decode_changes(agent_result.changes)) == ["from-child.txt"]
    assert list(fold(caller).changes) == ["from-child.txt"]
    assert not (work / "from-child.txt").exists()


def test_a_worker_start_removes_the_run_folders_of_dead_worker_processes_only(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = make_settings(workspace_dir=tmp_path / "ws")
    runs = workspaces_dir(settings) / RUNS
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead = runs / f"{gone.stdout.decode().strip()}.f-dead.1" / "tree"
    alive = runs / f"{os.getpid()}.f-mine.1" / "tree"
    for folder in (dead, alive):
        folder.mkdir(parents=True)
        (folder / "file").write_text("x")
    dead.chmod(0o500)  # a command made it read-only: it still goes

    assert sweep_stale_runs(settings) == 1
    assert sorted(os.listdir(runs)) == [f"{os.getpid()}.f-mine.1"]


def test_a_call_that_grows_the_workspace_past_its_bound_is_answered_with_an_error_and_not_journaled(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a fork bounded to 2,000 bytes that writes a 5,000-byte file, then removes it and writes a small one
    steps = [
        step(call("big", "run_shell_command", command="head -c 5000 /dev/zero > big.bin")),
        step(call("fix", "run_shell_command", command="rm big.bin && echo small > small.txt")),
        step("done"),
    ]
    client = live(steps, workspace_dir=tmp_path / "ws", workspace_max_bytes=2000)
    handle = client.launch(parent_for(parent, workdir(tmp_path)), REGULAR, workspace="snapshot")
    assert handle.wait(timeout=30).status is Status.SUCCEEDED

    # Then the model read why, nothing of the oversize call was journaled, and the next call's changes were
    entries = journal(client, handle.fork_id)
    results = tool_results(entries)
    assert "FORKQ_WORKSPACE_MAX_BYTES" in results["big"]["error"], results
    changed = {e.call_id: decode_changes(e.changes) for e in entries if e.changes is not None}
    assert list(changed) == ["fix"] and list(changed["fix"]) == ["small.txt"]


def test_a_continuation_keeps_the_workspace_its_first_exchange_left(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a fork that wrote a file and answered, and a script whose continuation reads the file back
    steps = [
        step(call("w", "run_shell_command", command="echo kept > kept.txt")),
        step("first answer"),
        step(call("r", "run_shell_command", command="cat kept.txt")),
        step("second answer"),
    ]
    client = live(steps, workspace_dir=tmp_path / "ws")
    handle = client.launch(parent_for(parent, workdir(tmp_path)), REGULAR, workspace="snapshot")
    assert handle.wait(timeout=30).output == "first answer"

    # When the parent sends it a message (a new run, in a new folder built from the journal)
    assert client.send(handle.fork_id, "And read it back.").outcome == "continued"

    # Then the continuation finds the file
    def second_answered() -> bool:
        result = client.result(handle.fork_id)
        return result is not None and result.output == "second answer"

    wait_until(second_answered, 30, "the continuation's answer")
    assert tool_results(journal(client, handle.fork_id))["r"]["output"].startswith("kept")


def test_the_worker_metrics_report_the_workspace_cache_and_its_bound(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    client = live([step("done")], workspace_dir=tmp_path / "ws", workspace_cache_mb=7)
    handle = client.launch(parent_for(parent, workdir(tmp_path)), REGULAR, workspace="snapshot")
    assert handle.wait(timeout=30).status is Status.SUCCEEDED
    metrics = runtime_of(client.app).metrics.registry
    assert metrics.get_sample_value("forkq_workspace_cache_limit_bytes") == 7 * 1024 * 1024
    assert (metrics.get_sample_value("forkq_workspace_cache_bytes") or 0) >= len("the limiter uses INCR then EXPIRE\n")
    assert metrics.get_sample_value("forkq_workspace_runs") == 0  # its folder went with its run


def test_workers_starting_together_sweep_the_same_gone_folders_without_an_error_and_remove_each_once(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    # Given 40 run folders of a gone worker, each with a few files, and a folder a sweeper died removing
    settings = make_settings(workspace_dir=tmp_path / "ws")
    runs = workspaces_dir(settings) / RUNS
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    pid = gone.stdout.decode().strip()
    for index in range(40):
        folder = runs / f"{pid}.f-{index}.1" / "tree" / "deep" / "er"
        folder.mkdir(parents=True)
        for n in range(20):
            (folder / f"file-{n}").write_text("x")
    left = runs / f".removing.{pid}.f-half.1" / "tree"
    left.mkdir(parents=True)

    # When four sweeps run at once (as four workers starting on one machine do)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        counts = list(pool.map(lambda _: sweep_stale_runs(settings), range(4)))

    # Then every folder is gone, each counted by exactly one sweep, and none raised
    assert os.listdir(runs) == []
    assert sum(counts) == 41


def test_a_sweep_takes_a_removing_folder_named_without_its_run(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = make_settings(workspace_dir=tmp_path / "ws")
    runs = workspaces_dir(settings) / RUNS
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    (runs / f".removing.{gone.stdout.decode().strip()}").mkdir(parents=True)
    assert sweep_stale_runs(settings) == 1
    assert os.listdir(runs) == []

"""Row 5 of bench/workspace.py: SIGKILL the worker running a snapshot fork; time its next step on another machine.

Each worker stands for a machine of its own: it runs under `unshare --mount` with an empty tmpfs over the folder
holding the parent's tree (as tests/e2e/test_workspaces.py does), and keeps its workspaces and cache in a folder of
its own, so a revived run can only rebuild the workspace from Redis (base manifest + journaled changes). A sweeper
runs with forkq's default timings (the worker's closed connection revives the fork).

Each trial launches a fork whose scripted steps each append a line to one file with the shell tool; once its first
tool call is journaled, the worker running it is SIGKILLed at a random point of the next second, and a fresh worker
(another "machine", an empty cache) is started so two stay available. Measured: Redis TIME just before the SIGKILL →
the stream id of the revived run's first `step`/`tool` event. Checked: the revived run is on another worker, and
the fork's changes (its patch) still hold the line written before the kill.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import Fleet, Proc, fleet, redis_ms, wait_ready
from bench.revival import owner_pid, wait_event
from bench.workspace_tree import make_tree
from broker_config.settings import Settings
from workers.client import ForkClient
from workers.history.snapshot import parse_parent_snapshot
from workers.records.fork import Status
from workers.store.workspaces import store_snapshot
from workers.workspace.materialize import WorkspaceCache, build, remove_tree

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_PARENT = ROOT / "workers" / "examples" / "parent.json"
PARAMS = {"description": "workspace revival bench fork", "prompt": "Edit the tree.", "subagent_type": "fork"}
STEPS, MODEL_S = 10, 0.1
KILL_AFTER_FIRST_TOOL_S = (0.0, 1.0)
STEP_EVENTS = ("step", "tool")
EDITED = "NOTES.md"  # the file every step appends to (new in the workspace: the fork's own change)


@dataclass(frozen=True)
class Revival:
    """One SIGKILL trial."""

    fork_id: str
    kill_ms: float
    revived_ms: int  # the `revived` event
    claimed_ms: int  # the revived run's `started` event
    next_ms: int
    next_kind: str
    killed: str
    resumed_on: str
    warm_cache: bool  # the reviving worker had run a fork of this tree before (its cache held the blobs)
    intact: bool  # the line written before the kill is in the fork's changes

    @property
    def recovery_s(self) -> float:
        """SIGKILL → the revived run's first step or tool event."""
        return (self.next_ms - self.kill_ms) / 1000


@dataclass
class Machines:
    """Workers each in a mount namespace where the parent's folder is an empty tmpfs."""

    group: Fleet
    env: dict[str, str]
    hidden: Path
    directory: Path
    workers: list[Proc] = field(default_factory=list)
    count: int = 0
    warm: set[str] = field(default_factory=set)  # workers that have built this tree

    def start_worker(self) -> Proc:
        """One more `forkq worker` on a machine of its own."""
        self.count += 1
        name = f"m{self.count}"
        own = self.directory / f"{name}-workspaces"
        own.mkdir()
        shell = 'mount -t tmpfs -o mode=0755 forkq-bench "$0" && exec "$@"'  # exec: the pid stays the worker's
        worker = [sys.executable, "-m", "workers.cli", "worker", "--hostname", f"{name}@%h", "--loglevel", "WARNING"]
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, str(self.hidden), *worker]
        proc = self.group.start(name, argv, {**self.env, "FORKQ_WORKSPACE_DIR": str(own)})
        self.workers.append(proc)
        return proc


def script() -> dict[str, Any]:
    """STEPS model calls, each with one shell call appending a line to EDITED, then a final answer."""
    steps = []
    for k in range(STEPS):
        call = {"id": f"s{k}", "name": "run_shell_command", "args": {"command": f"echo 'step {k}' >> {EDITED}"}}
        steps.append(
            {"delay_s": MODEL_S, "content": {"role": "model", "parts": [{"text": f"{k}"}, {"functionCall": call}]}}
        )
    steps.append({"delay_s": MODEL_S, "content": {"role": "model", "parts": [{"text": "done"}]}})
    return {"steps": steps}


def worker_env(redis_url: str, script_path: Path, sandbox: str) -> dict[str, str]:
    """The workers' environment: no inherited FORKQ_*, the repo on PYTHONPATH, the scripted provider."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    scripted = {"FORKQ_PROVIDER": "scripted", "FORKQ_SCRIPT": str(script_path), "FORKQ_SANDBOX": sandbox}
    return {**env, "PYTHONPATH": path, "FORKQ_REDIS_URL": redis_url, **scripted}


def trial(client: ForkClient, machines: Machines, parent: Any) -> Revival | None:
    """Launch, SIGKILL the worker running the fork after its first tool call, wait for the end; None if missed."""
    store, r = client.store, client.redis
    fid = client.launch(parent, PARAMS, workspace="snapshot").fork_id
    started = wait_event(store, fid, "0-0", ["started"], 60)
    victim = machines.group.by_pid(owner_pid(started))
    if victim is None:
        raise RuntimeError(f"fork {fid} was claimed by {started.wire_data()['owner']}, not by a bench worker")
    wait_event(store, fid, started.id, ["tool"], 60)
    time.sleep(random.uniform(*KILL_AFTER_FIRST_TOOL_S))
    state = store.state(fid)
    if state.status != Status.RUNNING or state.owner != started.wire_data()["owner"]:
        client.wait(fid, timeout=60)
        return None
    kill_ms = redis_ms(r)
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    machines.workers.remove(victim)
    machines.start_worker()
    client.wait(fid, timeout=120)
    events = store.events(fid, count=100_000)
    revival = next(e for e in events if e.type == "started" and e.id > started.id)
    revived = next(e for e in events if e.type == "revived")
    nxt = next(e for e in events if e.type in STEP_EVENTS and e.id > revival.id)
    resumed = machines.group.by_pid(owner_pid(revival))
    if resumed is None or resumed is victim:
        raise RuntimeError(f"fork {fid}: revived by {revival.wire_data()['owner']}, not by another bench worker")
    warm = resumed.name in machines.warm
    machines.warm |= {victim.name, resumed.name}
    intact = b"+step 0" in client.changes(fid).patch()
    return Revival(
        fid, kill_ms, revived.at_ms, revival.at_ms, nxt.at_ms, nxt.type, victim.name, resumed.name, warm, intact
    )


def cold_build_s(client: ForkClient, project: Path, tmp: Path) -> float:
    """Seconds a cold build of the tree takes with its git commit, here (the part of a revival spent rebuilding)."""
    digest, _ = store_snapshot(project, settings=client.settings, blobs=client.blobs)
    manifest = client.blobs.get_manifest(digest)
    cache = WorkspaceCache(tmp / "revival-cache", 4 * manifest.total_bytes + 1)
    took = timed(lambda: build(manifest, tmp / "revival-build", cache, client.blobs.get, git=True))
    remove_tree(tmp / "revival-build")
    remove_tree(tmp / "revival-cache")
    return took


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def revivals(redis_url: str, tmp: Path, kills: int, size: tuple[int, int], sandbox: str) -> tuple[list[Revival], float]:
    """Make the revival tree (`size`: files, bytes), start two machines and a sweeper, run `kills` trials; the
    trials and the seconds of a cold build of the tree here."""
    files, total_bytes = size
    hidden = tmp / "revival-machine"
    project = make_tree(hidden / "proj", files, total_bytes, git=True)
    script_path = tmp / "revival-script.json"
    script_path.write_text(json.dumps(script()))
    env = worker_env(redis_url, script_path, sandbox)
    raw = json.loads(EXAMPLE_PARENT.read_text())
    parent = parse_parent_snapshot({**raw, "cwd": str(project), "approval_mode": "yolo"})
    logs = tmp / "revival-logs"
    logs.mkdir()
    done: list[Revival] = []
    with fleet(logs) as group, ForkClient(Settings(redis_url=redis_url)) as client:
        built_s = cold_build_s(client, project, tmp)
        machines = Machines(group, env, hidden, logs)
        machines.start_worker()
        machines.start_worker()
        group.start("sweeper", [sys.executable, "-m", "workers.cli", "sweep"], env)
        wait_ready(client.app, machines.workers)
        while len(done) < kills:
            wait_ready(client.app, machines.workers)  # the replacement is up before the next kill
            one = trial(client, machines, parent)
            if one is None:
                print("  kill missed (the fork had ended); trial repeated", flush=True)
                continue
            done.append(one)
            print(
                f"  SIGKILL {len(done)}/{kills}: {one.killed} → {one.resumed_on} "
                f"({'warm' if one.warm_cache else 'cold'} cache), next {one.next_kind} after {one.recovery_s:.2f} s; "
                f"workspace intact: {one.intact}",
                flush=True,
            )
    return done, built_s

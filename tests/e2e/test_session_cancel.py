"""Cancelling a whole session on live `forkq worker` processes: running, parked and queued forks and a nested
subagent all end `cancelled`, no tool starts after the cancel is acknowledged; a cancel racing launches from
several threads lets none escape; a nested launch refused by the tombstone leaves its caller to end cancelled.

The model is a local OpenAI-compatible server (tests/fakeapi.py) answering each fork by the tag in its prompt
(`TAG[name]`): a fork of the cancelled session calls `run_shell_command` to append its tag to a ledger file, step
after step, for ever; the `caller` (and `late`) subagent also launches a nested subagent at its first step; a
fork of the other session answers at once. The workers' own metrics say when no run is left (`forkq_forks_running`).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from broker_config.settings import Settings
from tests.conftest import WorkerProcess
from tests.e2e.test_providers import OPENAI_KEY, OPENAI_MODEL
from tests.e2e.test_topology import free_port
from tests.fakeapi import FakeAPI, Received, Reply
from tests.live import wait_until
from tests.providers.test_openai_compat import completion, tool_call
from workers.app import make_app
from workers.client import ForkClient
from workers.errors import SessionCancelled
from workers.records.fork import Status
from workers.records.journal import EntryKind

SESSION: Final = "s-cancel-e2e"
OTHER: Final = "s-untouched-e2e"
STEP_S: Final = 0.15  # each model answer of a cancelled session's fork takes this long (a slow model)
LEDGER: Final = "ledger.txt"
TAG = re.compile(r"TAG\[([a-z0-9-]+)\]")
NESTED: Final = {"description": "nested", "prompt": "TAG[nested] Keep working.", "subagent_type": "general-purpose"}


def agent(tag: str, subagent_type: str = "fork") -> dict[str, Any]:
    extra = {"fork_turns": "1"} if subagent_type == "fork" else {}
    return {"description": tag, "prompt": f"TAG[{tag}] Keep working.", "subagent_type": subagent_type, **extra}


def fork_tag(received: Received) -> str:
    """The tag of the fork that sent the request: the first in its user messages."""
    users = [m for m in received.json["messages"] if m["role"] == "user"]
    found = TAG.search(json.dumps(users))
    assert found is not None, "a request without a tag"
    return found.group(1)


class Model:
    """The fake model: calls the shell for ever (finishes after 4 steps: `race-` forks; at once: `done-` forks);
    `caller` and `late` also launch a nested subagent at their first step, `late` once its gate opens."""

    def __init__(self) -> None:
        self.late = threading.Event()

    def __call__(self, received: Received) -> Reply:
        tag = fork_tag(received)
        turn = sum(1 for m in received.json["messages"] if m["role"] == "assistant")
        if tag.startswith("done") or (tag.startswith("race") and turn >= 4):
            return Reply(body=completion({"content": f"{tag}: finished"}))
        calls = [tool_call(f"c{turn}-sh", "run_shell_command", json.dumps({"command": f"echo {tag} >> {LEDGER}"}))]
        if tag in ("caller", "late") and turn == 0:
            if tag == "late":
                assert self.late.wait(30), "the test never opened the gate of the late caller"
            calls.append(tool_call(f"c{turn}-agent", "Agent", json.dumps(NESTED)))
        body = completion({"content": None, "tool_calls": calls}, finish_reason="tool_calls")
        return Reply(body=body, delay_s=STEP_S)


@pytest.fixture
def brain() -> Model:
    return Model()


@pytest.fixture
def model(brain: Model) -> Iterator[FakeAPI]:
    with FakeAPI(responder=brain) as server:
        yield server


class Workers:
    """Live `forkq worker` processes on the fake model, each with its metrics port."""

    def __init__(self, start: Callable[..., WorkerProcess], api: FakeAPI, count: int, concurrency: int) -> None:
        self.ports = [free_port() for _ in range(count)]
        env = {
            "FORKQ_PROVIDER": "openai",
            "FORKQ_OPENAI_BASE_URL": f"{api.url}/v1",
            "FORKQ_OPENAI_API_KEY": OPENAI_KEY,
            "FORKQ_HEARTBEAT_S": "1",
            "FORKQ_LEASE_TTL_S": "5",
        }
        self.procs = [
            start(concurrency=concurrency, FORKQ_METRICS_PORT=str(port), FORKQ_HEARTBEAT_FILE=f"/tmp/hb-{port}", **env)
            for port in self.ports
        ]

    def metric(self, name: str) -> float:
        """The sum over the workers of one sample (`name` with its labels, as /metrics prints it); 0 if absent."""
        total = 0.0
        for port in self.ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name} "))
        return total

    def serving(self) -> bool:
        try:
            self.metric("forkq_forks_running")
        except OSError:
            return False
        return True

    def logs(self) -> str:
        return "\n".join(proc.log()[-3000:] for proc in self.procs)


def parent_in(parent: dict[str, Any], session: str, cwd: Path, mode: str = "yolo") -> dict[str, Any]:
    snapshot = {**copy.deepcopy(parent), "session_id": session, "approval_mode": mode, "cwd": str(cwd)}
    return {**snapshot, "model": OPENAI_MODEL}


def ledger(cwd: Path) -> list[str]:
    path = cwd / LEDGER
    return path.read_text(encoding="utf-8").split() if path.exists() else []


def shell_starts(client: ForkClient, fork_id: str) -> int:
    return sum(1 for e in client.store.journal(fork_id) if e.kind is EntryKind.TOOL_STARTED)


@pytest.fixture
def start_workers(worker_process: Callable[..., WorkerProcess], model: FakeAPI) -> Callable[[int, int], Workers]:
    """Start `count` workers of `concurrency` slots on the fake model, once their metrics answer."""

    def start(count: int, concurrency: int) -> Workers:
        workers = Workers(worker_process, model, count=count, concurrency=concurrency)
        wait_until(workers.serving, 30, lambda: f"the workers' metrics\n{workers.logs()}")
        return workers

    return start


@pytest.fixture
def project(tmp_path: Path) -> dict[str, Path]:
    folders = {name: tmp_path / name for name in ("cancelled", "other")}
    for folder in folders.values():
        folder.mkdir()
    return folders


def test_a_session_cancel_ends_its_running_parked_queued_and_nested_forks_and_no_tool_starts_after_it(
    make_settings: Callable[..., Settings],
    start_workers: Callable[[int, int], Workers],
    parent: dict[str, Any],
    project: dict[str, Path],
    forkq_cli: Callable[..., tuple[int, str, str]],
) -> None:
    # Given two workers of 2 slots each, and a session with a fork that succeeded, two forks parked on a shell
    # call, two forks and a subagent calling the shell step after step, the subagent's nested subagent doing the
    # same (the 4 slots taken), and two forks queued behind them
    workers = start_workers(2, 2)
    settings = make_settings()
    app = make_app(settings)
    cwd = project["cancelled"]
    with ForkClient(settings, app=app) as client:
        yolo, asks = parent_in(parent, SESSION, cwd), parent_in(parent, SESSION, cwd, mode="default")
        done = client.launch(yolo, agent("done-a"), workspace="shared")
        assert done.wait(timeout=60).status is Status.SUCCEEDED
        parked = [client.launch(asks, agent(f"p{i}"), approval_policy="park", workspace="shared") for i in (1, 2)]
        for handle in parked:
            wait_until(lambda h=handle: h.status().status is Status.AWAITING_APPROVAL, 30, workers.logs)
        running = [client.launch(yolo, agent(f"r{i}"), workspace="shared") for i in (1, 2)]
        caller = client.launch(yolo, agent("caller", "general-purpose"), workspace="shared")
        nested_id = f"{caller.fork_id}.0.1"  # the caller's first step, its second call
        wait_until(lambda: {"r1", "r2", "caller", "nested"} <= set(ledger(cwd)), 60, workers.logs)
        queued = [client.launch(yolo, agent(f"q{i}"), workspace="shared") for i in (1, 2)]
        tags = {h.fork_id: f"r{i}" for i, h in enumerate(running, 1)} | {caller.fork_id: "caller", nested_id: "nested"}
        assert {client.status(h.fork_id).status for h in queued} == {Status.QUEUED}

        # When the session is cancelled
        outcome = client.cancel_session(SESSION)
        journals = {fid: len(client.store.journal(fid)) for fid in outcome.forks}

        # Then every one of its forks was cancelled by it, and ends cancelled
        everyone = {h.fork_id for h in [*parked, *running, caller, *queued]} | {nested_id}
        assert set(outcome.forks) == everyone and (outcome.cancelled, outcome.already_ended) == (8, 1)
        assert outcome.forks[0] == parked[0].fork_id  # oldest first: callers before the subagents they launched
        assert {fid: client.status(fid).status for fid in everyone} == dict.fromkeys(everyone, Status.CANCELLED)

        # and the fork that had succeeded before stays so: neither a launch nor a message starts anything in it
        with pytest.raises(SessionCancelled):
            client.launch(yolo, agent("r3"), workspace="shared")
        with pytest.raises(SessionCancelled):
            client.send(done.fork_id, "One more thing.")
        assert client.status(done.fork_id).status is Status.SUCCEEDED

        # and another session still launches and runs to its end on the same workers, once every run is over
        other = client.launch(parent_in(parent, OTHER, project["other"]), agent("done-b"), workspace="shared")
        assert other.wait(timeout=60).status is Status.SUCCEEDED
        wait_until(lambda: workers.metric("forkq_forks_running") == 0, 60, workers.logs)
        wait_until(lambda: workers.metric('forkq_deliveries_skipped_total{reason="duplicate"}') >= 2, 30)

        # and no tool started after the cancel: the journals did not grow, every ledger line had a journaled start
        assert {fid: len(client.store.journal(fid)) for fid in outcome.forks} == journals
        lines = ledger(cwd)
        for fid, tag in tags.items():
            assert 1 <= lines.count(tag) <= shell_starts(client, fid), (tag, lines)
        assert not {"p1", "p2", "q1", "q2"} & set(lines)
        assert workers.metric('forkq_forks_finished_total{status="cancelled"}') == 4
        assert workers.metric('forkq_forks_finished_total{status="succeeded"}') == 2  # done-a, and done-b
    app.close()

    # and a cancelled fork's result keeps what it used
    code, out, _ = forkq_cli("result", running[0].fork_id, "--json")
    result = json.loads(out)
    assert code == 1 and result["status"] == "cancelled"
    assert result["usage"]["model_calls"] >= 1 and result["usage"]["input_tokens"] >= 19
    assert result["usage"]["tool_uses"] >= 1


def test_a_session_cancel_racing_launches_from_several_threads_lets_no_launch_escape(
    make_settings: Callable[..., Settings],
    start_workers: Callable[[int, int], Workers],
    parent: dict[str, Any],
    project: dict[str, Path],
) -> None:
    # Given a worker, and three threads launching forks into one session as fast as they can until refused (each
    # fork would succeed after four steps)
    workers = start_workers(1, 3)
    settings = make_settings()
    app = make_app(settings)
    snapshot = parent_in(parent, SESSION, project["cancelled"])
    launched: list[str] = []
    refused: list[SessionCancelled] = []
    lock = threading.Lock()
    with ForkClient(settings, app=app) as client:

        def launch_until_refused(thread: int) -> None:
            for n in range(200):  # bounded: a test of a broken tombstone ends
                try:
                    handle = client.launch(snapshot, agent(f"race-{thread}-{n}"), workspace="shared")
                except SessionCancelled as exc:
                    with lock:
                        refused.append(exc)
                    return
                with lock:
                    launched.append(handle.fork_id)

        threads = [threading.Thread(target=launch_until_refused, args=(t,)) for t in range(3)]
        for thread in threads:
            thread.start()

        # When the session is cancelled while they launch
        wait_until(lambda: len(launched) >= 9, 30, "nine launches")
        outcome = client.cancel_session(SESSION)
        for thread in threads:
            thread.join(timeout=30)

        # Then each thread's launch after the cancel was refused with the tombstone, and every fork launched
        # before it is one the cancel ended (none had ended yet), now cancelled
        assert len(refused) == 3 and {exc.session for exc in refused} == {SESSION}
        assert sorted(outcome.forks) == sorted(launched) and outcome.already_ended == 0
        assert {client.status(fid).status for fid in launched} == {Status.CANCELLED}
        assert {f.fork_id for f in client.store.session_forks(SESSION, limit=100_000)} == set(launched)

        # and, once the worker is idle, none ran to success
        wait_until(lambda: workers.metric("forkq_forks_running") == 0, 60, workers.logs)
        assert workers.metric('forkq_forks_finished_total{status="succeeded"}') == 0
        assert {client.status(fid).status for fid in launched} == {Status.CANCELLED}
    app.close()


def test_a_nested_launch_into_a_session_being_cancelled_is_refused_and_its_caller_ends_cancelled(
    make_settings: Callable[..., Settings],
    start_workers: Callable[[int, int], Workers],
    brain: Model,
    parent: dict[str, Any],
    project: dict[str, Path],
) -> None:
    # Given a subagent whose model is about to answer with an Agent call, and its session's tombstone written
    # (the first step of a cancel, before the cancel reaches the subagent)
    workers = start_workers(1, 2)
    settings = make_settings()
    app = make_app(settings)
    with ForkClient(settings, app=app) as client:
        snapshot = parent_in(parent, SESSION, project["cancelled"])
        caller = client.launch(snapshot, agent("late", "general-purpose"), workspace="shared")
        wait_until(lambda: caller.status().status is Status.RUNNING, 30, workers.logs)
        client.redis.set(client.store.keys.session_cancelled(SESSION), "1", px=60_000)

        # When the model answers and the caller launches its nested subagent
        brain.late.set()

        # Then the launch is refused and the caller's model reads why; nothing of the subagent was written
        def refusal() -> str | None:
            results = [e for e in client.store.journal(caller.fork_id) if e.kind is EntryKind.TOOL_RESULT]
            return next((str(e.response) for e in results if e.name == "Agent"), None)

        answer = wait_until(refusal, 30, workers.logs)
        assert f"the subagent was not launched: session {SESSION} was cancelled" in answer
        assert not client.redis.exists(client.store.keys.state(f"{caller.fork_id}.0.1"))

        # and once the cancel reaches the caller, it ends cancelled, its run over, without an error in the log
        outcome = client.cancel_session(SESSION)
        assert outcome.forks == [caller.fork_id]
        wait_until(lambda: workers.metric("forkq_forks_running") == 0, 60, workers.logs)
        assert caller.status().status is Status.CANCELLED
        assert workers.metric('forkq_forks_finished_total{status="cancelled"}') == 1
        assert "Traceback" not in workers.logs()
    app.close()

"""Cluster-wide model admission with live `forkq worker` processes and a local OpenAI-compatible server.

The server answers Chat Completions as the API does (`tests.fakeapi.FakeAPI` with the completion bodies of the
adapter's tests) and measures what admission must bound: the requests it serves at once, and the order and
time at which they arrive.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from broker_config.settings import Settings
from tests.conftest import REPO_ROOT, TEST_NAMESPACE, WorkerProcess
from tests.fakeapi import FakeAPI, Received, Reply
from tests.live import forkq_environment, sweeper_process, wait_until
from tests.providers.test_openai_compat import completion, error_body, tool_call
from workers.base.keys import Keys
from workers.client import ForkClient
from workers.records.fork import ForkResult, Status
from workers.records.parked import AdmissionLimit, ModelWait
from workers.store.admission import AdmissionStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "gpt-4.1-mini"
KEY = "sk-e2e-admission-3c9a"
READY_S = 60.0  # workers start (Celery, the SDK) within this on a loaded machine


@dataclass
class Stub:
    """The model server's side: each request answered after `latency_s`, or as `answer` says; what it served."""

    latency_s: float = 0.3
    answer: Callable[[Received, int], Reply | None] | None = None  # (request, its index) → a reply, or the default
    in_flight: int = 0
    most_in_flight: int = 0
    arrivals: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic, the request's task)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, received: Received) -> Reply:
        with self.lock:
            index = len(self.arrivals)
            self.arrivals.append((received.at, task_of(received)))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            special = self.answer(received, index) if self.answer is not None else None
            if special is not None:
                return special
            time.sleep(self.latency_s)  # the model's time: requests overlap at the server meanwhile
            return Reply(200, completion({"content": "done"}))
        finally:
            with self.lock:
                self.in_flight -= 1


def task_of(received: Received) -> str:
    """The fork's task: the marker `TASK-<name>` its prompt carries, as the request sent it."""
    text = received.raw.decode()
    start = text.find("TASK-")
    return text[start : text.find(".", start)] if start >= 0 else ""


def served_before_last(stub: Stub, *, early: str, late: str) -> int:
    """How many requests of tasks named `early`* reached the server before the last one of tasks named `late`*."""
    order = [task for _, task in stub.arrivals]
    last = max(i for i, task in enumerate(order) if task.startswith(late))
    return sum(task.startswith(early) for task in order[:last])


@dataclass
class Rig:
    """A model server, the workers' environment for it, and a client launching forks of sessions."""

    stub: Stub
    api: FakeAPI
    client: ForkClient
    settings: Settings
    parent: dict[str, Any]
    redis: redis.Redis
    start_worker: Callable[..., WorkerProcess]
    env: dict[str, str] = field(default_factory=dict)

    def worker(self, concurrency: int = 8, **env: str) -> WorkerProcess:
        return self.start_worker(concurrency, **{**self.env, **env})

    def launch(self, session: str, task: str, **options: Any) -> str:
        parent = {**copy.deepcopy(self.parent), "session_id": session}
        params = {"description": task, "prompt": task, "subagent_type": "fork", "fork_turns": "1"}
        return self.client.launch(parent, params, **options).fork_id

    def result(self, fork_id: str, timeout: float = READY_S) -> ForkResult:
        result = self.client.wait(fork_id, timeout=timeout)
        assert result is not None, f"fork {fork_id} did not end within {timeout} s"
        return result

    def waiting(self, fork_id: str) -> ModelWait | None:
        wait = self.client.status(fork_id).waiting_for
        return wait if isinstance(wait, ModelWait) else None

    @property
    def admission(self) -> AdmissionStore:
        return AdmissionStore(self.redis, Keys(TEST_NAMESPACE), token="test:0:0", hold_ttl_ms=1, alive_ttl_ms=1)


@pytest.fixture
def rig(
    make_settings: Callable[..., Settings],
    worker_process: Callable[..., WorkerProcess],
    parent: dict[str, Any],
    workdir: Path,
    redis_client: redis.Redis,
) -> Iterator[Callable[..., Rig]]:
    """Build a rig for a stub and FORKQ_MODEL_LIMITS; workers are started by the test."""
    made: list[tuple[FakeAPI, ForkClient]] = []

    def make(stub: Stub, limits: dict[str, Any], **env: str) -> Rig:
        api = FakeAPI(responder=stub).__enter__()
        settings = make_settings(workspace="shared")
        client = ForkClient(settings)
        made.append((api, client))
        worker_env = {
            "FORKQ_PROVIDER": "openai",
            "FORKQ_OPENAI_BASE_URL": f"{api.url}/v1",
            "FORKQ_OPENAI_API_KEY": KEY,
            "FORKQ_MODEL_LIMITS": json.dumps(limits),
            "FORKQ_PROVIDER_MAX_ATTEMPTS": "3",
            "FORKQ_PROVIDER_RETRY_BASE_S": "0.01",
            "FORKQ_PROVIDER_RETRY_MAX_S": "0.05",
            "FORKQ_HEARTBEAT_S": "1",
            **env,
        }
        model_parent = {**parent, "model": MODEL, "cwd": str(workdir)}
        return Rig(stub, api, client, settings, model_parent, redis_client, worker_process, worker_env)

    yield make
    for api, client in made:
        client.close()
        api.__exit__(None, None, None)


def test_a_concurrency_limit_holds_across_two_workers_and_a_waiting_fork_shows_its_wait(
    rig: Callable[..., Rig],
) -> None:
    # Given two workers of 8 fork slots each, and a model limited to 3 calls at once
    setup = rig(Stub(latency_s=0.4), {"gpt-4.1*": {"concurrency": 3}, "*": {"rpm": 10_000}})
    workers = [setup.worker(), setup.worker()]

    # When twelve forks of one session call it
    forks = [setup.launch("s-one", f"Task {i} of session one.") for i in range(12)]
    waits: dict[str, ModelWait] = {}

    def a_fork_waits() -> bool:
        for fid in forks:
            wait = setup.waiting(fid)
            if wait is not None:
                waits[fid] = wait
        return bool(waits)

    wait_until(a_fork_waits, READY_S, "a fork to show its wait for the model")
    results = [setup.result(fid) for fid in forks]

    # Then every fork succeeded, the server never served more than 3 at once, and it did serve 3 at once
    assert [r.status for r in results] == [Status.SUCCEEDED] * 12, [r.error for r in results]
    assert setup.stub.most_in_flight == 3
    # both workers ran forks (the limit held across them, not within one)
    owners = {
        e.wire_data()["owner"].split(":")[1] for fid in forks for e in setup.client.events(fid) if e.type == "started"
    }
    assert owners == {str(w.process.pid) for w in workers}
    # a waiting fork showed why it waited, got one model_wait event, and shows no wait once it ended
    fid, wait = next(iter(waits.items()))
    assert (wait.model, wait.limit) == (MODEL, AdmissionLimit.CONCURRENCY)
    waited = [e.wire_data() for e in setup.client.events(fid) if e.type == "model_wait"]
    assert waited == [{"step": 1, "model": MODEL, "limit": "concurrency"}]
    assert setup.client.status(fid).waiting_for is None
    assert setup.admission.holds(MODEL) == [] and setup.admission.queued(MODEL) == []


def test_an_rpm_limit_holds_across_two_workers_and_the_calls_past_it_wait_for_the_window(
    rig: Callable[..., Rig],
) -> None:
    # Given two workers of 4 fork slots each, and a model limited to 4 requests a minute (a sliding 60 s window)
    setup = rig(Stub(latency_s=0.05), {"gpt-4.1*": {"rpm": 4}})
    workers = [setup.worker(4), setup.worker(4)]

    # When seven forks, one model call each, call it at once
    forks = [setup.launch(f"s-{i % 2}", f"Task {i} of the rpm test.") for i in range(7)]

    # Then four succeed, the three others wait on rpm (no request of theirs reached the server), and stay waiting
    def succeeded() -> list[str]:
        return [fid for fid in forks if setup.client.status(fid).status is Status.SUCCEEDED]

    wait_until(lambda: len(succeeded()) >= 4, READY_S, "four forks to succeed")
    rest = [fid for fid in forks if fid not in succeeded()]
    assert len(rest) == 3
    wait_until(lambda: all(setup.waiting(fid) is not None for fid in rest), READY_S, "three forks to wait")
    assert {wait.limit for fid in rest if (wait := setup.waiting(fid)) is not None} == {AdmissionLimit.RPM}
    time.sleep(2.0)  # a while into the window: nothing more may go out (a wrong limit would let them through)
    assert len(setup.stub.arrivals) == 4
    assert [setup.client.status(fid).status for fid in rest] == [Status.RUNNING] * 3
    # both workers ran forks, so the four requests were counted across them
    owners = {
        e.wire_data()["owner"].split(":")[1] for fid in forks for e in setup.client.events(fid) if e.type == "started"
    }
    assert owners == {str(w.process.pid) for w in workers}
    for fid in rest:  # not 60 s more for the window to move on
        setup.client.cancel(fid)


def test_the_slots_of_a_sigkilled_worker_come_back_as_its_forks_are_revived(
    rig: Callable[..., Rig], tmp_path: Path
) -> None:
    # Given a 60 s lease (so only the dead worker's closed connection can free anything within the test), a
    # sweeper, a model limited to 2 calls at once, and a server whose first two requests never end
    stalled = threading.Event()

    def first_two_stall(received: Received, index: int) -> Reply | None:
        if index < 2:
            stalled.wait(60)  # a call that does not end while its worker lives: it holds its slot
        return None

    stub = Stub(latency_s=0.1, answer=first_two_stall)
    setup = rig(stub, {MODEL: {"concurrency": 2}}, FORKQ_LEASE_TTL_S="60")
    env = forkq_environment(setup.settings.redis_url, FORKQ_LEASE_TTL_S="60", FORKQ_HEARTBEAT_S="1")
    with sweeper_process(env, tmp_path / "sweeper.log"):
        victim = setup.worker(concurrency=4)
        holders = [setup.launch("s-one", f"Held call {i}.") for i in range(2)]
        wait_until(lambda: len(setup.admission.holds(MODEL)) == 2 and stub.in_flight == 2, READY_S, "two slots held")
        waiting = [setup.launch("s-two", f"Waiting call {i}.") for i in range(2)]
        wait_until(lambda: all(setup.waiting(fid) for fid in waiting), READY_S, "the other forks to wait")
        setup.worker(concurrency=4)
        procs = Keys(TEST_NAMESPACE).procs
        wait_until(lambda: setup.redis.hlen(procs) == 2, READY_S, "the second worker to start")

        # When the worker holding both slots is SIGKILLed
        killed_at = time.monotonic()
        victim.process.send_signal(signal.SIGKILL)

        # Then the slots come back within the revival time (the lease had about a minute left), and every fork ends
        results = [setup.result(fid) for fid in waiting + holders]
        assert time.monotonic() - killed_at < 15
    stalled.set()
    assert [r.status for r in results] == [Status.SUCCEEDED] * 4, [r.error for r in results]
    assert stub.most_in_flight <= 2 + 2  # the two stalled requests of the dead worker, still open at the server
    assert setup.admission.holds(MODEL) == []


@pytest.mark.parametrize(("status", "retry_after"), [(429, 4), (503, 3)])
def test_a_429_or_503_with_retry_after_pauses_every_workers_calls_to_that_model_until_it_passes(
    rig: Callable[..., Rig], status: int, retry_after: int
) -> None:
    # Given two workers and a server that answers the first request 429 (or 503) with Retry-After
    def first_is_limited(received: Received, index: int) -> Reply | None:
        if index == 0:
            return Reply(status, error_body("Rate limit reached for requests"), {"Retry-After": str(retry_after)})
        return None

    stub = Stub(latency_s=0.05, answer=first_is_limited)
    setup = rig(stub, {MODEL: {"concurrency": 10}})
    setup.worker()
    setup.worker()
    first = setup.launch("s-one", "The first call.")
    wait_until(lambda: setup.admission.cooldown(MODEL, f"{setup.api.url}/v1")[0] > 0, READY_S, "the cooldown")
    limited_at = stub.arrivals[0][0]

    # When other forks (on either worker) call the model during the cooldown
    others = [setup.launch("s-two", f"Another call {i}.") for i in range(4)]
    results = [setup.result(fid) for fid in [first, *others]]

    # Then no request reached the server before the cooldown ended, the retry included, and all succeeded
    assert [r.status for r in results] == [Status.SUCCEEDED] * 5, [r.error for r in results]
    later = [at - limited_at for at, _ in stub.arrivals[1:]]
    assert len(later) == 5 and min(later) >= retry_after, later
    limits = {e.wire_data()["limit"] for fid in others for e in setup.client.events(fid) if e.type == "model_wait"}
    assert limits == {"cooldown"}


def test_a_session_with_few_forks_is_not_starved_by_one_with_many(rig: Callable[..., Rig]) -> None:
    # Given one worker, a model limited to one call at once, and session A with eight forks queued for it
    setup = rig(Stub(latency_s=0.25), {MODEL: {"concurrency": 1}})
    setup.worker(concurrency=16)
    many = [setup.launch("s-many", f"TASK-many-{i}.") for i in range(8)]
    wait_until(lambda: sum(setup.waiting(fid) is not None for fid in many) >= 6, READY_S, "session A's queue")

    # When session B launches two forks after them
    few = [setup.launch("s-few", f"TASK-few-{i}.") for i in range(2)]
    wait_until(lambda: all(setup.waiting(fid) for fid in few), READY_S, "session B's forks to queue")
    granted_before = sum(setup.waiting(fid) is None for fid in many)  # A's calls granted (or done) by then
    results = [setup.result(fid) for fid in many + few]

    # Then B's two calls went out within the next two turns, each ahead of A's next call at most: not after
    # A's whole queue (a FIFO would have served all eight of A's first)
    assert [r.status for r in results] == [Status.SUCCEEDED] * 10
    many_before = served_before_last(setup.stub, early="TASK-many", late="TASK-few")
    assert granted_before + 2 < 8
    assert many_before <= granted_before + 2, (granted_before, setup.stub.arrivals)


def test_a_session_with_weight_three_takes_three_turns_to_one(rig: Callable[..., Rig]) -> None:
    # Given one worker, a model limited to one call at once, FORKQ_SESSION_WEIGHTS giving s-heavy 3, and session
    # s-light with eight forks queued
    setup = rig(Stub(latency_s=0.25), {MODEL: {"concurrency": 1}})
    setup.worker(concurrency=16, FORKQ_SESSION_WEIGHTS=json.dumps({"s-heavy": 3}))
    light = [setup.launch("s-light", f"TASK-light-{i}.") for i in range(8)]
    wait_until(lambda: sum(setup.waiting(fid) is not None for fid in light) >= 6, READY_S, "s-light's queue")

    # When s-heavy launches six forks after them
    heavy = [setup.launch("s-heavy", f"TASK-heavy-{i}.") for i in range(6)]
    wait_until(lambda: setup.waiting(heavy[0]) is not None, READY_S, "s-heavy's first fork to queue")
    granted_before = sum(setup.waiting(fid) is None for fid in light)
    results = [setup.result(fid) for fid in light + heavy]

    # Then s-heavy's six calls went out while s-light's took about two turns (equal weights: about six)
    assert [r.status for r in results] == [Status.SUCCEEDED] * 14
    light_before = served_before_last(setup.stub, early="TASK-light", late="TASK-heavy")
    assert granted_before + 3 < 8
    assert light_before <= granted_before + 3, (granted_before, setup.stub.arrivals)


def test_time_waiting_for_admission_does_not_count_against_max_wall_s(rig: Callable[..., Rig]) -> None:
    # Given a model limited to one call at once, held by another fork's call until 2.5 s after the fork under test
    # began to wait (however long its launch took on a busy machine)
    waiting = threading.Event()

    def answer(received: Received, index: int) -> Reply | None:
        task = task_of(received)
        if task == "TASK-hold":
            waiting.wait(READY_S)
            time.sleep(2.5)  # the model's time: the slot is held meanwhile
        elif received.json["messages"][-1]["role"] == "tool":  # the fork's tool result: its last call
            time.sleep(1.0)  # the fork runs on a while its wait, written by the coordinator after its call, lands
            return Reply(200, completion({"content": "read it"}))
        elif task == "TASK-wall":
            read = tool_call("call_1", "read_file", json.dumps({"path": "notes.txt"}))
            return Reply(200, completion({"content": None, "tool_calls": [read]}, finish_reason="tool_calls"))
        return None

    setup = rig(Stub(latency_s=0.05, answer=answer), {MODEL: {"concurrency": 1}})
    setup.worker()
    holder = setup.launch("s-one", "TASK-hold.")
    wait_until(lambda: len(setup.stub.arrivals) == 1, READY_S, "the slot to be taken")

    # When a fork limited to 2 s of wall clock waits about 3 s for the slot, then calls the model twice
    fid = setup.launch("s-two", "TASK-wall.", max_wall_s=2)
    state_key = Keys(TEST_NAMESPACE).state(fid)
    wait_until(lambda: bool(setup.redis.hget(state_key, "model_wait")), READY_S, "the fork to wait for the slot")
    waiting.set()
    result = setup.result(fid)

    # Then it succeeds (its deadline moved on by its wait), and its first start moved on by the wait too, so a
    # revival would not count it either
    assert setup.result(holder).status is Status.SUCCEEDED
    assert result.status is Status.SUCCEEDED, result.error
    assert result.usage.model_calls == 2
    state = setup.redis.hgetall(state_key)
    assert int(state[b"first_started_ms"]) - int(state[b"started_ms"]) >= 2000


def test_bad_admission_settings_stop_the_worker_with_exit_2_naming_the_glob_and_the_key(redis_url: str) -> None:
    for limits, named in (('{"gpt-*": {"concurency": 5}}', "'concurency'"), ('{"gpt-*": {"rpm": -1}}', "rpm=-1")):
        env = forkq_environment(redis_url, FORKQ_MODEL_LIMITS=limits)
        for argv in (["worker"], ["status", "f-any"]):
            done = subprocess.run(
                [sys.executable, "-m", "workers.cli", *argv],
                check=False,
                cwd=REPO_ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 2, done.stderr
            assert "FORKQ_MODEL_LIMITS" in done.stderr and "'gpt-*'" in done.stderr and named in done.stderr

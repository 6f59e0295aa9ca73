"""run_fork_job without a broker: claims, replay after a simulated death, the tool surface, shutdown; and
the worker's Redis client, with a real worker whose connections go silent."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, cast

import psutil
import pytest
import redis

from broker_config.settings import Settings
from tests.conftest import PARENT_PATH, TEST_NAMESPACE, TEST_QUEUE, WorkerProcess
from tests.live import FreezingProxy, forkq_environment, sweeper_process, wait_until
from workers.app import make_app
from workers.client import ForkClient
from workers.demo.redis_server import RedisServer
from workers.history.messages import Content, FunctionCall, Part
from workers.loop.child import STOP_REASONS
from workers.providers import ModelRequest, ModelResponse, TokenUsage
from workers.records.fork import Status
from workers.records.journal import RequestDigests
from workers.records.parked import ResumeWait
from workers.service.job import RunForkJob
from workers.service.outcome import Outcome, RunOutcome
from workers.service.runner import (
    MIN_REDIS_TIMEOUT_S,
    WorkerRuntime,
    redis_timeout_s,
    run_fork_job,
    stop_outcome,
)
from workers.service.spawn import POLL_MS
from workers.store.forks import WAIT_TIMEOUT_MS
from workers.store.lease import Leases
from workers.tools.registry import Tool, ToolContext, ToolRegistry


class Died(BaseException):
    """Stands for the worker process dying mid-step (nothing after it runs)."""


class CallsThenAnswers:
    """A provider: step 0 calls `count`, step 1 answers; it can die at a chosen step."""

    name = "test"

    def __init__(self, die_at: int | None = None, answer: str = "done", usage: TokenUsage | None = None) -> None:
        self.die_at = die_at
        self.answer = answer
        self.usage = usage or TokenUsage()
        self.requests: list[ModelRequest] = []

    def generate(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        if request.step == self.die_at:
            raise Died
        if request.step == 0:
            call = FunctionCall(id="c1", name="count", args={})
            return ModelResponse(content=Content(role="model", parts=[Part(function_call=call)]), usage=self.usage)
        return ModelResponse(content=Content(role="model", parts=[Part(text=self.answer)]), usage=self.usage)


def counting_tools(effects: list[str]) -> ToolRegistry:
    def count(args: Any, ctx: ToolContext) -> str:
        effects.append(ctx.idempotency_key)
        return "counted"

    registry = ToolRegistry()
    registry.register(Tool("count", "count a side effect", {"type": "object"}, count, mutating=True))
    return registry


def runtime_with(settings: Settings, provider: Any, tools: ToolRegistry) -> WorkerRuntime:
    runtime = WorkerRuntime(settings)
    runtime.provider = provider  # cached properties: an instance attribute replaces them
    runtime.tools = tools
    return runtime


def launch(client: ForkClient, parent: dict[str, Any], **options: Any) -> tuple[str, RunForkJob]:
    # yolo: the parent's mode carries over, so the counted side effect runs without approval
    parent = {**parent, "approval_mode": "yolo", "tools": [{"name": "count", "parameters": {"type": "object"}}]}
    handle = client.launch(parent, {"description": "t", "prompt": "count once", "subagent_type": "fork"}, **options)
    return handle.fork_id, RunForkJob(fork_id=handle.fork_id, digest=handle.digest)


def expire(settings: Settings, fork_id: str) -> Leases:
    """Simulate the lease running out: delete it, then let a sweeper pass revive the fork."""
    leases = WorkerRuntime(settings).leases
    leases.client.delete(leases.keys.lease(fork_id))
    assert leases.revive(fork_id, max_attempts=3) == "revive"
    return leases


def test_a_fork_runs_to_its_result_and_a_second_delivery_is_a_no_op(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    effects: list[str] = []
    fork_id, job = launch(client, parent)
    runtime = runtime_with(settings, CallsThenAnswers(), counting_tools(effects))
    assert run_fork_job(runtime, job) == RunOutcome(Outcome.SUCCEEDED)
    assert run_fork_job(runtime, job) == RunOutcome(Outcome.DUPLICATE, "succeeded")
    assert effects == [f"{fork_id}:0:c1"]
    result = client.result(fork_id)
    assert result is not None and result.output == "done" and result.usage.tool_uses == 1


def test_the_final_answer_is_journaled_with_the_result_in_the_same_write(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    fork_id, job = launch(client, parent)
    runtime = runtime_with(settings, CallsThenAnswers(), counting_tools([]))
    appends: list[list[str]] = []
    append = runtime.leases.append

    def counted(claim: Any, *entries: Any, **kwargs: Any) -> None:
        appends.append([e.kind for e in entries])
        append(claim, *entries, **kwargs)

    runtime.leases.append = counted  # type: ignore[method-assign]

    assert run_fork_job(runtime, job) == RunOutcome(Outcome.SUCCEEDED)

    # the answer is in the journal, but it was not appended on its own: it went with the result
    assert [e.kind for e in runtime.leases.journal(fork_id)][-1] == "model"
    assert appends == [["surface"], ["model"], ["tool_started"], ["tool_result"]]
    assert [e.type for e in client.events(fork_id)][-3:] == ["model_call", "step", "finished"]


class CountedConnection(redis.Connection):
    """A Redis connection that counts, per thread, what it sends: one command or one pipeline, a round trip each."""

    sends: ClassVar[Counter[int]] = Counter()

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountedConnection.sends[threading.get_ident()] += 1
        super().send_packed_command(command, check_health)


def fork_round_trips(settings: Settings, client: ForkClient, parent: dict[str, Any]) -> int:
    """The round trips to Redis, of every thread of the worker's runtime, that one run of a two-step fork causes.

    A first run of another fork loads every script and starts the heartbeat and the admission coordinator, whose
    next renewals are a heartbeat (20 s) away: what the second run's threads send is that run's. A release the
    coordinator still holds is sent (and counted) by its `close`.
    """
    quiet = settings.model_copy(update={"heartbeat_s": 20.0, "lease_ttl_s": 60.0})
    runtime = runtime_with(
        quiet, CallsThenAnswers(usage=TokenUsage(input_tokens=30, output_tokens=5)), counting_tools([])
    )
    pool = redis.ConnectionPool.from_url(settings.redis_url, connection_class=CountedConnection)
    runtime.redis = redis.Redis(connection_pool=pool)  # the runtime's stores are made from it on first use
    try:
        for _ in range(2):
            _, job = launch(client, parent)
            before = sum(CountedConnection.sends.values())
            assert run_fork_job(runtime, job) == RunOutcome(Outcome.SUCCEEDED)
        if runtime.admission is not None:
            runtime.admission.close()
        return sum(CountedConnection.sends.values()) - before
    finally:
        runtime.keeper.stop()
        pool.disconnect()


def test_admission_adds_one_round_trip_per_model_call_and_budgets_ride_on_the_forks_writes(
    make_settings: Callable[..., Settings], client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a session with a budget (far from used), so every call reads it and every answer is charged
    client.set_budget(parent["session_id"], tokens=1_000_000)

    # When the same two-step fork runs without limits, then with a concurrency limit on its model
    unlimited = fork_round_trips(make_settings(), client, parent)
    limited = fork_round_trips(make_settings(model_limits={"gemini-*": {"concurrency": 4}}), client, parent)

    # Then the limits cost one round trip per model call (the acquire; the release rides on the journal append,
    # and no thread sends it on its own), and the budget reads and charges ride on the checkpoints and appends:
    # the fork makes the round trips it made before budgets, and one more to read its budget before its first call
    # (whose checkpoint the claim made)
    assert limited - unlimited == 2
    claim, first_budget_read, appends, checkpoint, finish = 1, 1, 3, 1, 1  # appends: model, tool started, tool result
    assert unlimited == claim + first_budget_read + appends + checkpoint + finish
    assert client.budget(parent["session_id"]).used == 4 * 2 * 35  # four runs of two calls, each charged once


def test_a_revived_fork_replays_its_journal_and_makes_the_same_request(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a first run that called the tool and died during its second model call
    effects: list[str] = []
    fork_id, job = launch(client, parent)
    first = CallsThenAnswers(die_at=1)
    with pytest.raises(Died):
        run_fork_job(runtime_with(settings, first, counting_tools(effects)), job)
    # When its lease expires and another worker takes it
    expire(settings, fork_id)
    second = CallsThenAnswers()
    assert run_fork_job(runtime_with(settings, second, counting_tools(effects)), job) == RunOutcome(Outcome.SUCCEEDED)
    # Then the recorded tool call is not run again and the step-1 request is identical
    assert effects == [f"{fork_id}:0:c1"]
    assert [r.step for r in second.requests] == [1]
    assert second.requests[0].model_dump() == first.requests[1].model_dump()
    assert client.status(fork_id).attempt == 2


def test_every_request_carries_the_launch_output_schema_and_a_revival_rebuilds_it_identically(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a fork launched with an output schema whose first run died during its second model call
    schema = {"type": "object", "properties": {"counted": {"type": "boolean"}}, "required": ["counted"]}
    fork_id, job = launch(client, parent, output_schema=schema)
    first = CallsThenAnswers(die_at=1, answer='{"counted": true}')
    with pytest.raises(Died):
        run_fork_job(runtime_with(settings, first, counting_tools([])), job)

    # When another worker revives it
    expire(settings, fork_id)
    second = CallsThenAnswers(answer='{"counted": true}')
    assert run_fork_job(runtime_with(settings, second, counting_tools([])), job) == RunOutcome(Outcome.SUCCEEDED)

    # Then every request the model saw carried the schema, and the revived step-1 request is the same
    assert [r.output_schema for r in [*first.requests, *second.requests]] == [schema] * 3
    assert second.requests[0].model_dump() == first.requests[1].model_dump()
    recorded = [e.request_digest for e in runtime_with(settings, second, ToolRegistry()).leases.journal(fork_id)]
    digests = RequestDigests()
    assert [d for d in recorded if d] == [digests.digest(first.requests[0]), digests.digest(second.requests[0])]


def test_a_revived_fork_pauses_when_a_tool_it_started_with_is_missing(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a fork whose first worker could run `count`, and died
    fork_id, job = launch(client, parent)
    with pytest.raises(Died):
        run_fork_job(runtime_with(settings, CallsThenAnswers(die_at=0), counting_tools([])), job)
    expire(settings, fork_id)
    # When a worker without `count` revives it
    outcome = run_fork_job(runtime_with(settings, CallsThenAnswers(), ToolRegistry()), job)
    # Then the fork pauses, waiting for a resume for a reason naming the tool (no error), and resumes when asked
    state = client.status(fork_id)
    assert outcome == RunOutcome(Outcome.PAUSED) and state.status is Status.PAUSED
    assert isinstance(state.waiting_for, ResumeWait) and "count" in state.waiting_for.reason
    assert state.error is None
    assert client.resume(fork_id) is Status.QUEUED
    assert client.status(fork_id).status is Status.QUEUED


def test_a_worker_shutting_down_releases_its_fork_for_another_worker(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a worker that receives SIGTERM while its fork waits on the model
    fork_id, job = launch(client, parent)
    runtime = runtime_with(settings, CallsThenAnswers(), counting_tools([]))
    requeued: list[tuple[str, int]] = []
    runtime.requeue = lambda fid, digest, attempt: requeued.append((fid, attempt))

    class StopsDuringTheCall(CallsThenAnswers):
        def generate(self, request: ModelRequest) -> ModelResponse:
            runtime.stopping.set()
            return super().generate(request)

    runtime.provider = StopsDuringTheCall()
    # Then the answer is journaled, the fork released at the next boundary and re-enqueued at once
    assert run_fork_job(runtime, job) == RunOutcome(Outcome.RELEASED)
    assert client.status(fork_id).status is Status.QUEUED
    assert requeued == [(fork_id, 2)]
    assert [e.type for e in client.events(fork_id)][-1] == "released"
    assert [e.kind for e in WorkerRuntime(settings).leases.journal(fork_id)] == ["surface", "model"]
    # and a delivery that reaches a stopping worker is handed back without a claim
    assert run_fork_job(runtime, job) == RunOutcome(Outcome.HANDED_BACK)
    assert client.status(fork_id).attempt == 1


def test_a_job_whose_digest_is_not_the_launch_digest_leaves_the_fork_untouched(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    from workers.errors import RecordIntegrityError

    fork_id, _ = launch(client, parent)
    forged = RunForkJob(fork_id=fork_id, digest="0" * 64)
    with pytest.raises(RecordIntegrityError, match="launch digest"):
        run_fork_job(runtime_with(settings, CallsThenAnswers(), counting_tools([])), forged)
    assert client.status(fork_id).status is Status.QUEUED


class GarblesItsCall(CallsThenAnswers):
    """Step 0 returns a call whose arguments the provider could not parse (`invalid_calls`)."""

    def generate(self, request: ModelRequest) -> ModelResponse:
        response = super().generate(request)
        if request.step == 0:
            return response.model_copy(update={"invalid_calls": {"c1": "arguments are not a JSON object"}})
        return response


def test_a_call_the_provider_garbled_is_answered_with_its_error_and_never_run(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    effects: list[str] = []
    _, job = launch(client, parent)
    provider = GarblesItsCall()

    assert run_fork_job(runtime_with(settings, provider, counting_tools(effects)), job) == RunOutcome(Outcome.SUCCEEDED)

    assert effects == []
    answer = provider.requests[1].messages[-1].parts[0].function_response
    assert answer is not None and answer.response == {"error": "arguments are not a JSON object"}


def test_a_garbled_call_is_still_not_run_after_a_revival(
    settings: Settings, client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a run that answered a garbled call with its error and died in the next model call
    effects: list[str] = []
    fork_id, job = launch(client, parent)
    with pytest.raises(Died):
        run_fork_job(runtime_with(settings, GarblesItsCall(die_at=1), counting_tools(effects)), job)
    # When another worker revives it
    expire(settings, fork_id)
    second = CallsThenAnswers()
    assert run_fork_job(runtime_with(settings, second, counting_tools(effects)), job) == RunOutcome(Outcome.SUCCEEDED)
    # Then the replayed request carries the recorded error answer, and the tool never ran
    assert effects == []
    answer = second.requests[0].messages[-1].parts[0].function_response
    assert answer is not None and answer.response == {"error": "arguments are not a JSON object"}


def test_replay_keeps_a_garbled_call_unrunnable_when_it_was_not_answered_yet() -> None:
    from workers.history.selection import ForkSeed
    from workers.loop.replay import replay
    from workers.records.journal import JournalEntry

    # Given a journal whose last model response holds a call the provider garbled, not yet answered
    call = {"role": "model", "parts": [{"functionCall": {"id": "c1", "name": "count", "args": {}}}]}
    entries = [JournalEntry(seq=0, step=0, kind="model", content=call, invalid_calls={"c1": "bad arguments"})]
    # When it is replayed
    state = replay(ForkSeed(initial_messages=[], task_prompt="go"), entries)
    # Then the pending call carries the provider's error, so the loop answers it without running it
    assert [(p.call.id, p.invalid) for p in state.pending] == [("c1", "bad arguments")]


# ── the worker's Redis connection pool ───────────────────────────────────────────────────────


@pytest.mark.slow
def test_every_fork_slot_gets_a_redis_connection_even_when_all_wait_on_a_frozen_redis(
    make_settings: Callable[..., Settings],
    fresh_redis: RedisServer,
    worker_process: Callable[..., WorkerProcess],
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given a worker of 120 slots (redis-py's default pool has 100 connections), its forks' records on one
    # Redis and its jobs on another (the broker), and a queued job for every slot
    slots = 120
    settings = make_settings(redis_url=fresh_redis.url, broker_url=make_settings().redis_url)
    broker = redis.Redis.from_url(settings.effective_broker_url)
    app = make_app(settings)
    env = {"FORKQ_REDIS_URL": fresh_redis.url, "FORKQ_BROKER_URL": settings.effective_broker_url}
    env |= {"FORKQ_PROVIDER": "scripted", "FORKQ_HEARTBEAT_FILE": str(tmp_path / "heartbeat")}
    env |= {"FORKQ_HEARTBEAT_S": "5"}  # a worker's Redis socket timeout follows it (5 s): above the pause below
    with ForkClient(settings, app=app) as client, contextlib.closing(broker), contextlib.closing(app):
        fork = {"description": "t", "prompt": "report", "subagent_type": "fork", "fork_turns": "1"}
        handles = [client.launch({**parent, "cwd": str(tmp_path)}, fork) for _ in range(slots)]
        jobs = broker.lrange(settings.queue, 0, -1)
        broker.delete(settings.queue)
        worker = worker_process(concurrency=slots, **env)
        warm = client.launch({**parent, "cwd": str(tmp_path)}, fork)
        assert warm.wait(timeout=60).status is Status.SUCCEEDED, worker.log()[-3000:]

        # When the records Redis freezes, and every slot takes a job and waits on it at once (for at most 3.5 s,
        # under the 5 s socket timeout: this is about connections, not timeouts)
        records_port = fresh_redis.port

        def holding() -> int:
            connections = psutil.Process(worker.process.pid).net_connections()
            return sum(1 for c in connections if c.raddr and c.raddr.port == records_port)

        fresh_redis.pause()
        try:
            broker.rpush(settings.queue, *jobs)
            held = _connections_once_they_stop_growing(holding, slots, within_s=3.5)
        finally:
            fresh_redis.resume()

        # Then every fork runs once Redis answers: none crashed for want of a connection
        def crashed() -> int:
            return worker.log().count("raised unexpected: network:MaxConnectionsError")

        ended = lambda: all(client.status(h.fork_id).status.terminal for h in handles)  # noqa: E731
        wait_until(lambda: crashed() > 0 or ended(), 120, "every fork to end")
        assert crashed() == 0, f"{crashed()} of {slots} runs crashed on MaxConnectionsError; {held} connections held"
        assert [client.status(h.fork_id).status for h in handles] == [Status.SUCCEEDED] * slots
        # and more slots held a connection at once than redis-py's default pool has (on a loaded machine not
        # every slot may have taken its job within the pause)
        assert held > REDIS_PY_DEFAULT_POOL, f"{held} connections held by {slots} waiting slots"


REDIS_PY_DEFAULT_POOL = 100


def _connections_once_they_stop_growing(holding: Callable[[], int], slots: int, *, within_s: float) -> int:
    """The connections held once every slot holds one, or they grew no more for 1 s, or `within_s` passed."""
    deadline = time.monotonic() + within_s
    held, grew = holding(), time.monotonic()
    while held < slots and time.monotonic() < deadline:
        time.sleep(0.1)  # the sampling interval of a measurement (connections held once they stop growing)
        now = holding()
        if now > held:
            held, grew = now, time.monotonic()
        elif held > REDIS_PY_DEFAULT_POOL and time.monotonic() - grew > 1.0:
            break
    return held


@pytest.mark.slow
def test_a_fork_whose_redis_connections_go_silent_reconnects_within_its_lease(
    redis_server: RedisServer, worker_process: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    # Given a worker reaching Redis through a proxy (its broker connection direct), with a 5 s lease renewed
    # every second, and a sweeper that reaches Redis all along (so no outage grace: a lapsed lease is revived
    # at its next pass); and a fork of twelve 0.5 s steps, each listing its directory
    proxy = FreezingProxy(cast(int, redis_server.port))
    script = tmp_path / "script.json"
    listing = {"functionCall": {"name": "list_directory", "args": {"path": "."}}}
    steps = [{"delay_s": 0.5, "content": {"role": "model", "parts": [listing]}} for _ in range(12)]
    script.write_text(json.dumps({"steps": steps}), encoding="utf-8")
    env = {"FORKQ_LEASE_TTL_S": "5", "FORKQ_HEARTBEAT_S": "1", "FORKQ_SWEEP_S": "0.5", "FORKQ_SCRIPT": str(script)}
    worker = worker_process(FORKQ_REDIS_URL=proxy.url, FORKQ_BROKER_URL=redis_server.url, **env)
    settings = Settings(redis_url=redis_server.url, namespace=TEST_NAMESPACE, queue=TEST_QUEUE)
    app = make_app(settings)
    sweeper = sweeper_process(forkq_environment(redis_server.url, **env), tmp_path / "sweeper.log")
    try:
        with sweeper, ForkClient(settings, app=app) as client:
            parent = {**json.loads(PARENT_PATH.read_text(encoding="utf-8")), "cwd": str(tmp_path)}
            handle = client.launch(parent, {"description": "t", "prompt": "go", "subagent_type": "fork"})
            wait_until(lambda: any(e.type == "step" for e in handle.events()), 30, "the fork's first step")

            # When every connection the worker has to Redis goes silent, and so does every new one for a
            # second (a partition; a primary lost, then a replica promoted), so its next renewal never returns
            assert proxy.freeze(for_s=1.0) > 0

            # Then its calls time out (after 2 s) and are retried on new connections before the lease is over
            # (a renewal lands at most 1 + 2 s after the last, well inside 5 s; with redis-py's own 5 s read
            # timeout it would land past the lease): the fork succeeds on its first attempt, never revived
            result = handle.wait(timeout=60)
            events = list(handle.events())
    finally:
        app.close()
        proxy.close()
    assert result.status is Status.SUCCEEDED, (result.error, worker.log())
    assert [e.data.attempt for e in events if e.type == "started"] == [1], worker.log()
    assert not [e for e in events if e.type == "revived"]
    assert sum(e.type == "tool" for e in events) == 12


def test_the_workers_redis_timeouts_follow_the_heartbeat_and_stay_above_its_blocking_commands(
    make_settings: Callable[..., Settings],
) -> None:
    # a silent Redis is noticed within a beat (at most 5 s), and never mistaken for one while the worker
    # waits on purpose: the nested-subagent wait's XREAD BLOCK, a launch's WAIT for replicas
    assert [redis_timeout_s(make_settings(heartbeat_s=hb, lease_ttl_s=60)) for hb in (0.1, 1, 3, 5, 30)] == [
        2.0,
        2.0,
        3.0,
        5.0,
        5.0,
    ]
    assert max(POLL_MS, WAIT_TIMEOUT_MS) < MIN_REDIS_TIMEOUT_S * 1000
    runtime = WorkerRuntime(make_settings(heartbeat_s=3, lease_ttl_s=60))
    connection = runtime.redis.connection_pool.connection_kwargs
    assert (connection["socket_timeout"], connection["socket_connect_timeout"]) == (3.0, 3.0)
    runtime.redis.close()


def test_each_reason_to_stop_has_its_outcome_and_an_unknown_one_leaves_the_fork_to_revival(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # When the loop stops for each of its reasons, and for one this worker does not know
    outcomes = {reason: stop_outcome(reason, fork_id="f-stop") for reason in STOP_REASONS}
    unknown = stop_outcome("evicted", fork_id="f-stop")

    # Then each has its own outcome; parking without `Parked` wrote nothing and, like the unknown one, ends
    # the run as a lost lease (logged), not with a bare ValueError
    assert outcomes == {
        "cancelled": Outcome.CANCELLED,
        "shutdown": Outcome.RELEASED,
        "lease_lost": Outcome.LEASE_LOST,
        "awaiting_approval": Outcome.LEASE_LOST,
        "budget_reached": Outcome.PAUSED,  # parked by the runner's `BudgetPark` before it asks
    }
    assert unknown is Outcome.LEASE_LOST
    assert "fork f-stop: the loop stopped for 'evicted'" in caplog.text

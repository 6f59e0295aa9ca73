"""The `run_fork` task on live workers: msgpack jobs, digest checks, duplicates and hostile messages."""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from celery import Celery
from celery.signals import task_postrun
from celery.worker import WorkController

from broker_config.celery import RUN_FORK_TASK
from broker_config.settings import Settings
from tests.conftest import REPO_ROOT
from tests.live import body, envelopes, event_types, job_body, push_raw, queue_drained, wait_until
from workers.app import make_app, runtime_of
from workers.base import codec
from workers.client import ForkClient, ForkHandle
from workers.errors import ForkTimeout
from workers.history.selection import build_fork_seed
from workers.history.snapshot import parse_parent_snapshot
from workers.records.events import StreamEvent, UnknownEvent, decode_event
from workers.records.fork import Status, split_seed
from workers.service.tasks import make_sweeper, previous_run_end

FORK = {"description": "write expiry tests", "prompt": "Write the expiry tests.", "subagent_type": "fork"}


class Pwned:
    """A pickle payload that creates a file when unpickled: proof that pickle was (not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    """This module looks at seeds carried inside the job: allow the example parent's seeds inline."""
    return make_settings(inline_seed_max_bytes=256 * 1024)


@pytest.fixture
def outcomes() -> Iterator[list[tuple[str, Any, str]]]:
    """(task id, return value, state) of every task the in-process workers finish during the test."""
    seen: list[tuple[str, Any, str]] = []
    lock = threading.Lock()

    def record(task_id: str, retval: Any = None, state: str = "", **_: Any) -> None:
        with lock:
            seen.append((task_id, retval, state))

    task_postrun.connect(record, weak=False)
    yield seen
    task_postrun.disconnect(record)


# ── the job message ───────────────────────────────────────────────────────────────────────────


def test_the_job_message_is_msgpack_carrying_fork_id_digest_seed_chunks_and_record(
    client: ForkClient, settings: Settings, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    # Given no worker runs, the job stays in the broker queue after launch
    handle = client.launch(parent, {**FORK, "fork_turns": "3"})

    [envelope] = envelopes(redis_client, settings.queue)
    assert envelope["content-type"] == "application/x-msgpack"
    assert envelope["headers"]["task"] == RUN_FORK_TASK
    args, kwargs, _embed = body(envelope)
    fork_id, digest, chunks, record = args
    assert (fork_id, digest, kwargs) == (handle.fork_id, handle.digest, {})
    assert codec.digest(record) == digest  # the stored record bytes, named by the job's digest
    seed = build_fork_seed(parse_parent_snapshot(parent).history, fork_turns="3", directive=FORK["prompt"])
    context, *seed_chunks = chunks  # inline: the parent's context chunk, then the seed's chunks
    assert seed_chunks == split_seed(seed.initial_messages)
    assert codec.decode(context)["system_instruction"] == parent["system_instruction"]
    assert all(type(chunk) is bytes for chunk in chunks)


def test_argsrepr_names_the_fork_its_description_and_parent_session_and_sizes_never_the_seed_bytes(
    client: ForkClient, settings: Settings, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    handle = client.launch(parent, {**FORK, "fork_turns": "all"})

    [envelope] = envelopes(redis_client, settings.queue)
    _, _, chunks, _record = body(envelope)[0]
    argsrepr = envelope["headers"]["argsrepr"]
    assert handle.fork_id in argsrepr
    assert f"description={FORK['description']!r}" in argsrepr
    assert f"parent={parent['session_id']!r}" in argsrepr
    assert handle.digest[:12] in argsrepr
    assert f"{len(chunks)} chunks" in argsrepr
    assert f"{sum(map(len, chunks)):,} bytes" in argsrepr
    assert len(argsrepr) < 300
    assert "parts" not in argsrepr and "\\x" not in argsrepr
    assert envelope["headers"]["kwargsrepr"] == "{}"


# ── inline and Redis-read seeds ──────────────────────────────────────────────────────────────


LONG = [
    {"role": r, "parts": [{"text": f"{r} {i} " + "words " * (i % 30)}]} for i in range(150) for r in ("user", "model")
]


@pytest.mark.parametrize(
    "case", [(256 * 1024, []), (0, []), (256 * 1024, LONG)], ids=["inline", "from-redis", "seed-index-from-redis"]
)
def test_a_fork_runs_with_its_seed_inline_or_read_from_redis(
    case: tuple[int, list[dict[str, Any]]],
    make_settings: Callable[..., Settings],
    start_live_worker: Callable[[Celery], WorkController],
    redis_client: redis.Redis,
    parent: dict[str, Any],
) -> None:
    # a long seed's record names its chunks through a seed index chunk: its job never carries them
    inline_max, prefix = case
    settings = make_settings(inline_seed_max_bytes=inline_max)
    app = make_app(settings)
    with ForkClient(settings, app=app) as client:
        handle = client.launch({**parent, "history": [*prefix, *parent["history"]]}, {**FORK, "fork_turns": "all"})
        [envelope] = envelopes(redis_client, settings.queue)
        chunks = body(envelope)[0][2]
        assert (chunks is None) == (inline_max == 0 or bool(prefix))

        start_live_worker(app)
        result = handle.wait(timeout=15)

        assert result.status is Status.SUCCEEDED, result.error
        messages = len(client.inspect(handle.fork_id)["initial_messages"])
        assert f"received {messages + 1} messages" in (result.output or "")
    app.close()


# ── digest checks ─────────────────────────────────────────────────────────────────────────────


def test_a_tampered_bootstrap_record_is_refused_and_the_fork_fails_naming_the_digest(
    client: ForkClient,
    app: Celery,
    start_live_worker: Callable[[Celery], WorkController],
    redis_client: redis.Redis,
    parent: dict[str, Any],
) -> None:
    # Given a launched fork whose stored record has one byte changed
    handle = client.launch(parent, {**FORK, "fork_turns": "3"})
    key = client.store.keys.bootstrap(handle.fork_id)
    stored = bytearray(redis_client.get(key) or b"")
    at = stored.index(b"Write the expiry tests.")
    stored[at] ^= 0x20
    redis_client.set(key, bytes(stored), keepttl=True)

    # When a worker takes the job
    start_live_worker(app)
    result = handle.wait(timeout=15)

    # Then the fork ends failed, the error names the digest, and the child loop never ran
    assert result.status is Status.FAILED
    assert "digest" in (result.error or "")
    assert handle.digest[:12] in (result.error or "")
    assert handle.status().status is Status.FAILED
    assert event_types(client, handle.fork_id) == ["queued", "started", "finished"]


def test_a_job_with_an_altered_digest_is_refused_and_leaves_the_fork_untouched(
    client: ForkClient,
    start_live_worker: Callable[[Celery], WorkController],
    parent: dict[str, Any],
    outcomes: list[tuple[str, Any, str]],
) -> None:
    # Given the fork's real job replaced by one whose digest was altered
    queue = client.settings.queue
    handle = client.launch(parent, {**FORK, "fork_turns": "3"})
    client.redis.delete(queue)
    forged = ("0" if handle.digest[0] != "0" else "1") + handle.digest[1:]
    task_id = push_raw(client.redis, queue, job_body(handle.fork_id, forged, None))

    start_live_worker(client.app)
    wait_until(lambda: any(tid == task_id for tid, _, _ in outcomes), what="the forged job to be handled")

    assert [(retval, state) for tid, retval, state in outcomes if tid == task_id] == [
        ("refused:RecordIntegrityError", "SUCCESS")
    ]
    state = handle.status()
    assert (state.status, state.attempt, state.owner) == (Status.QUEUED, 0, None)
    assert event_types(client, handle.fork_id) == ["queued"]
    assert client.result(handle.fork_id) is None


def test_a_tampered_seed_chunk_in_redis_fails_the_fork_naming_the_chunk(
    make_settings: Callable[..., Settings],
    start_live_worker: Callable[[Celery], WorkController],
    parent: dict[str, Any],
) -> None:
    # Given a fork whose seed is read from Redis, and one of its stored chunks changed
    settings = make_settings(inline_seed_max_bytes=0)
    app = make_app(settings)
    with ForkClient(settings, app=app) as client:
        handle = client.launch(parent, {**FORK, "fork_turns": "3"})
        record = client.store.get_record(handle.fork_id, handle.digest)
        chunk_key = client.store.keys.chunk(record.parent_session, record.seed_chunks[0].hex())
        client.redis.setrange(chunk_key, 8, b"~")

        # When a worker runs it
        start_live_worker(app)
        result = handle.wait(timeout=15)

    # Then the fork fails before any model call, saying which chunk does not match
    assert result.status is Status.FAILED
    assert "seed chunk" in (result.error or "") and "does not match its digest" in (result.error or "")
    assert result.usage.model_calls == 0
    app.close()


def test_a_job_whose_inline_seed_was_altered_cannot_fail_an_intact_fork(
    client: ForkClient,
    start_live_worker: Callable[[Celery], WorkController],
    parent: dict[str, Any],
    outcomes: list[tuple[str, Any, str]],
) -> None:
    # Given a fork with an intact record, whose job message was corrupted in the broker
    queue = client.settings.queue
    handle = client.launch(parent, {**FORK, "fork_turns": "3"})
    [envelope] = envelopes(client.redis, queue)
    fork_id, digest, chunks, record = body(envelope)[0]
    chunks[0] = chunks[0][:-1] + bytes([chunks[0][-1] ^ 1])
    client.redis.delete(queue)
    task_id = push_raw(client.redis, queue, job_body(fork_id, digest, chunks, record))

    # When a worker handles the corrupted job
    start_live_worker(client.app)
    wait_until(lambda: any(tid == task_id for tid, _, _ in outcomes), what="the corrupted job to be handled")

    # Then the fork was not failed by it: the worker refused the job (fork still queued) or used the stored seed
    assert handle.status().status in (Status.QUEUED, Status.SUCCEEDED), handle.status().error


# ── duplicates ────────────────────────────────────────────────────────────────────────────────


def test_a_duplicate_delivery_does_not_run_the_fork_twice(
    make_settings: Callable[..., Settings],
    start_live_worker: Callable[[Celery], WorkController],
    parent: dict[str, Any],
    tmp_path: Path,
    outcomes: list[tuple[str, Any, str]],
) -> None:
    # Given a scripted fork of two slow steps, and its job delivered three times
    script = tmp_path / "script.json"
    list_call = {"functionCall": {"id": "c1", "name": "list_directory", "args": {"path": "."}}}
    steps = [{"delay_s": 0.4, "content": {"role": "model", "parts": [list_call]}}]
    steps.append({"delay_s": 0.2, "content": {"role": "model", "parts": [{"text": "done"}]}})
    script.write_text(json.dumps({"steps": steps}))
    settings = make_settings(script=script)
    app = make_app(settings)
    with ForkClient(settings, app=app) as client:
        handle = client.launch({**parent, "cwd": str(tmp_path)}, {**FORK, "fork_turns": "1"})
        job = body(envelopes(client.redis, settings.queue)[0])[0]
        for _ in range(2):
            app.send_task(RUN_FORK_TASK, args=job, queue=settings.queue)

        # When a worker with free slots takes all three at once
        start_live_worker(app)
        result = handle.wait(timeout=15)
        wait_until(lambda: len(outcomes) == 3, what="three deliveries to be handled")

        # Then the fork ran once: one claim, each scripted step once
        assert result.status is Status.SUCCEEDED, result.error
        assert result.output == "done"
        events = list(client.events(handle.fork_id))
        assert event_types(client, handle.fork_id) == ["queued", "started", "step", "tool", "step", "finished"]
        assert [e.data.step for e in events if e.type == "step"] == [1, 2]
        assert handle.status().attempt == 1
        retvals = sorted(str(retval) for _, retval, _ in outcomes)
        assert retvals[-1] == "succeeded"
        assert all(r.startswith("duplicate:") for r in retvals[:-1])

        # And a delivery after the end is a no-op too
        app.send_task(RUN_FORK_TASK, args=job, queue=settings.queue)
        wait_until(lambda: len(outcomes) == 4, what="the late delivery to be handled")
        assert outcomes[-1][1] == "duplicate:succeeded"
        assert list(client.events(handle.fork_id)) == events
    app.close()


# ── hostile messages ──────────────────────────────────────────────────────────────────────────


def test_malformed_jobs_are_rejected_and_the_worker_runs_the_fork_afterwards(
    client: ForkClient,
    start_live_worker: Callable[[Celery], WorkController],
    parent: dict[str, Any],
    outcomes: list[tuple[str, Any, str]],
) -> None:
    # Given a fork whose real job is held back, and hostile jobs that name it in the queue
    redis_client, queue = client.redis, client.settings.queue
    handle = client.launch(parent, {**FORK, "fork_turns": "3"})
    [real_job] = redis_client.lrange(queue, 0, -1)
    redis_client.delete(queue)
    fid, digest = handle.fork_id, handle.digest
    hostile = [
        job_body(123, digest, None),  # fork id of the wrong type
        job_body(fid.encode(), digest, None),  # bytes, not str
        job_body(fid, 42, None),  # digest of the wrong type
        job_body(fid, digest, "not a list"),  # seed chunks of the wrong type
        job_body(fid, digest, [1, 2]),  # chunks that are not bytes
        job_body(fid, digest, None, "extra"),  # an extra positional argument
        job_body(fid, digest, None, evil=True),  # an unknown keyword
        job_body(),  # nothing
    ]
    task_ids = [push_raw(redis_client, queue, payload) for payload in hostile]

    # When a worker consumes them
    start_live_worker(client.app)
    wait_until(queue_drained(redis_client, queue), what="the hostile jobs to be consumed")
    wait_until(lambda: len(outcomes) >= len(task_ids), what="every hostile job to be handled")

    # Then each was rejected, the fork was never claimed, and the worker still runs it afterwards
    by_id = {tid: (retval, state) for tid, retval, state in outcomes}
    assert {tid: by_id.get(tid) for tid in task_ids} == dict.fromkeys(task_ids, ("rejected:malformed", "SUCCESS"))
    assert event_types(client, fid) == ["queued"]
    redis_client.lpush(queue, real_job)
    assert handle.wait(timeout=15).status is Status.SUCCEEDED


@pytest.mark.parametrize("fork_id", ["../{evil}", "f-1 2", "", "-f", "f" * 129, "f-\u00e9"])
def test_a_job_whose_fork_id_is_not_a_fork_id_is_dead_lettered_and_the_worker_runs_the_next_fork(
    fork_id: str,
    client: ForkClient,
    start_live_worker: Callable[[Celery], WorkController],
    parent: dict[str, Any],
    outcomes: list[tuple[str, Any, str]],
) -> None:
    # Given a job naming a fork id that does not match the id pattern, ahead of a real fork's job
    redis_client, queue = client.redis, client.settings.queue
    task_id = push_raw(redis_client, queue, job_body(fork_id, "0" * 64, None))
    handle = client.launch(parent, {**FORK, "fork_turns": "1"})

    # When a worker consumes both
    start_live_worker(client.app)
    result = handle.wait(timeout=15)

    # Then the bad job was rejected and dead-lettered with the reason, and the real fork ran
    wait_until(lambda: any(tid == task_id for tid, _, _ in outcomes), what="the bad job to be handled")
    assert [(retval, state) for tid, retval, state in outcomes if tid == task_id] == [("rejected:malformed", "SUCCESS")]
    [letter] = [json.loads(raw) for raw in redis_client.lrange(client.store.keys.dead_letters, 0, -1)]
    assert letter["task_id"] == task_id and "fork_id" in letter["reason"], letter
    assert result.status is Status.SUCCEEDED


HOSTILE = {
    # pickle would create the marker file when loaded: forkq's workers accept msgpack only
    "pickle": (lambda marker: pickle.dumps(Pwned(marker)), "application/x-python-serialize", RUN_FORK_TASK),
    "not-msgpack": (lambda marker: b"\xc1\xc1 not msgpack", "application/x-msgpack", RUN_FORK_TASK),
    "not-a-celery-body": (lambda marker: msgpack.packb("just a string"), "application/x-msgpack", RUN_FORK_TASK),
    "short-celery-body": (lambda marker: msgpack.packb([["f-1"], {}]), "application/x-msgpack", RUN_FORK_TASK),
    "unregistered-task": (lambda marker: job_body("f-1", "0" * 64, None), "application/x-msgpack", "forkq.nope"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_worker_process_survives_a_hostile_message_and_runs_the_next_fork(
    kind: str, client: ForkClient, worker_process: Callable[..., Any], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a running worker process, a hostile message in its queue, then a real fork's job
    redis_client, queue = client.redis, client.settings.queue
    worker = worker_process()
    make_payload, content_type, task = HOSTILE[kind]
    marker = tmp_path / "pickle-was-loaded"
    push_raw(redis_client, queue, make_payload(marker), content_type=content_type, task=task)
    handle: ForkHandle = client.launch(parent, {**FORK, "fork_turns": "1"})

    # When the worker consumes both
    try:
        result = handle.wait(timeout=10)
    except ForkTimeout:
        alive = "alive" if worker.process.poll() is None else f"exited with {worker.process.returncode}"
        pytest.fail(f"the fork never ran after a {kind} message; the worker process {alive}:\n{worker.log()[-3000:]}")

    # Then the hostile message ran nothing, the worker is alive, and the fork ran
    assert result.status is Status.SUCCEEDED, worker.log()
    assert worker.process.poll() is None, worker.log()
    assert not marker.exists()
    wait_until(queue_drained(redis_client, queue), what="the queue to drain")


# ── Flower: one final state for every ended delivery ─────────────────────────────────────────


def _events(*types: str, attempt: int) -> list[StreamEvent]:
    """Fork events newest first: the claim of `attempt`, then `types` (newest first), then the claim before."""
    claim = [_event("9-0", "started", attempt)]
    older = [_event(f"{8 - n}-0", t, attempt) for n, t in enumerate(types)]
    return [*claim, *older, _event("1-0", "started", attempt - 1)]


def _event(event_id: str, kind: str, attempt: int) -> StreamEvent:
    """An event of type `kind` as the stream holds it, with data of its type's shape."""
    data = {
        "started": {"owner": "w", "attempt": attempt, "epoch": attempt},
        "revived": {"attempt": attempt, "lost": 1},
        "step": {"step": 1, "tool_calls": []},
        "model_call": {"step": 1, "request_digest": "d"},
        "awaiting_approval": {"reason": "r", "calls": []},
        "finished": {"status": "succeeded"},
        "approved": {"call_id": "c", "name": "t", "reason": None},
        "denied": {"call_id": "c", "name": "t", "reason": None},
        "resumed": {},
    }.get(kind, {"reason": "r"})
    event = decode_event(event_id.encode(), {b"type": kind.encode(), b"data": json.dumps(data).encode()})
    assert not isinstance(event, UnknownEvent), event
    return event


@pytest.mark.parametrize(
    ("between", "event"),
    [
        (("revived", "step", "model_call"), "task-lost"),  # its worker was lost mid-step
        (("revived",), "task-lost"),  # lost before its first step
        (("approved", "denied", "awaiting_approval", "step"), "task-resumed"),  # parked, then decided
        (("resumed", "paused"), "task-resumed"),  # paused on a missing tool, then resumed
        (("released", "step"), None),  # its worker handed it over at shutdown: RELEASED already
        (("step",), None),  # nothing says how it ended: leave its row as it is
    ],
)
def test_the_run_before_a_claim_gets_lost_or_resumed_unless_it_ended_with_its_own_event(
    between: tuple[str, ...], event: str | None
) -> None:
    assert previous_run_end(_events(*between, attempt=2), 2) == event


def test_a_claim_whose_own_started_event_is_not_among_the_events_read_ends_no_run() -> None:
    assert previous_run_end(_events("revived", attempt=3)[1:], 3) is None


@pytest.fixture
def flower(settings: Settings, tmp_path: Path) -> Iterator[Callable[[str], dict[str, Any]]]:
    """A real Flower on the test broker (basic auth); yields a GET of its API, returning the parsed JSON."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKQ_", "FLOWER_"))}
    env |= {"FORKQ_REDIS_URL": settings.redis_url, "FORKQ_NAMESPACE": settings.namespace}
    env |= {"FORKQ_QUEUE": settings.queue, "FORKQ_PROVIDER": "scripted"}
    argv = [sys.executable, "-m", "celery", "-A", "workers.app", "flower", "--address=127.0.0.1", f"--port={port}"]
    with (tmp_path / "flower.log").open("wb") as log:
        process = subprocess.Popen(
            [*argv, "--basic-auth=ops:secret"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def get(path: str) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        request.add_header("Authorization", "Basic " + base64.b64encode(b"ops:secret").decode())
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                data: dict[str, Any] = json.loads(response.read())
                return data
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return {}

    try:
        yield get
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_flower_gives_a_lost_run_and_a_parked_run_a_final_state_once_their_fork_goes_on(
    client: ForkClient,
    worker_process: Callable[..., Any],
    flower: Callable[[str], dict[str, Any]],
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given Flower, and a worker whose forks run a shell command (approval needed outside yolo), then list
    script = tmp_path / "script.json"
    shell = {"functionCall": {"id": "sh", "name": "run_shell_command", "args": {"command": "true"}}}
    ls = {"functionCall": {"id": "ls", "name": "list_directory", "args": {"path": "."}}}
    steps = [{"delay_s": 0.3, "content": {"role": "model", "parts": [shell]}}]
    steps += [{"delay_s": 0.6, "content": {"role": "model", "parts": [ls]}} for _ in range(6)]
    script.write_text(json.dumps({"steps": steps}))
    env = {"FORKQ_PROVIDER": "scripted", "FORKQ_SCRIPT": str(script), "FORKQ_LEASE_TTL_S": "3"}
    env |= {"FORKQ_HEARTBEAT_S": "1", "FORKQ_HEARTBEAT_FILE": str(tmp_path / "heartbeat")}
    first = worker_process(**env)
    # Flower learns workers from their events: once it lists this one, it receives its task events too
    wait_until(lambda: any(flower("/api/workers?status=true").values()), 60, "Flower to see the worker")

    # When one fork (yolo) runs on it, another (default mode, park) parks on its shell command
    running = client.launch({**parent, "cwd": str(tmp_path), "approval_mode": "yolo"}, FORK)
    parked = client.launch({**parent, "cwd": str(tmp_path)}, FORK, approval_policy="park")
    rid, pid = running.fork_id, parked.fork_id
    wait_until(lambda: parked.status().status is Status.AWAITING_APPROVAL, 30, "the second fork to park")
    wait_until(lambda: flower(f"/api/task/info/{rid}.1").get("state") == "PROGRESS", 30, "the first run's progress")
    # (Flower receives the parked run's final event after the fork's state is written: wait for it to arrive)
    wait_until(
        lambda: flower(f"/api/task/info/{pid}.1").get("state") == "AWAITING_APPROVAL", 30, "the parked run's row"
    )
    # and the worker running the first fork is lost (SIGKILL), and a sweeper revives the fork
    first.process.kill()
    sweeper = make_sweeper(client.app, runtime_of(client.app))
    wait_until(lambda: sweeper.sweep_once().get("revive", 0) == 1, 30, "the lost fork to be revived")
    # and another worker takes it over, and a person approves the parked call
    worker_process(**env)
    [call] = parked.status().pending_approval
    client.approve(pid, call.call_id)

    # Then both forks succeed on their second run
    assert running.wait(timeout=60).status is Status.SUCCEEDED
    assert parked.wait(timeout=60).status is Status.SUCCEEDED
    assert (running.status().attempt, parked.status().attempt) == (2, 2)
    # and in Flower the lost run ended LOST and the parked run RESUMED, each naming the run that went on
    ended = {f"{rid}.1": "LOST", f"{rid}.2": "SUCCESS", f"{pid}.1": "RESUMED", f"{pid}.2": "SUCCESS"}

    def states() -> dict[str, Any]:
        return {task_id: flower(f"/api/task/info/{task_id}").get("state") for task_id in ended}

    wait_until(lambda: states() == ended, 30, lambda: f"Flower's final states {ended}; it shows {states()}")
    assert f"{rid}.2" in flower(f"/api/task/info/{rid}.1")["result"]
    assert f"{pid}.2" in flower(f"/api/task/info/{pid}.1")["result"]
    # and no row of the two forks is left in a running state
    tasks = flower("/api/tasks?limit=100")
    live = {tid for tid, info in tasks.items() if info.get("state") in ("STARTED", "RECEIVED", "PROGRESS")}
    assert not live & set(ended), tasks
    # and the first run's row names what the fork is: its description and parent session
    args = flower(f"/api/task/info/{rid}.1")["args"]
    assert FORK["description"] in args and parent["session_id"] in args, args
    # and so do the rows of the runs sent again (revived, approved), by its description
    for task_id in (f"{rid}.2", f"{pid}.2"):
        assert FORK["description"] in flower(f"/api/task/info/{task_id}")["args"], task_id


@pytest.mark.slow
def test_flower_gives_a_final_state_to_a_run_no_next_run_ends_a_fork_failed_lost_or_a_parked_fork_cancelled(
    client: ForkClient,
    worker_process: Callable[..., Any],
    flower: Callable[[str], dict[str, Any]],
    parent: dict[str, Any],
    tmp_path: Path,
) -> None:
    # Given Flower, and a worker whose forks run a shell command (approval needed outside yolo), then list
    script = tmp_path / "script.json"
    shell = {"functionCall": {"id": "sh", "name": "run_shell_command", "args": {"command": "true"}}}
    ls = {"functionCall": {"id": "ls", "name": "list_directory", "args": {"path": "."}}}
    steps = [{"delay_s": 0.3, "content": {"role": "model", "parts": [shell]}}]
    steps += [{"delay_s": 0.6, "content": {"role": "model", "parts": [ls]}} for _ in range(6)]
    script.write_text(json.dumps({"steps": steps}))
    env = {"FORKQ_PROVIDER": "scripted", "FORKQ_SCRIPT": str(script), "FORKQ_LEASE_TTL_S": "3"}
    env |= {"FORKQ_HEARTBEAT_S": "1", "FORKQ_HEARTBEAT_FILE": str(tmp_path / "heartbeat")}
    worker = worker_process(**env)
    wait_until(lambda: any(flower("/api/workers?status=true").values()), 60, "Flower to see the worker")
    # and one fork running on it (yolo), another parked on its shell command
    running = client.launch({**parent, "cwd": str(tmp_path), "approval_mode": "yolo"}, FORK)
    parked = client.launch({**parent, "cwd": str(tmp_path)}, FORK, approval_policy="park")
    rid, pid = running.fork_id, parked.fork_id
    wait_until(lambda: parked.status().status is Status.AWAITING_APPROVAL, 30, "the second fork to park")
    wait_until(lambda: flower(f"/api/task/info/{rid}.1").get("state") == "PROGRESS", 30, "the first run's progress")

    # When the parked fork is cancelled, and the running fork's worker is lost with its attempts used up
    assert client.cancel(pid) is Status.CANCELLED
    worker.process.kill()
    sweeper = make_sweeper(client.app, runtime_of(client.app))
    sweeper.max_attempts = 1
    wait_until(lambda: sweeper.sweep_once().get("failed", 0) == 1, 30, "the lost fork to fail")
    assert running.status().status is Status.FAILED

    # Then in Flower each fork's only run has a final state: LOST and CANCELLED, no row is left running
    ended = {f"{rid}.1": "LOST", f"{pid}.1": "CANCELLED"}

    def states() -> dict[str, Any]:
        return {task_id: flower(f"/api/task/info/{task_id}").get("state") for task_id in ended}

    wait_until(lambda: states() == ended, 30, lambda: f"Flower's final states {ended}; it shows {states()}")
    assert "worker_lost" in flower(f"/api/task/info/{rid}.1")["result"]

"""Helpers for tests against live workers: polling, kombu messages in Redis, Redis going away, a sweeper."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from conftest import REPO_ROOT, TEST_NAMESPACE, TEST_QUEUE

from broker_config.celery import RUN_FORK_TASK
from workers.client import ForkClient
from workers.redis_server import RedisServer


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def envelopes(redis_client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The kombu envelopes waiting in a queue (kombu's Redis transport keeps one JSON string per message)."""
    return [json.loads(raw) for raw in redis_client.lrange(queue, 0, -1)]


def body(envelope: dict[str, Any]) -> Any:
    """The Celery body (args, kwargs, embed) of a msgpack envelope."""
    assert envelope["properties"]["body_encoding"] == "base64"
    return msgpack.unpackb(base64.b64decode(envelope["body"]), raw=False)


def kombu_envelope(
    payload: bytes,
    *,
    queue: str,
    task_id: str,
    content_type: str = "application/x-msgpack",
    task: str = RUN_FORK_TASK,
) -> bytes:
    """A kombu Redis envelope around `payload`, as a hostile or buggy producer would build it."""
    envelope = {
        "body": base64.b64encode(payload).decode(),
        "content-encoding": "binary",
        "content-type": content_type,
        "headers": {"lang": "py", "task": task, "id": task_id, "root_id": task_id, "retries": 0},
        "properties": {
            "correlation_id": task_id,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return json.dumps(envelope).encode()


def push_raw(
    redis_client: redis.Redis,
    queue: str,
    payload: bytes,
    *,
    content_type: str = "application/x-msgpack",
    task: str = RUN_FORK_TASK,
) -> str:
    """Push a hand-made message into a kombu Redis queue, as a hostile or buggy producer would."""
    task_id = f"hostile-{uuid.uuid4().hex[:8]}"
    redis_client.lpush(
        queue, kombu_envelope(payload, queue=queue, task_id=task_id, content_type=content_type, task=task)
    )
    return task_id


def job_body(*args: Any, **kwargs: Any) -> bytes:
    """A Celery protocol-2 body in msgpack."""
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    return msgpack.packb([list(args), kwargs, embed], use_bin_type=True)


def queue_drained(redis_client: redis.Redis, queue: str) -> Callable[[], bool]:
    """True once the queue is empty and kombu holds no unacked message."""
    return lambda: redis_client.llen(queue) == 0 and redis_client.hlen("unacked") == 0


MILESTONES = ("queued", "started", "step", "tool", "finished")


def event_types(client: ForkClient, fork_id: str) -> list[str]:
    """The fork's lifecycle events in order (finer progress events such as `model_call` left out)."""
    return [event.type for event in client.events(fork_id) if event.type in MILESTONES]


def stop_redis(server: RedisServer) -> None:
    """Stop Redis as an upgrade or a moved pod does: SIGTERM (it writes its AOF and exits), files kept.

    `server.restart()` starts it again on the same port, from those files.
    """
    pid = server.pid
    assert pid is not None, "redis-server is not running"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while server.pid is not None:
        if time.monotonic() > deadline:
            pytest.fail("redis-server did not exit within 10 s of SIGTERM")
        time.sleep(0.01)


def forkq_environment(redis_url: str, **overrides: str) -> dict[str, str]:
    """The environment of a forkq process on the test namespace and queue (scripted provider), without
    the FORKQ_* variables of the shell that runs the tests."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}
    forkq = {"FORKQ_NAMESPACE": TEST_NAMESPACE, "FORKQ_QUEUE": TEST_QUEUE, "FORKQ_PROVIDER": "scripted"}
    return {**base, **forkq, "FORKQ_REDIS_URL": redis_url, **overrides}


@contextlib.contextmanager
def sweeper_process(env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`forkq sweep` in `env` for the duration of the block, its output in `log_path`."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "sweep"],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

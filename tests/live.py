"""Helpers for tests against live workers: polling, kombu messages in Redis, Redis going away or silent."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
import redis

from broker_config.celery import RUN_FORK_TASK
from tests.conftest import REPO_ROOT, TEST_NAMESPACE, TEST_QUEUE
from workers.client import ForkClient
from workers.demo.redis_server import RedisServer

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 15.0, what: str | Callable[[], str] = "condition") -> T:
    """Poll `predicate` until it returns something truthy, and return that; fail the test after `timeout` seconds.

    `what` names the condition in the failure, or is called then to describe what was seen (logs, states).
    """
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what if isinstance(what, str) else what()}")
        time.sleep(0.02)  # the poll interval of this wait on a condition, not a synchronization by itself
    return value


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
    wait_until(lambda: server.pid is None, 10, "redis-server to exit after SIGTERM")


class FreezingProxy:
    """A TCP proxy in front of Redis whose connections can be made to go silent.

    `freeze(for_s)` silences every connection open at that moment, and every one made in the next `for_s`
    seconds: they stop forwarding in both directions while their sockets stay open, as with a partition or
    a primary whose host died in a failover, so a command sent on one never gets a reply. Connections made
    afterwards are forwarded as usual (the new primary).
    """

    def __init__(self, port: int) -> None:
        self.upstream = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[threading.Event] = []  # one per connection: set when it is frozen
        self._frozen_until = 0.0  # monotonic: connections made before then are born frozen
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        """A redis:// URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def freeze(self, for_s: float) -> int:
        """Silence the open connections and those of the next `for_s` seconds; how many were open."""
        with self._lock:
            frozen, self._open = self._open, []
            self._frozen_until = time.monotonic() + for_s
        for flag in frozen:
            flag.set()
        return len(frozen)

    def close(self) -> None:
        """Stop accepting connections (open ones end with the test process)."""
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            frozen = threading.Event()
            with self._lock:
                if time.monotonic() < self._frozen_until:
                    frozen.set()
                else:
                    self._open.append(frozen)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink, frozen), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, frozen: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not frozen.is_set():  # frozen: what arrives is swallowed, nothing answers
                    sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


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

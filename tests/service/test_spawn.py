"""Nested subagents (workers/service/spawn.py) through a Redis outage: a caller waiting for its subagent rides it out.

The launch and the wait are covered at the loop and worker level in tests/loop/test_child.py and
tests/subagents/test_capabilities.py; here a real `forkq worker` and `forkq sweep` run against a private
redis-server that is stopped and started again while a caller waits.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker_config.settings import Settings
from tests.conftest import PARENT_PATH, TEST_NAMESPACE, TEST_QUEUE, WorkerProcess
from tests.live import forkq_environment, stop_redis, sweeper_process, wait_until
from workers.app import make_app
from workers.client import ForkClient
from workers.demo.redis_server import RedisServer
from workers.records.fork import Status

REGULAR = {"description": "delegate", "prompt": "Have a subagent count the calls.", "subagent_type": "general-purpose"}
NESTED = {"description": "count calls", "prompt": "Count the INCR calls.", "subagent_type": "general-purpose"}


def step(delay_s: float, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"delay_s": delay_s, "content": {"role": "model", "parts": list(parts)}}


@pytest.mark.slow
@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_a_caller_waiting_for_its_subagent_rides_out_a_redis_restart_without_losing_an_attempt(
    fresh_redis: RedisServer,
    worker_process: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    # Given a worker and a sweeper, and a regular subagent whose first step launches a nested one; every
    # subagent runs the same script, so the nested one (at the depth limit) is refused its own Agent call
    # and then spends 5 s in its next model call while its caller waits
    script = tmp_path / "script.json"
    agent = {"functionCall": {"id": "a1", "name": "Agent", "args": NESTED}}
    steps = [step(0.2, agent), step(5.0, {"text": "report: 1 INCR call"})]
    script.write_text(json.dumps({"steps": steps}), encoding="utf-8")
    env = {
        "FORKQ_REDIS_URL": fresh_redis.url,
        "FORKQ_SCRIPT": str(script),
        "FORKQ_MAX_SUBAGENT_DEPTH": "2",
        "FORKQ_LEASE_TTL_S": "6",
        "FORKQ_HEARTBEAT_S": "2",
        "FORKQ_SWEEP_S": "0.5",
    }
    worker = worker_process(concurrency=2, **env)
    settings = Settings(redis_url=fresh_redis.url, namespace=TEST_NAMESPACE, queue=TEST_QUEUE)
    app = make_app(settings)
    sweeper = sweeper_process(forkq_environment(fresh_redis.url, **env), tmp_path / "sweeper.log")
    with sweeper, ForkClient(settings, app=app) as client:
        parent = {**json.loads(PARENT_PATH.read_text(encoding="utf-8")), "approval_mode": "yolo"}
        caller = client.launch(parent, REGULAR)
        nested_id = f"{caller.fork_id}.0.0"

        def in_second_call() -> bool:
            return any(e.type == "model_call" and e.data.step == 2 for e in client.events(nested_id))

        wait_until(in_second_call, 30, "the subagent's second model call")

        # When Redis stops and starts again (1.5 s down) while the caller waits for its subagent
        stop_redis(fresh_redis)
        time.sleep(1.5)  # not a synchronization: the outage, a fault injected for this long
        fresh_redis.restart()

        # Then both end succeeded on their first attempt: the caller's wait retried its reads, nobody revived it
        result = caller.wait(timeout=60)
        nested = client.result(nested_id)
        events = {fid: list(client.events(fid)) for fid in (caller.fork_id, nested_id)}
    app.close()
    assert result.status is Status.SUCCEEDED, (result.error, worker.log())
    assert result.output == "report: 1 INCR call"
    assert nested is not None and nested.status is Status.SUCCEEDED
    for fid, fork_events in events.items():
        assert [e.data.attempt for e in fork_events if e.type == "started"] == [1], (fid, worker.log())
        assert not [e for e in fork_events if e.type == "revived"], fid
    assert worker.process.poll() is None

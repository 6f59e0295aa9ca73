"""The Celery configuration: msgpack only, late acks, one job per slot, events on; and Celery enforces it."""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import WorkController

from broker_config import celery as celery_module
from broker_config.celery import RUN_FORK_TASK, celery_config
from broker_config.settings import Settings
from tests.live import envelopes, wait_until
from workers.base.keys import Keys
from workers.broker.connection import DEAD_ITEMS_OPTION
from workers.client import ForkClient
from workers.records.fork import Status

FORK = {"description": "d", "prompt": "Check the config.", "subagent_type": "fork", "fork_turns": "1"}


def test_jobs_are_msgpack_only_and_pickle_is_never_accepted(settings: Settings) -> None:
    config = celery_config(settings)

    assert (config["task_serializer"], config["result_serializer"]) == ("msgpack", "msgpack")
    assert config["accept_content"] == ["msgpack"]
    assert config["result_accept_content"] == ["msgpack"]


def test_jobs_are_acked_late_requeued_on_worker_loss_and_taken_one_at_a_time(settings: Settings) -> None:
    config = celery_config(settings)

    assert config["task_acks_late"] is True
    assert config["task_reject_on_worker_lost"] is True
    assert config["worker_prefetch_multiplier"] == 1


def test_task_events_and_sent_events_are_on_for_flower(settings: Settings) -> None:
    config = celery_config(settings)

    assert config["worker_send_task_events"] is True
    assert config["task_send_sent_event"] is True


def test_results_stay_out_of_celery_and_jobs_go_to_the_configured_queue(make_settings: Callable[..., Any]) -> None:
    settings = make_settings(queue="forks-blue", visibility_timeout_s=120, worker_concurrency=9)
    config = celery_config(settings)

    assert config["result_backend"] is None
    assert config["task_ignore_result"] is True
    assert config["task_default_queue"] == "forks-blue"
    assert config["task_routes"][RUN_FORK_TASK] == {"queue": "forks-blue"}
    assert config["broker_url"] == settings.effective_broker_url
    assert config["broker_transport_options"]["visibility_timeout"] == 120
    assert (config["worker_pool"], config["worker_concurrency"]) == ("threads", 9)


def test_a_sentinel_broker_names_its_master_and_a_plain_one_does_not(make_settings: Callable[..., Any]) -> None:
    plain = celery_config(make_settings())["broker_transport_options"]
    sentinel = celery_config(
        make_settings(broker_url="sentinel://:pw@s1:26379/0;sentinel://:pw@s2:26379/0", sentinel_master="forkq-primary")
    )["broker_transport_options"]

    assert "master_name" not in plain
    assert sentinel == {"visibility_timeout": 3600, "master_name": "forkq-primary"}


def test_sentinel_nodes_with_their_own_password_get_it_in_sentinel_kwargs(make_settings: Callable[..., Any]) -> None:
    settings = make_settings(redis_url="sentinel://:redis-pw@s1:26379/0", sentinel_password="sentinel-pw")
    app = Celery("sentinel-config", set_as_current=False, config_source=celery_config(settings))

    connection = app.connection_for_write()

    # kombu picks its Sentinel transport, with the master's name and the nodes' password
    assert connection.transport_cls == "sentinel"
    assert connection.transport_options["master_name"] == "mymaster"
    assert connection.transport_options["sentinel_kwargs"] == {"password": "sentinel-pw"}
    assert connection.password == "redis-pw"
    app.close()


def test_every_knob_has_a_reason_beside_it() -> None:
    # a comment line opens each group of knobs: no knob without a reason above it
    source = inspect.getsource(celery_module.celery_config)
    body = source[source.index("return {") + len("return {") :].splitlines()
    unexplained = []
    explained = False
    for line in (raw.strip() for raw in body):
        if line.startswith("#"):
            explained = True
        elif re.match(r'^"\w+":', line):
            if not explained:
                unexplained.append(line.split(":")[0])
        elif not line:
            explained = False
    assert unexplained == []


def test_the_app_and_the_run_fork_task_carry_the_configuration(app: Celery, settings: Settings) -> None:
    task = app.tasks[RUN_FORK_TASK]

    expected = celery_config(settings)
    # make_app adds where the broker channels keep refused items (a key of workers/base/keys.py)
    expected["broker_transport_options"] |= {DEAD_ITEMS_OPTION: Keys(settings.namespace).dead_items}
    for name, value in expected.items():
        assert app.conf[name] == value, name
    assert (task.acks_late, task.reject_on_worker_lost, task.ignore_result) == (True, True, True)
    assert task.serializer == "msgpack"


# ── Celery enforces it ────────────────────────────────────────────────────────────────────────


def test_a_worker_refuses_a_pickle_job_even_for_a_real_fork(
    client: ForkClient, start_live_worker: Callable[[Celery], WorkController], parent: dict[str, Any]
) -> None:
    # Given a launched fork whose job was re-sent with pickle by a producer that ignores the config
    queue = client.settings.queue
    handle = client.launch(parent, FORK)
    client.redis.delete(queue)
    client.app.send_task(RUN_FORK_TASK, args=[handle.fork_id, handle.digest, None], queue=queue, serializer="pickle")
    [envelope] = envelopes(client.redis, queue)
    assert envelope["content-type"] == "application/x-python-serialize"

    # When a worker consumes it
    start_live_worker(client.app)
    wait_until(lambda: client.redis.llen(queue) == 0 and client.redis.hlen("unacked") == 0, what="the job to go")

    # Then the job was discarded unread: the fork never started
    state = handle.status()
    assert (state.status, state.attempt) == (Status.QUEUED, 0)


@pytest.fixture
def celery_events(app: Celery) -> Iterator[list[dict[str, Any]]]:
    """Task events as Flower receives them, captured from the broker while the test runs."""
    seen: list[dict[str, Any]] = []
    ready = threading.Event()

    class Receiver(app.events.Receiver):  # type: ignore[name-defined,misc]
        def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
            super().on_consume_ready(*args, **kwargs)
            ready.set()  # subscribed: no event sent from now on is missed

    with app.connection() as connection:
        receiver = Receiver(connection, handlers={"*": seen.append})
        thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False), daemon=True)
        thread.start()
        assert ready.wait(10), "the event receiver never subscribed"
        yield seen
        receiver.should_stop = True
        thread.join(5)


def test_flower_sees_the_fork_job_sent_received_and_succeeded_with_its_argsrepr(
    client: ForkClient,
    live_worker: WorkController,
    celery_events: list[dict[str, Any]],
    parent: dict[str, Any],
    redis_client: redis.Redis,
) -> None:
    handle = client.launch(parent, FORK)
    handle.wait(timeout=15)
    task_id = f"{handle.fork_id}.1"

    def types() -> list[str]:
        return [e["type"] for e in list(celery_events) if e.get("uuid") == task_id]

    wait_until(lambda: "task-succeeded" in types(), what="the task-succeeded event")
    assert {"task-sent", "task-received", "task-started", "task-succeeded"} <= set(types())
    received = next(e for e in celery_events if e["type"] == "task-received" and e["uuid"] == task_id)
    assert handle.fork_id in received["args"]
    assert "chunks" in received["args"] and "\\x" not in received["args"]

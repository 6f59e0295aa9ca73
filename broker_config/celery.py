"""The Celery configuration forkq runs with, derived from `Settings`; each knob with its reason."""

from __future__ import annotations

from typing import Any, Final

from broker_config.settings import Settings

RUN_FORK_TASK = "forkq.run_fork"
SWEEP_TASK = "forkq.sweep"
JOB_TASKS = (RUN_FORK_TASK, SWEEP_TASK)  # all a forkq queue carries (its channel refuses other items)
JOB_CONTENT_TYPE = "application/x-msgpack"  # the task serializer's content type; never compressed

# What a legal job body can hold (workers.base.codec.decode_message refuses more before it is all built):
# inline seed chunks (or the seed's chunk digests) of at most INLINE_JOB_MAX_BYTES, a record as large,
# msgpack framing of at most 5 bytes per element, and a handful of containers ([args, kwargs, embed])
INLINE_JOB_MAX_BYTES: Final = 4 * 1024 * 1024
JOB_ELEMENTS_MAX: Final = INLINE_JOB_MAX_BYTES // 32 + 64  # a 32-byte digest per chunk at most, and the rest
JOB_CONTAINERS_MAX: Final = 64
JOB_MAP_ENTRIES_MAX: Final = 64
JOB_STR_MAX_BYTES: Final = 64 * 1024  # fork ids and digests; chunk bytes are msgpack `bin`
JOB_BODY_MAX_BYTES: Final = 2 * INLINE_JOB_MAX_BYTES + 5 * JOB_ELEMENTS_MAX + 64 * 1024
# bytes of a refused item forkq's dead-letter record keeps (the broker's list: all); here, not in
# workers.broker.connection, so the store keeps dead letters without loading kombu or Celery
RAW_KEPT: Final = 64 * 1024


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings (lower-case names) for forkq's app."""
    return {
        # the broker: FORKQ_BROKER_URL, else forkq's own Redis (one server to run and back up)
        "broker_url": settings.effective_broker_url,
        # forkq keeps results, state and events in its own Redis records, never in a result backend
        "result_backend": None,
        "task_ignore_result": True,
        # msgpack only: job payloads are data, and pickle from a broker is remote code execution
        "task_serializer": "msgpack",
        "result_serializer": "msgpack",
        "accept_content": ["msgpack"],
        "result_accept_content": ["msgpack"],
        # acks_late: a worker that dies mid-fork must not lose the job
        "task_acks_late": True,
        # a pool child killed mid-fork requeues the job instead of failing it
        "task_reject_on_worker_lost": True,
        # a fork holds a slot for minutes: never reserve jobs another idle worker could start now
        "worker_prefetch_multiplier": 1,
        # Flower: task events from workers, and "sent" events from the parent's side
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        # a broker connection loss (a Redis restart) must not stop a running fork: its run holds the fork by
        # its lease, not by the message, and rides the outage out; a redelivered copy is a no-op meanwhile
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_connection_retry_on_startup": True,
        # all fork jobs go to one named queue, so operators can scale and autoscale on its length
        "task_default_queue": settings.queue,
        "task_routes": {RUN_FORK_TASK: {"queue": settings.queue}, SWEEP_TASK: {"queue": settings.queue}},
        # `celery beat` (or `forkq sweep`) revives forks whose lease expired; concurrent sweeps are safe
        "beat_schedule": {"forkq-sweep": {"task": SWEEP_TASK, "schedule": settings.sweep_s}},
        # redelivery of unacked jobs: forkq revives forks through its own leases, so this only
        # bounds how long a job of a vanished worker waits in the broker; Sentinel: the master to ask for
        "broker_transport_options": transport_options(settings),
        # threads: a fork waits on model HTTP calls almost all the time (docs/operations.md, "Sizing")
        "worker_pool": settings.worker_pool,
        "worker_concurrency": settings.worker_concurrency,
        # no Celery-level retries: a fork's failure is recorded in its state, not retried blindly
        "task_default_retry_delay": 0,
        # forkq logs through the host application's logging setup, never replaces it
        "worker_hijack_root_logger": False,
    }


def transport_options(settings: Settings) -> dict[str, Any]:
    """kombu's Redis transport options: the visibility timeout, and for sentinel:// brokers the master's name."""
    options: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout_s}
    if settings.broker_uses_sentinel:
        options["master_name"] = settings.sentinel_master
        if settings.sentinel_password is not None:
            # the URL's password is the Redis primary's; Sentinel nodes may require their own
            options["sentinel_kwargs"] = {"password": settings.sentinel_password.get_secret_value()}
    return options

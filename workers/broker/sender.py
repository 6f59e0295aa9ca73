"""The send-only Celery app a launcher needs (`send_task` by name), and forkq's bounded msgpack serializer.

A sender has no tasks, no worker steps and no runtime: it only publishes jobs and events, so a parent
process that launches forks never loads the worker side. `workers.app.make_app` builds the worker's app
on top of it, so both sides speak the same serializer, transport and configuration.
"""

from __future__ import annotations

from typing import Any, Final

from celery import Celery
from kombu import serialization

from broker_config.celery import (
    JOB_BODY_MAX_BYTES,
    JOB_CONTAINERS_MAX,
    JOB_CONTENT_TYPE,
    JOB_ELEMENTS_MAX,
    JOB_MAP_ENTRIES_MAX,
    JOB_STR_MAX_BYTES,
    celery_config,
)
from broker_config.settings import Settings
from workers.base.codec import MessageBounds, decode_message, encode_message
from workers.base.keys import Keys
from workers.broker.connection import DEAD_ITEMS_OPTION, ForkqAMQP

JOB_BOUNDS: Final = MessageBounds(
    containers=JOB_CONTAINERS_MAX,
    elements=JOB_ELEMENTS_MAX,
    map_entries=JOB_MAP_ENTRIES_MAX,
    bin_bytes=JOB_BODY_MAX_BYTES,
    str_bytes=JOB_STR_MAX_BYTES,
)


def decode_job_body(data: bytes) -> Any:
    """kombu's msgpack loader for forkq: a job body within JOB_BOUNDS, else kombu's DecodeError."""
    return decode_message(data, JOB_BOUNDS, what="job body")


def register_job_serializer() -> None:
    """Make kombu's `msgpack` serializer forkq's bounded one, for the channel's checks and Celery's pool threads.

    kombu's own loader builds whatever a body declares (a 12 MiB body of empty arrays grew a worker by
    892 MiB, several such bodies at once in pool threads); the registry is per process, as kombu's is.
    A sender registers it too, so the bytes it publishes are the ones forkq's loader reads.
    """
    # the stubs declare str for every serializer; kombu hands `binary` ones bytes
    serialization.register(
        "msgpack",
        encode_message,  # type: ignore[arg-type]
        decode_job_body,  # type: ignore[arg-type]
        content_type=JOB_CONTENT_TYPE,
        content_encoding="binary",
    )


def sender_app(settings: Settings) -> Celery:
    """A Celery app configured for forkq that sends jobs and events by task name; it registers no task."""
    register_job_serializer()
    # ForkqAMQP: connections whose Redis channels reuse one client (workers/broker/connection.py)
    app = Celery("forkq", set_as_current=False, amqp=ForkqAMQP)
    app.conf.update(celery_config(settings))
    # the channels keep refused queue items whole on the broker's Redis, under forkq's namespace
    options = {**app.conf.broker_transport_options, DEAD_ITEMS_OPTION: Keys(settings.namespace).dead_items}
    app.conf.broker_transport_options = options
    return app

"""A `run_fork` job and its `task-sent` event in kombu's Redis wire form, so a launch can write them itself.

`send_task` puts a job on a Redis broker as one LPUSH of a JSON envelope onto the queue's list, and its
`task-sent` event as one PUBLISH onto the events channel. A launcher whose broker is its store's Redis
(`FORKQ_BROKER_URL` unset) writes both inside its launch script instead (`workers.store.forks`), after
the record: one round trip for the whole launch, not three, and no kombu producer per job. The job is the
same job: these are the bytes kombu would have written (the same headers, properties and body, the same
queue and channel), which `tests/broker/test_envelope.py` checks against what `send_task` really writes; any
other broker (a separate Redis, Sentinel, a key prefix) keeps `send_task`.

Left out, as `send_task` would do them per job: Celery's `before_task_publish`/`after_task_publish`
signals (forkq connects none) and the producer's publish retries (the launch script's own round trip is
retried as a whole: the record write is idempotent, and a launch that failed enqueued nothing).
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from celery.utils.nodenames import anon_nodename
from celery.utils.time import utcoffset
from kombu.transport import redis as kombu_redis

from broker_config.celery import JOB_CONTENT_TYPE
from workers.base.codec import encode_message

if TYPE_CHECKING:
    import redis
    from celery import Celery
    from kombu import Connection

PERSISTENT: Final = 2  # kombu's delivery_mode for a persistent message (Celery's task_default_delivery_mode)
TRANSIENT: Final = 1  # an event's
SENT_EVENT: Final = "task-sent"
EMBED: Final = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """One job as the broker holds it: the queue's key and the item, and its `task-sent` event ('' when off)."""

    queue_key: str
    item: bytes
    event_channel: str
    event: bytes


@dataclass(frozen=True, slots=True)
class Route:
    """Where a queue's jobs and the app's task events go on the broker's Redis (learned from a kombu channel)."""

    queue_key: str
    event_channel: str  # '' when the app sends no task-sent events
    events_exchange: str


class JobEnvelopes:
    """Builds `run_fork` jobs (and their task-sent events) for one app and queue, as `send_task` would."""

    def __init__(self, app: Celery, queue: str, route: Route) -> None:
        self.app = app
        self.queue = queue
        self.route = route

    @classmethod
    def for_app(cls, app: Celery, queue: str, store: redis.Redis) -> JobEnvelopes | None:
        """Envelopes for `queue`, or None when the broker's wire form is not the plain Redis one written here, or
        the broker is not the server `store` talks to (host, port and database, or socket path, must match).

        Opens one broker channel to read how kombu names the queue's list and the events channel.
        """
        with app.connection_for_write() as conn:
            if not same_server(store, conn):
                return None
            channel: Any = conn.default_channel
            # a plain Redis channel only: Sentinel finds its server by itself, and other transports differ
            if not _plain_redis(channel):
                return None
            if getattr(channel, "global_keyprefix", ""):  # kombu prefixes its own keys: not ours to mimic
                return None
            events = app.conf.task_send_sent_event
            exchange = str(app.conf.event_exchange)
            topic = channel._get_publish_topic(exchange, SENT_EVENT.replace("-", ".")) if events else ""
            return cls(app, queue, Route(channel._q_for_pri(queue, 0), topic, exchange))

    def run_fork(self, name: str, task_id: str, args: list[Any], argsrepr: str) -> QueuedJob:
        """The job `send_task(name, args, queue=..., task_id=..., argsrepr=..., kwargsrepr="{}")` would send."""
        parent = self.app.current_worker_task  # a job sent from inside a task names it, as Celery's does
        parent_id = parent.request.id if parent else None
        root_id = (parent.request.root_id or parent.request.id) if parent else task_id
        headers: dict[str, Any] = {
            "lang": "py",
            "task": name,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": root_id,
            "parent_id": parent_id,
            "argsrepr": argsrepr,
            "kwargsrepr": "{}",
            "origin": anon_nodename(),
            "ignore_result": None,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        }
        properties = {
            "correlation_id": task_id,
            "reply_to": self.app.thread_oid,
            "argsrepr": argsrepr,  # send_task passes its extra options on as properties too
            "kwargsrepr": "{}",
            "delivery_mode": PERSISTENT,
            "delivery_info": {"exchange": "", "routing_key": self.queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        }
        envelope = {
            "body": base64.b64encode(encode_message([args, {}, EMBED])).decode("ascii"),
            "content-encoding": "binary",
            "content-type": JOB_CONTENT_TYPE,
            "headers": headers,
            "properties": properties,
        }
        item = json.dumps(envelope).encode()
        if not self.route.event_channel:
            return QueuedJob(self.route.queue_key, item, "", b"")
        fields: dict[str, Any] = {
            "uuid": task_id,
            "root_id": root_id,
            "parent_id": parent_id,
            "name": name,
            "args": argsrepr,
        }
        fields |= {"kwargs": "{}", "retries": 0, "eta": None, "expires": None, "queue": self.queue}
        fields |= {"exchange": "", "routing_key": self.queue}
        return QueuedJob(self.route.queue_key, item, self.route.event_channel, self._event(fields))

    def _event(self, fields: dict[str, Any]) -> bytes:
        """The task-sent event as Celery's event dispatcher publishes it (JSON body, base64 in the envelope)."""
        hostname = anon_nodename()
        clock: Any = self.app.clock  # type: ignore[attr-defined]  # the app's Lamport clock (untyped in the stubs)
        event: dict[str, Any] = {"hostname": hostname, "utcoffset": utcoffset(), "pid": os.getpid()}
        event |= {"clock": clock.forward()}
        event |= fields
        event |= {"timestamp": time.time(), "type": SENT_EVENT}
        envelope = {
            "body": base64.b64encode(json.dumps(event).encode()).decode("ascii"),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"hostname": hostname},
            "properties": {
                "delivery_mode": TRANSIENT,
                "delivery_info": {"exchange": self.route.events_exchange, "routing_key": "task.sent"},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        return json.dumps(envelope).encode()


def _plain_redis(channel: object) -> bool:
    return isinstance(channel, kombu_redis.Channel) and not isinstance(channel, kombu_redis.SentinelChannel)


def same_server(store: redis.Redis, conn: Connection) -> bool:
    """Whether the store's client and the broker connection name one Redis server and database."""
    ours = store.connection_pool.connection_kwargs
    db = int(conn.virtual_host or 0) if str(conn.virtual_host or "0").isdigit() else -1
    if int(ours.get("db", 0) or 0) != db:
        return False
    if "path" in ours:  # a Unix socket
        return bool(conn.hostname) and ours["path"] == conn.hostname
    return (ours.get("host"), int(ours.get("port", 6379))) == (conn.hostname, int(conn.port or 6379))

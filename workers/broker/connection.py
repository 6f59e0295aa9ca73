"""forkq's broker connection: kombu's Redis transports, with one synchronous Redis client per channel.

kombu's Redis channel builds a new `redis.Redis` for every publish, ack and requeue
(`Channel.conn_or_acquire` → `_create_client`), and building one copies redis-py's ~170 response
callbacks into a case-insensitive dict. Profiled on a worker (py-spy, GIL samples), that construction
is 13% of a forkq worker's CPU per fork and 26% of a bare Celery worker's per no-op task
(docs/performance.md). A `redis.Redis` is thread-safe (each command takes a connection from the
pool and gives it back), so one client per pool serves every publish of a channel; a channel whose
pool was replaced (a reconnect) builds a new one.

Only forkq's app uses this (`Celery(amqp=ForkqAMQP)`; nothing in kombu is patched): its connections,
their copies and its producer pool's connections resolve the transport as kombu does and then use
forkq's subclass of it. URL parsing (`redis`, `rediss`, `redis+socket`, `sentinel`), TLS options and
failover are kombu's own; `as_uri()` and `info()` name the scheme (Flower's broker page, the banner).

What reaches a queue is checked before kombu and Celery see it. kombu json-loads each popped item
and builds its message outside Celery's decode-error handling, so an item that is not a kombu
envelope (`LPUSH forks 'not json'`, `[1,2,3]`, an object without `properties`, ...) used to stop the
worker ("Unrecoverable error", exit 0). Now the channel reads each BRPOP reply first: an item that is
too large, not JSON, or not an envelope kombu and Celery can take (field types, content type, task
name on a job queue, any `compression` header: forkq never compresses jobs, so nothing is inflated)
is handed to the transport's `on_rejected` (the worker's consumer step writes forkq's dead letters)
and never delivered; anything Celery still raises while taking a delivered item is caught the same
way, and the item is acknowledged. An entry of kombu's `unacked` hash it cannot restore is removed
and handed to `on_rejected` too. The worker goes on serving.
"""

from __future__ import annotations

import binascii
import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, cast

import kombu
import redis
from celery.app.amqp import AMQP
from kombu import serialization
from kombu.connection import ConnectionPool, PooledConnection
from kombu.exceptions import DecodeError
from kombu.transport import redis as kombu_redis
from kombu.utils import json as kombu_json
from kombu.utils.collections import HashedSeq
from kombu.utils.encoding import bytes_to_str

from broker_config.celery import JOB_BODY_MAX_BYTES, JOB_CONTENT_TYPE, JOB_TASKS, RAW_KEPT

log = logging.getLogger("forkq.broker")

# the largest legal job body (broker_config.celery.JOB_BODY_MAX_BYTES, about 8.7 MiB: 4 MiB of inline chunks,
# a 4 MiB record, framing) in base64, plus 64 KiB for the envelope's headers and properties: about 11.7 MiB.
# A larger item is refused before it is parsed.
MAX_ENVELOPE_BYTES: Final = 4 * -(-JOB_BODY_MAX_BYTES // 3) + 64 * 1024
# `[` and `{` an item may hold before it is parsed: a legal envelope has about ten objects, and Flower's
# argsrepr a few brackets; a body is base64 (no brackets). 16 MiB of `{}`s grew a worker by 355 MiB.
MAX_ENVELOPE_BRACKETS: Final = 4096
ENVELOPE_KEYS: Final = frozenset({"body", "content-encoding", "content-type", "headers", "properties"})
HELD_MAX: Final = 16  # refused items a transport keeps until it has a sink (a worker's first restore comes first)
# the transport option naming the broker's list of refused items, whole (workers.base.keys `{ns}:dead:items`)
DEAD_ITEMS_OPTION: Final = "forkq_dead_items"
DEAD_ITEMS_MAX: Final = 16  # items that list keeps, newest first: at most 16 envelope limits (~186 MiB)
DEAD_ITEMS_TTL_S: Final = 7 * 24 * 3600  # and it expires a week after the last refusal
_MAX_TAG: Final = 256


@dataclass(frozen=True, slots=True)
class Rejected:
    """A queue item the worker refused to deliver: its queue, why, its bytes, size and digest, its task id."""

    queue: str
    reason: str
    raw: bytes  # all of it, up to MAX_ENVELOPE_BYTES (an item refused as larger keeps that much)
    size: int
    digest: str  # BLAKE2b-256 of all of it
    task_id: str | None = None

    @classmethod
    def of(cls, queue: str, raw: bytes, reason: str, task_id: str | None = None) -> Rejected:
        """The refusal of `raw`, keeping at most MAX_ENVELOPE_BYTES of it."""
        digest = hashlib.blake2b(raw, digest_size=32).hexdigest()
        return cls(queue, reason, bytes(raw[:MAX_ENVELOPE_BYTES]), len(raw), digest, task_id)

    @property
    def truncated(self) -> bool:
        """Whether `raw` is only the first bytes of the item."""
        return self.size > len(self.raw)


RejectSink = Callable[[Rejected], None]


def read_item(item: bytes, *, job: bool) -> tuple[Any, str | None]:
    """A popped queue item's envelope and, if it cannot be delivered, why (`job`: the item is on a job queue)."""
    if len(item) > MAX_ENVELOPE_BYTES:
        return None, f"it is {len(item):,} bytes, more than the {MAX_ENVELOPE_BYTES:,} any forkq job needs"
    brackets = item.count(b"[") + item.count(b"{")
    if brackets > MAX_ENVELOPE_BRACKETS:
        return None, (
            f"it holds {brackets:,} `[` and `{{`, more than the {MAX_ENVELOPE_BRACKETS:,} a kombu envelope has; "
            "not parsed"
        )
    try:
        envelope = kombu_json.loads(item)  # kombu's own loads: its type markers fail here, not in kombu
    except (ValueError, TypeError, RecursionError) as exc:
        return None, f"it is not JSON ({type(exc).__name__}: {str(exc)[:200]}); a kombu envelope is a JSON object"
    return envelope, envelope_problem(envelope, job=job)


def envelope_problem(envelope: Any, *, job: bool) -> str | None:
    """Why kombu or Celery could not take this decoded envelope (None when they can); `job`: on a job queue."""
    problem = _shape_problem(envelope) or _properties_problem(envelope.get("properties"))
    if problem is not None:
        return problem
    headers = envelope.get("headers")
    fields = {"body": envelope.get("body"), "content-type": envelope.get("content-type")}
    fields["content-encoding"] = envelope.get("content-encoding")
    bad = next((name for name, value in fields.items() if not isinstance(value, str | None)), None)
    if bad is not None:
        return f"`{bad}` is {_kind(fields[bad])}; expected a string"
    if not isinstance(headers, dict | None):
        return f"`headers` is {_kind(headers)}; expected an object"
    compression = (headers or {}).get("compression")
    if compression:
        return (
            f"its body is compressed (headers.compression {str(compression)[:100]!r}): forkq never compresses "
            "jobs and inflates nothing from the queue (a small compressed body can inflate to gigabytes)"
        )
    return _job_problem(envelope, headers or {}) if job else None


def _shape_problem(envelope: Any) -> str | None:
    if not isinstance(envelope, dict):
        return f"it is {_kind(envelope)}, not a JSON object: not a kombu envelope"
    unknown = sorted(set(envelope) - ENVELOPE_KEYS)
    if unknown:
        return f"it has the keys {_kind(unknown)}; a kombu envelope has only {', '.join(sorted(ENVELOPE_KEYS))}"
    return None


def _properties_problem(properties: Any) -> str | None:
    if not isinstance(properties, dict):
        return f"`properties` is {_kind(properties)}; expected an object with delivery_tag and delivery_info"
    tag = properties.get("delivery_tag")
    if not isinstance(tag, str) or not 0 < len(tag) <= _MAX_TAG:
        return f"`properties.delivery_tag` is {_kind(tag)}; expected a string of 1-{_MAX_TAG} characters"
    info = properties.get("delivery_info")
    if not (
        isinstance(info, dict) and isinstance(info.get("exchange"), str) and isinstance(info.get("routing_key"), str)
    ):
        return "`properties.delivery_info` must be an object with the strings `exchange` and `routing_key`"
    encoding = properties.get("body_encoding")
    if encoding is not None and (not isinstance(encoding, str) or encoding.lower() not in ("base64", "utf-8")):
        return f"`properties.body_encoding` is {_kind(encoding)}; expected 'base64' (or 'utf-8')"
    return None


def _job_problem(envelope: dict[str, Any], headers: dict[str, Any]) -> str | None:
    content_type = envelope.get("content-type")
    if content_type != JOB_CONTENT_TYPE:
        return (
            f"content-type {str(content_type)[:100]!r} is not accepted: forkq jobs are {JOB_CONTENT_TYPE}; "
            "pickle and other serializers are never loaded"
        )
    task = headers.get("task")
    if not isinstance(task, str) or task not in JOB_TASKS:
        return f"headers.task is {_kind(task)}; a forkq queue carries {' and '.join(JOB_TASKS)} only"
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not 0 < len(task_id) <= _MAX_TAG:
        return f"headers.id is {_kind(task_id)}; expected the task id, a string of 1-{_MAX_TAG} characters"
    return _body_problem(envelope)


def _body_problem(envelope: dict[str, Any]) -> str | None:
    """Why the job's body is not one Celery could decode: forkq's registered msgpack loader, with its bounds."""
    body = envelope.get("body") or ""
    try:
        if str(envelope["properties"].get("body_encoding") or "").lower() == "base64":
            data = binascii.a2b_base64(body)
        else:
            data = body.encode()
        serialization.loads(data, JOB_CONTENT_TYPE, "binary", accept={JOB_CONTENT_TYPE})
    except (binascii.Error, ValueError, DecodeError) as exc:
        return f"its body is not a forkq job: {str(exc)[:500]}"
    return None


def _kind(value: Any) -> str:
    """A short description of an outsider's value for a message: its type, and the value when short."""
    if value is None:
        return "missing"
    text = repr(value)
    return (
        f"{type(value).__name__} {text}" if len(text) <= 60 else f"a {type(value).__name__} of {len(text):,} characters"
    )


def _task_id(envelope: Any) -> str | None:
    headers = envelope.get("headers") if isinstance(envelope, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id[:_MAX_TAG] if isinstance(task_id, str) else None


class _OneClientPerPool:
    """Channel mixin: `_create_client()` returns one client per connection pool, not a new one per call."""

    _forkq_client: redis.Redis | None = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the consumer's BRPOP client: kombu builds it once per channel already
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        if self._pool is None and self.connection.client is None:  # type: ignore[attr-defined]
            # Celery detaches the transport when the broker connection is lost, then closes the channel,
            # whose restore of unacked messages lands here: kombu's AttributeError would stop the worker
            # ("Unrecoverable error"), a connection error is one Celery expects and reconnects after
            raise redis.ConnectionError("the broker connection was lost and closed; Celery reconnects")
        pool = self.pool  # type: ignore[attr-defined]
        client = self._forkq_client
        if client is None or client.connection_pool is not pool:
            client = super()._create_client()  # type: ignore[misc]
            self._forkq_client = client  # two threads racing here build two clients; either serves
        return client


class _CheckedQoS(kombu_redis.QoS):
    """kombu's Redis QoS, dropping (and reporting) an unacked entry it cannot restore instead of raising.

    The `unacked` hash is kombu's own bookkeeping, but it is as writable as the queues: an entry that
    is not kombu's `[envelope, exchange, routing_key]` JSON made every start of a worker end in
    "Unrecoverable error" once its visibility timeout passed.
    """

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        """kombu's restore of one unacked entry; one it cannot read is removed and handed to `on_rejected`."""
        channel: Any = self.channel  # forkq's channel (the stubs know kombu's base class only)
        try:
            super().restore_by_tag(tag, client, leftmost)
        except channel.connection_errors:
            raise
        except Exception as exc:  # kombu's JSON, or the entry's shape: never kombu's own entries
            with channel.conn_or_acquire(client) as conn:
                raw = conn.hget(self.unacked_key, tag) or b""
                self._remove_from_indices(tag, conn.pipeline()).execute()  # type: ignore[attr-defined]
            reason = f"an entry of {self.unacked_key!r} kombu cannot restore ({type(exc).__name__}: {str(exc)[:200]})"
            channel._reject(Rejected.of(self.unacked_key, raw, reason))


class _Guarded:
    """Transport mixin: where its channels send the items they refuse, and which queues carry forkq jobs."""

    on_rejected: RejectSink | None = None
    job_queues: frozenset[str] = frozenset()
    _held: tuple[Rejected, ...] = ()  # refused before there was a sink

    def guard(self, on_rejected: RejectSink, job_queues: Iterable[str]) -> None:
        """Send refused items to `on_rejected`, those held so far first; items on `job_queues` must be forkq jobs."""
        self.on_rejected = on_rejected
        self.job_queues = frozenset(job_queues)
        held, self._held = self._held, ()
        for item in held:
            self.reject(item)

    def reject(self, item: Rejected) -> None:
        """Hand a refused item to the sink; without one yet, hold it (the first HELD_MAX) and log it."""
        sink = self.on_rejected
        if sink is None:
            if len(self._held) < HELD_MAX:  # the broker's list has all of it: hold the first bytes only
                self._held = (*self._held, dataclasses.replace(item, raw=item.raw[:RAW_KEPT]))
            log.error(
                "queue item on %r not dead-lettered yet (no sink); its first bytes: %r", item.queue, item.raw[:512]
            )
            return
        try:
            sink(item)
        except Exception as exc:
            log.error("queue item on %r not dead-lettered (%s); its first bytes: %r", item.queue, exc, item.raw[:512])


class _GuardsDeliveries:
    """Channel mixin: each item is checked before kombu parses it and Celery takes it; a bad one goes to
    the transport's `on_rejected` and is never raised into the worker's event loop."""

    _popped: tuple[str, bytes] | None = None  # the bytes of the item being delivered, for its dead letter

    @property
    def job_queues(self) -> frozenset[str]:
        """The queues whose items must be forkq jobs (the transport's)."""
        queues: frozenset[str] = getattr(self.connection, "job_queues", frozenset())  # type: ignore[attr-defined]
        return queues

    def _create_client(self, asynchronous: bool = False) -> Any:
        client = super()._create_client(asynchronous=asynchronous)  # type: ignore[misc]
        if asynchronous:  # the client kombu reads BRPOP replies with: check each item as it is read
            parse = client.parse_response

            def checked(connection: Any, command_name: str, **options: Any) -> Any:
                reply = parse(connection, command_name, **options)
                return self._checked_pop(reply) if command_name == "BRPOP" and reply else reply

            client.parse_response = checked  # this channel's own client; kombu and redis-py are not patched
        return client

    def _checked_pop(self, reply: Any) -> Any:
        dest, item = reply
        queue = bytes_to_str(dest).rsplit(self.sep, 1)[0]  # type: ignore[attr-defined]  # priority suffix
        envelope, problem = read_item(item, job=queue in self.job_queues)
        if problem is None:
            self._popped = (queue, item)
            return reply
        self._reject(Rejected.of(queue, item, problem, _task_id(envelope)))
        return None  # kombu reads "nothing popped" and polls again

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        """kombu's `basic_consume`, with every delivery to `queue` checked and guarded."""
        result = super().basic_consume(queue, *args, **kwargs)  # type: ignore[misc]
        callbacks = self.connection._callbacks  # type: ignore[attr-defined]
        callbacks[queue] = functools.partial(self._deliver_checked, queue, callbacks[queue])
        return result

    def _deliver_checked(self, queue: str, deliver: Callable[[Any], Any], envelope: Any) -> Any:
        popped, self._popped = self._popped, None
        raw = popped[1] if popped is not None and popped[0] == queue else None
        problem = envelope_problem(envelope, job=queue in self.job_queues)  # fanout items were not checked yet
        if problem is None:
            try:
                return deliver(envelope)
            except self.connection_errors:  # type: ignore[attr-defined]  # kombu and Celery reconnect
                raise
            except Exception as exc:  # Celery could not take it: never let it stop the worker
                log.exception("queue item on %r: the worker could not take it", queue)
                self._ack_taken(envelope)
                problem = f"the worker could not take it: {type(exc).__name__}: {str(exc)[:500]}"
        self._reject(Rejected.of(queue, raw or kombu_json.dumps(envelope).encode(), problem, _task_id(envelope)))
        return None

    def _ack_taken(self, envelope: dict[str, Any]) -> None:
        """Acknowledge an item kombu recorded as delivered (else it would come back after the visibility timeout)."""
        tag = envelope["properties"]["delivery_tag"]
        try:
            if tag in self.qos._delivered:  # type: ignore[attr-defined]
                self.basic_ack(tag)  # type: ignore[attr-defined]
        except Exception:
            log.exception("queue item %r could not be acknowledged", tag)

    def _reject(self, item: Rejected) -> None:
        log.error("queue item on %r refused (%s bytes, not delivered): %s", item.queue, f"{item.size:,}", item.reason)
        self._keep_whole(item)
        transport = self.connection  # type: ignore[attr-defined]
        if isinstance(transport, _Guarded):
            transport.reject(item)
        else:
            log.error("queue item on %r: not dead-lettered; its first bytes: %r", item.queue, item.raw[:512])

    def _keep_whole(self, item: Rejected) -> None:
        """LPUSH the whole item onto the broker's dead-item list: the Redis it was popped from, so it is kept
        even when forkq's records Redis is down (that record, `on_rejected`, is written after, best-effort)."""
        options = self.connection.client.transport_options  # type: ignore[attr-defined]
        key = options.get(DEAD_ITEMS_OPTION)
        if not key:
            return
        meta: dict[str, Any] = {
            "queue": item.queue,
            "reason": item.reason[:2000],
            "task_id": item.task_id,
            "raw_bytes": item.size,
        }
        meta |= {"raw_blake2b": item.digest, "raw_truncated": item.truncated, "at": time.time()}
        try:
            pipe = self.client.pipeline(transaction=False)  # type: ignore[attr-defined]
            pipe.lpush(key, json.dumps(meta).encode() + b"\n" + item.raw)
            pipe.ltrim(key, 0, DEAD_ITEMS_MAX - 1)
            pipe.expire(key, DEAD_ITEMS_TTL_S)
            pipe.execute()
        except Exception as exc:  # the broker itself failing: kombu reconnects; the record may still be written
            log.error("queue item on %r not kept on the broker (%s: %s)", item.queue, type(exc).__name__, exc)


class RedisChannel(_GuardsDeliveries, _OneClientPerPool, kombu_redis.Channel):
    """kombu's Redis channel, reusing its synchronous client and checking what it delivers."""

    QoS = _CheckedQoS


class SentinelChannel(_GuardsDeliveries, _OneClientPerPool, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel, reusing its synchronous client and checking what it delivers."""

    QoS = _CheckedQoS


class RedisTransport(_Guarded, kombu_redis.Transport):
    """kombu's Redis transport with `RedisChannel`."""

    Channel = RedisChannel


class SentinelTransport(_Guarded, kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with `SentinelChannel`."""

    Channel = SentinelChannel


TRANSPORTS: dict[type[Any], type[Any]] = {
    kombu_redis.Transport: RedisTransport,
    kombu_redis.SentinelTransport: SentinelTransport,
}


class _SwapsTransport:
    """Connection mixin: resolve the transport as kombu does, then use forkq's subclass of it.

    The transport is swapped after kombu has read the URL (so `rediss://` gets its TLS defaults and
    `redis+socket://` its socket) and it is stored as the class, so the connections copied from this
    one (`clone`, the producer pool's) use it too. `info()` and `as_uri()` name the scheme, not the
    class: `rediss` when TLS is on, else `redis`, or `sentinel`; what Flower and the worker banner read.
    """

    ssl: Any

    # kombu calls it from __init__ and switch(), always with keywords (the stubs spell out each one)
    def _init_params(self, **params: Any) -> None:
        super()._init_params(**params)  # type: ignore[misc]
        swapped = TRANSPORTS.get(self.get_transport_cls())  # type: ignore[attr-defined]
        if swapped is not None:
            self.transport_cls = swapped

    # kombu's `_info` returns (key, value) pairs, not the dict its stubs declare
    def _info(self, resolve: bool = True) -> Any:
        info: tuple[tuple[str, Any], ...] = super()._info(resolve)  # type: ignore[misc]
        if not resolve:  # `clone` and pools: keep the class
            return info
        return tuple((key, self._scheme(value) if key == "transport" else value) for key, value in info)

    def __eqhash__(self) -> Any:
        # kombu keys its process-wide connection pools by this; with the transport stored as a class,
        # `redis://` and `rediss://` to one host would share a pool: tell them apart by the TLS options
        return HashedSeq(super().__eqhash__(), repr(self.ssl))  # type: ignore[misc]

    def _scheme(self, transport: Any) -> Any:
        if transport is RedisTransport:
            return "rediss" if self.ssl else "redis"
        if transport is SentinelTransport:
            return "sentinel"
        return transport


class ForkqConnection(_SwapsTransport, kombu.Connection):  # type: ignore[misc]
    """A kombu connection with forkq's Redis transports; its pool's connections have them too."""

    def Pool(self, limit: int | None = None, **kwargs: Any) -> ConnectionPool:  # noqa: N802  # kombu's name
        """kombu's pool of connections, whose connections are `_PooledConnection`s."""
        return _ConnectionPool(self, limit=limit, **kwargs)


class _PooledConnection(_SwapsTransport, PooledConnection):
    """kombu's pooled connection with forkq's Redis transports."""


class _ConnectionPool(ConnectionPool):
    """kombu's connection pool, building `_PooledConnection`s."""

    def new(self) -> kombu.Connection:
        """A pooled connection to the pool's connection's broker, with forkq's transport."""
        return cast(kombu.Connection, _PooledConnection(self, **dict(self.connection._info(resolve=False))))


class ForkqAMQP(AMQP):
    """Celery's `app.amqp` with `ForkqConnection`: every connection the app makes (worker, events, producer pool)."""

    Connection = ForkqConnection
    BrokerConnection = ForkqConnection

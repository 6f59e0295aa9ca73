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
"""

from __future__ import annotations

from typing import Any, cast

import kombu
import redis
from celery.app.amqp import AMQP
from kombu.connection import ConnectionPool, PooledConnection
from kombu.transport import redis as kombu_redis
from kombu.utils.collections import HashedSeq


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


class RedisChannel(_OneClientPerPool, kombu_redis.Channel):
    """kombu's Redis channel, reusing its synchronous client."""


class SentinelChannel(_OneClientPerPool, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel, reusing its synchronous client."""


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport with `RedisChannel`."""

    Channel = RedisChannel


class SentinelTransport(kombu_redis.SentinelTransport):
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

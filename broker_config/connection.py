"""forkq's broker connection: kombu's Redis transports, with one synchronous Redis client per channel.

kombu's Redis channel builds a new `redis.Redis` for every publish, ack and requeue
(`Channel.conn_or_acquire` → `_create_client`), and building one copies redis-py's ~170 response
callbacks into a case-insensitive dict. Profiled on a worker (py-spy, GIL samples), that construction
is 13% of a forkq worker's CPU per fork and 26% of a bare Celery worker's per no-op task
(docs/performance.md). A `redis.Redis` is thread-safe (each command takes a connection from the
pool and gives it back), so one client per pool serves every publish of a channel; a channel whose
pool was replaced (a reconnect) builds a new one.

Only forkq's app uses this (`Celery(amqp=ForkqAMQP)`), and only through the connection's transport
lookup: the broker URL, its scheme (`redis`, `rediss`, `redis+socket`, `sentinel`), TLS options,
failover and `as_uri` (Flower's broker page) are kombu's own.
"""

from __future__ import annotations

from typing import Any

import kombu
import redis
from celery.app.amqp import AMQP
from kombu.transport import redis as kombu_redis


class _OneClientPerPool:
    """Channel mixin: `_create_client()` returns one client per connection pool, not a new one per call."""

    _forkq_client: redis.Redis | None = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the consumer's BRPOP client: kombu builds it once per channel already
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
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


class ForkqConnection(kombu.Connection):
    """A kombu connection that resolves its transport as kombu does, then uses forkq's subclass of it.

    The transport is swapped after kombu has read the URL (so `rediss://` gets its TLS defaults and
    `redis+socket://` its socket) and it is stored as the class, so the connection pools Celery builds
    from this connection (`_info(resolve=False)`) use it too. `info()` and `as_uri()` still name the
    scheme the URL gave, which is what Flower's broker page and the worker's banner read.
    """

    _forkq_transport_name: Any = None

    # kombu calls it from __init__ and switch(), always with keywords (the stubs spell out each one)
    def _init_params(self, **params: Any) -> None:  # type: ignore[override]
        super()._init_params(**params)
        self._forkq_transport_name = self.transport_cls
        swapped = TRANSPORTS.get(self.get_transport_cls())
        if swapped is not None:
            self.transport_cls = swapped  # type: ignore[assignment]  # kombu accepts a class here too

    # kombu's `_info` returns (key, value) pairs, not the dict its stubs declare
    def _info(self, resolve: bool = True) -> Any:
        info: tuple[tuple[str, Any], ...] = super()._info(resolve)  # type: ignore[assignment]
        if not resolve or self._forkq_transport_name is self.transport_cls:
            return info
        name = self.resolve_aliases.get(self._forkq_transport_name, self._forkq_transport_name)
        return tuple((key, name if key == "transport" else value) for key, value in info)


class ForkqAMQP(AMQP):
    """Celery's `app.amqp` with `ForkqConnection`: every connection the app makes (worker, events, producer pool)."""

    Connection = ForkqConnection
    BrokerConnection = ForkqConnection

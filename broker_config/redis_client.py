"""A redis-py client for FORKQ_REDIS_URL, direct or through Redis Sentinel (`sentinel://` URL lists)."""

from __future__ import annotations

import asyncio
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel, SentinelConnectionPool

from broker_config.settings import Settings, is_sentinel_url, sentinel_nodes

# how long a command waits for a free connection of a sized pool before it fails (ConnectionError)
POOL_TIMEOUT_S: Final = 30.0


def redis_client(
    settings: Settings, *, max_connections: int | None = None, pool_timeout_s: float = POOL_TIMEOUT_S, **options: Any
) -> redis.Redis:
    """A client of forkq's Redis: `Redis.from_url`, or for sentinel:// the primary Sentinel names.

    The Sentinel form follows kombu's (so one URL can serve records and broker): nodes separated
    by `;`, the Redis password, user and database in the first URL, the master's name in
    FORKQ_SENTINEL_MASTER. Its client asks Sentinel for the primary again after a failover.
    `options` are redis-py connection options (timeouts, `health_check_interval`).

    With `max_connections` the pool opens at most that many connections (lazily), and a command that
    finds them all in use waits up to `pool_timeout_s` for one (a `BlockingConnectionPool`) rather
    than raising `MaxConnectionsError` at once, as redis-py's default pool of 100 does; a Sentinel
    client's pool (`BlockingSentinelConnectionPool`) waits the same way.
    """
    url = settings.redis_url
    if not is_sentinel_url(url):
        if max_connections is None:
            return redis.Redis.from_url(url, **options)
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_timeout_s, **options
        )
        return redis.Redis(connection_pool=pool)
    pool_options: dict[str, Any] = {}
    if max_connections is not None:
        pool_options = {"connection_pool_class": BlockingSentinelConnectionPool, "timeout": pool_timeout_s}
        pool_options["max_connections"] = max_connections
    sentinel_kwargs, credentials = _sentinel_options(settings, options)
    # redis-py leaves its Sentinel class without annotations
    sentinel = Sentinel(sentinel_nodes(url), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        settings.sentinel_master, redis_class=redis.Redis, **credentials, **options, **pool_options
    )
    return client


def async_redis_client(
    settings: Settings, *, max_connections: int, pool_timeout_s: float = POOL_TIMEOUT_S, **options: Any
) -> redis.asyncio.Redis:
    """An asyncio client of forkq's Redis (`redis.asyncio`), direct or through Sentinel as `redis_client`.

    For servers that follow many forks at once (`forkq serve`): a command blocked in `XREAD BLOCK`
    holds a connection, not a thread, so the pool opens up to `max_connections` (lazily), and a command
    that finds them all in use waits up to `pool_timeout_s` for one. Build it inside the event loop that
    uses it, and close it with `close_async_client`.
    """
    url = settings.redis_url
    # named once here: else redis-py looks its own version up in the package metadata for every new connection
    # (milliseconds each), which a burst of a thousand followers pays in full
    options.setdefault(*_driver_info())
    if not is_sentinel_url(url):
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_timeout_s, **options
        )
        return redis.asyncio.Redis.from_pool(pool)
    sentinel_kwargs, credentials = _sentinel_options(settings, options)
    sentinel = AsyncSentinel(sentinel_nodes(url), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
    client: redis.asyncio.Redis = sentinel.master_for(
        settings.sentinel_master,
        redis_class=redis.asyncio.Redis,
        max_connections=max_connections,
        **credentials,
        **options,
    )
    return client


async def close_async_client(client: redis.asyncio.Redis) -> None:
    """Close an `async_redis_client`: its pool and, through Sentinel, its connections to the Sentinel nodes
    (which the client's own `aclose()` leaves open)."""
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    await client.aclose()
    if manager is not None:
        await asyncio.gather(*(node.aclose() for node in manager.sentinels))


def _driver_info() -> tuple[str, Any]:
    """The connection option that names redis-py and its version to Redis (`CLIENT SETINFO`), resolved now."""
    try:
        from redis.driver_info import DriverInfo  # noqa: PLC0415  (redis-py 7 and later; it deprecates lib_version)
    except ImportError:
        return "lib_version", redis.__version__
    return "driver_info", DriverInfo()


def _sentinel_options(settings: Settings, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options of the Sentinel nodes, credentials of the primary) for a sentinel:// URL list."""
    first = urlsplit(settings.redis_url.split(";", maxsplit=1)[0])
    # Sentinel nodes get the socket options and their own password, never the primary's
    sentinel_kwargs: dict[str, Any] = {k: v for k, v in options.items() if k.startswith("socket_")}
    if settings.sentinel_password is not None:
        sentinel_kwargs["password"] = settings.sentinel_password.get_secret_value()
    credentials = {
        "username": unquote(first.username) if first.username else None,
        "password": unquote(first.password) if first.password else None,
        "db": int(first.path.strip("/") or 0),
    }
    return sentinel_kwargs, credentials


class BlockingSentinelConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool (connections to the primary Sentinel names) with `BlockingConnectionPool`'s
    waiting: a command that finds every connection in use waits `timeout` seconds for one.

    The method order puts the Sentinel pool's `reset` and `owns_connection` first (a connection to a
    former primary is dropped on release), and the blocking pool's queue of connections under them.
    """

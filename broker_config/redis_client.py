"""A redis-py client for FORKQ_REDIS_URL, direct or through Redis Sentinel (`sentinel://` URL lists)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel, SentinelConnectionPool

from broker_config.settings import Settings, is_sentinel_url, sentinel_nodes

# how long a command waits for a free connection of a sized pool before it fails (ConnectionError)
POOL_TIMEOUT_S: Final = 30.0
# a pooled connection idle longer than this is checked for a close by the server before it is used again; a busy
# worker reuses its hot connections within milliseconds (its pool hands out the last one released first)
QUIET_CHECK_S: Final = 0.05


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
        pool.connection_class = quick_checked(pool.connection_class)
        return redis.Redis(connection_pool=pool)
    pool_options: dict[str, Any] = {}
    if max_connections is not None:
        pool_options = {"connection_pool_class": BlockingSentinelConnectionPool, "timeout": pool_timeout_s}
        pool_options["max_connections"] = max_connections
    sentinel_kwargs, credentials = _sentinel_options(settings, options)
    # older redis-py releases (the pin allows 5.0 on) leave the Sentinel classes unannotated; 8.2 annotates them
    sentinel = Sentinel(sentinel_nodes(url), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call, unused-ignore]
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
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
    sentinel = AsyncSentinel(sentinel_nodes(url), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call, unused-ignore]
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


class _CountingPacker:
    """The connection's command packer, counting the commands it packs: each is a reply the server will send."""

    def __init__(self, packer: Any, connection: QuickCheck) -> None:
        self.packer = packer
        self.connection = connection

    def pack(self, *args: Any) -> Any:
        packed = self.packer.pack(*args)
        self.connection.replies_due += 1
        return packed


class QuickCheck:
    """A redis-py connection that knows when no reply can be waiting on it, so that handing it out costs no
    system call.

    redis-py's pool asks `can_read()` of every connection it hands out, to catch one released with a
    reply still unread, or closed by the server: a non-blocking `recv` (and two socket mode changes) per
    command. With a thousand forks in one worker that check was a sixth of the process's Python time
    (docs/performance.md). This connection counts the commands it packed and the replies it read:
    when every reply was read, no byte is buffered and the last reply came less than `QUIET_CHECK_S` ago,
    nothing can be waiting, and the answer is no without asking the socket. Any other case (a reply
    unread, a connection idle long enough that the server may have closed it) asks the socket as
    redis-py does. A reply lost to an error disconnects the connection (redis-py does), which starts
    the count again.
    """

    replies_due = 0
    last_reply = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._command_packer = _CountingPacker(getattr(self, "_command_packer"), self)  # noqa: B009  (untyped)

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        self.replies_due = 0
        super().disconnect(*args, **kwargs)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            response = super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.exceptions.ResponseError:  # an error reply is a reply
            self._replied()
            raise
        self._replied()
        return response

    def _replied(self) -> None:
        self.replies_due = max(0, self.replies_due - 1)
        self.last_reply = time.monotonic()

    def can_read(self, timeout: float = 0) -> bool:
        buffer = getattr(getattr(self, "_parser", None), "_buffer", None)
        if (
            timeout == 0
            and self.replies_due == 0
            and getattr(self, "_sock", None) is not None
            and buffer is not None
            and not buffer.unread_bytes()
            and time.monotonic() - self.last_reply < QUIET_CHECK_S
        ):
            return False
        return bool(super().can_read(timeout))  # type: ignore[misc]


def quick_checked(connection_class: type[Any]) -> type[Any]:
    """`connection_class` with `QuickCheck`'s pool check (a class per connection class, made once)."""
    if issubclass(connection_class, QuickCheck):
        return connection_class
    return _QUICK.setdefault(
        connection_class, type(f"Quick{connection_class.__name__}", (QuickCheck, connection_class), {})
    )


_QUICK: dict[type[Any], type[Any]] = {}


class BlockingSentinelConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool (connections to the primary Sentinel names) with `BlockingConnectionPool`'s
    waiting: a command that finds every connection in use waits `timeout` seconds for one.

    The method order puts the Sentinel pool's `reset` and `owns_connection` first (a connection to a
    former primary is dropped on release), and the blocking pool's queue of connections under them.
    """

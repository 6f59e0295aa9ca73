"""A redis-py client for FORKQ_REDIS_URL, direct or through Redis Sentinel (`sentinel://` URL lists)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from broker_config.settings import Settings, is_sentinel_url, sentinel_nodes


def redis_client(settings: Settings, **options: Any) -> redis.Redis:
    """A client of forkq's Redis: `Redis.from_url`, or for sentinel:// the primary Sentinel names.

    The Sentinel form follows kombu's (so one URL can serve records and broker): nodes separated
    by `;`, the Redis password, user and database in the first URL, the master's name in
    FORKQ_SENTINEL_MASTER. Its client asks Sentinel for the primary again after a failover.
    `options` are redis-py connection options (timeouts, `health_check_interval`).
    """
    url = settings.redis_url
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    first = urlsplit(url.split(";", maxsplit=1)[0])
    # Sentinel nodes get the socket options and their own password, never the primary's
    sentinel_kwargs: dict[str, Any] = {k: v for k, v in options.items() if k.startswith("socket_")}
    if settings.sentinel_password is not None:
        sentinel_kwargs["password"] = settings.sentinel_password.get_secret_value()
    credentials = {
        "username": unquote(first.username) if first.username else None,
        "password": unquote(first.password) if first.password else None,
        "db": int(first.path.strip("/") or 0),
    }
    # redis-py leaves its Sentinel class without annotations
    sentinel = Sentinel(sentinel_nodes(url), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        settings.sentinel_master, redis_class=redis.Redis, **credentials, **options
    )
    return client

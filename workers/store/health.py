"""Is this Redis fit for forkq? Used by `forkq check`, the probes and the worker at start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import redis

from broker_config.redis_client import redis_client
from broker_config.settings import Settings, redact_url


@dataclass
class RedisHealth:
    """Problems (forkq must not run) and warnings (it runs, at a risk) found on a Redis server.

    `reachable` is False when Redis did not answer (an outage to wait out, not settings to fix).
    """

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    reachable: bool = True


def check_redis(settings: Settings, client: redis.Redis | None = None) -> RedisHealth:
    """Reachability, eviction policy (must be `noeviction`) and persistence (warn when off)."""
    own = client is None
    client = client or redis_client(settings, socket_connect_timeout=3, socket_timeout=3)
    health = RedisHealth()
    where = f"Redis at {redact_url(settings.redis_url)}"
    try:
        client.ping()
        config = cast(dict[str, str], client.config_get("maxmemory-policy"))
        persistence = cast(dict[str, str], client.config_get("appendonly")) | cast(
            dict[str, str], client.config_get("save")
        )
    except redis.AuthenticationError as exc:
        health.problems.append(f"{where} refused the credentials ({exc}); fix the password in FORKQ_REDIS_URL")
        return health
    except redis.RedisError as exc:
        health.problems.append(f"{where} is not reachable ({exc}); start it or fix FORKQ_REDIS_URL")
        health.reachable = not isinstance(exc, redis.ConnectionError | redis.TimeoutError)
        return health
    finally:
        if own:
            client.close()
    policy = config.get("maxmemory-policy", "noeviction")
    if policy != "noeviction":
        health.problems.append(
            f"{where} has maxmemory-policy {policy!r}: it may evict fork records and leases; "
            "set `maxmemory-policy noeviction` (redis.conf or CONFIG SET)"
        )
    if persistence.get("appendonly", "no") != "yes" and not persistence.get("save"):
        health.warnings.append(
            f"{where} has persistence off (no AOF, no RDB): a Redis restart loses every fork; "
            "set `appendonly yes` for production (deploy/redis.conf)"
        )
    return health

"""`forkq serve`: the checks before the API starts (tokens, host, Redis), then uvicorn.

Without FORKQ_API_TOKENS the server refuses to start, unless given `--insecure-no-auth`, which is refused
on any host but a loopback one: an API without tokens lets whoever reaches it launch forks that run tools.
"""

from __future__ import annotations

import ipaddress
import signal
import sys
from typing import Final

import uvicorn

from broker_config.settings import Settings
from workers.api.app import NO_TOKENS, make_api
from workers.api.auth import TokenSet
from workers.errors import ConfigurationError
from workers.store.health import check_redis

LOG_LEVELS: Final = ("critical", "error", "warning", "info", "debug")
# on SIGTERM, open event streams are closed after this long; their clients resume on another server
SHUTDOWN_GRACE_S: Final = 5


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or `localhost`."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: it may resolve to anything
        return False


def auth_required(settings: Settings, host: str, *, insecure_no_auth: bool) -> bool:
    """Whether the API checks tokens: yes with FORKQ_API_TOKENS, no only with `--insecure-no-auth` on loopback.

    Raises:
        ConfigurationError: no token and no `--insecure-no-auth`; `--insecure-no-auth` on a host that is not
            loopback; or tokens and `--insecure-no-auth` both given.
    """
    tokens = TokenSet.parse(settings.api_tokens, settings.api_admin_tokens)
    if not insecure_no_auth:
        if not tokens:
            raise ConfigurationError(f"forkq serve refuses to start: {NO_TOKENS}", field="FORKQ_API_TOKENS")
        return True
    if tokens:
        raise ConfigurationError(
            "forkq serve: FORKQ_API_TOKENS is set and --insecure-no-auth was given; drop --insecure-no-auth to "
            "require the tokens, or unset FORKQ_API_TOKENS",
            field="FORKQ_API_TOKENS",
        )
    if not is_loopback(host):
        raise ConfigurationError(
            f"forkq serve refuses --insecure-no-auth on host {host!r}: without tokens, anyone who reaches it can "
            "launch forks; bind a loopback host (--host 127.0.0.1, ::1 or localhost), or set FORKQ_API_TOKENS",
            field="host",
        )
    return False


def run_server(settings: Settings, *, host: str, port: int, insecure_no_auth: bool, log_level: str) -> int:
    """Check, then serve until SIGINT or SIGTERM; the exit code (0 after a shutdown, 1 when Redis is unreachable).

    Raises:
        ConfigurationError: see `auth_required`; or the Redis server is unfit for forkq.
    """
    require_auth = auth_required(settings, host, insecure_no_auth=insecure_no_auth)
    health = check_redis(settings)
    if health.problems and health.reachable:  # settings to fix
        raise ConfigurationError("forkq serve refuses to start: " + "; ".join(health.problems))
    if health.problems:  # an outage: exit 1, so that a supervisor retries
        print(f"forkq serve: cannot start: {'; '.join(health.problems)}", file=sys.stderr)
        return 1
    app = make_api(settings, require_auth=require_auth)
    # uvicorn raises the signal that stopped it again once it has shut down (for the handler it found): with
    # these, that ends a clean shutdown, exit 0 as `forkq worker`'s, not a death by signal or a traceback
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, server_header=False
    )
    return 0

"""`make_api(settings)`: the ASGI app of `forkq serve` (FastAPI), stateless over forkq's Redis.

Every fork's state lives in Redis, so any number of these apps, in any number of processes, can serve the
same forks behind a load balancer; a client may send each request, or resume an event stream, to any of them.
Around the endpoints (`workers.api.routes`) and the web view (`ui`): the bearer-token check (`auth`), outermost,
then the body limits (`bodies`); the one error shape (`problems`) for everything refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI

from broker_config.redis_client import async_redis_client, close_async_client
from broker_config.settings import Settings
from workers.api.auth import OPEN_PATHS, BearerAuth, TokenSet
from workers.api.bodies import BodyLimit
from workers.api.idempotency import IdempotencyKeys
from workers.api.launches import Launcher
from workers.api.problems import install_error_handlers
from workers.api.routes import Services, fork_router
from workers.api.sse import document_events
from workers.api.ui import UI_PATHS, ui_router
from workers.api.workspaces import Workspaces
from workers.base.keys import Keys
from workers.cli_args import package_version
from workers.client import ForkClient
from workers.errors import ConfigurationError
from workers.store.reader import AsyncForkReader

READ_MARGIN_S = 5.0  # how long Redis may take past a blocking read's own bound before the read fails
NO_TOKENS = (
    "no API token is configured: set FORKQ_API_TOKENS to one or more tokens separated by commas (or their "
    "hashes, sha256:<hex>), or, for local use only, pass --insecure-no-auth with a loopback --host"
)


class _Api(FastAPI):
    """forkq's app: FastAPI's, with the event stream documented as the event union (`document_events`)."""

    def openapi(self) -> dict[str, Any]:
        """The OpenAPI document (built once)."""
        built = self.openapi_schema is not None
        document = super().openapi()
        return document if built else document_events(document)


def make_api(settings: Settings, *, require_auth: bool = True) -> FastAPI:
    """The app for `settings`: every endpoint but `/healthz` behind FORKQ_API_TOKENS unless `require_auth` is False.

    Nothing connects until the app starts (its lifespan builds the clients, in the server's event loop).

    Raises:
        ConfigurationError: `require_auth` and no token is configured.
    """
    tokens = TokenSet.parse(settings.api_tokens, settings.api_admin_tokens)
    if require_auth and not tokens:
        raise ConfigurationError(NO_TOKENS, field="FORKQ_API_TOKENS")
    app = _Api(
        title="forkq",
        version=package_version(),
        summary="Launch and follow forked LLM subagents (docs/api.md).",
        lifespan=_lifespan(settings),
        docs_url=None,  # the interactive docs would need the token in a browser; /openapi.json is served
        redoc_url=None,
    )
    install_error_handlers(app)
    app.include_router(fork_router(secured=require_auth))
    app.include_router(ui_router())
    app.add_middleware(BodyLimit, max_bytes=settings.api_max_body_bytes)
    if require_auth:  # added last: outermost, so no body is read for a request without a valid token
        # the web view's page and files hold no data: served to anyone, while every call they make needs a token
        app.add_middleware(BearerAuth, tokens=tokens, open_paths=OPEN_PATHS | UI_PATHS)
    return app


def _lifespan(settings: Settings) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        keys = Keys(settings.namespace)
        client = ForkClient(settings)
        # blocking reads (XREAD BLOCK, up to a keep-alive interval): one connection per waiting request, no thread;
        # a read may take that long, so the socket timeout is longer (redis-py's default, 5 s, is not)
        followers = async_redis_client(
            settings,
            max_connections=settings.api_redis_connections,
            socket_timeout=settings.api_keepalive_s + READ_MARGIN_S,
        )
        idempotency = IdempotencyKeys(client.redis, keys, ttl_s=settings.api_idempotency_ttl_s)
        workspaces = Workspaces(client.redis, keys, settings)
        app.state.services = Services(
            settings=settings,
            client=client,
            reader=AsyncForkReader(followers, keys),
            launcher=Launcher(client, idempotency, workspaces),
            workspaces=workspaces,
        )
        try:
            yield
        finally:
            await close_async_client(followers)
            client.close()

    return lifespan

"""Bearer tokens: the `FORKQ_API_TOKENS` a server accepts, and the middleware that checks every request.

Each entry is a token, or `sha256:<hex>`, the SHA-256 of a token (so the environment need not hold the token
itself), with its tenant before it (`TENANT=TOKEN`; none: `default`). FORKQ_API_ADMIN_TOKENS are operators' tokens,
which see every tenant. The middleware puts the matched `Caller` in the request's state. A presented token is
hashed once and compared, in constant time, with the hash of every entry: how long a check takes says nothing about
which entry, or which prefix, came close. A request without a valid token is answered 401 before the app reads its
body; only `GET /healthz` needs none.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Final

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from broker_config.settings import DEFAULT_TENANT, TOKEN_HASH_PREFIX, api_token_entries, tenant_tokens
from workers.api.problems import send_error

OPEN_PATHS: Final = frozenset({"/healthz"})
CHALLENGE: Final = (b"www-authenticate", b'Bearer realm="forkq"')
MAX_TOKEN_BYTES: Final = 4096


@dataclass(frozen=True)
class Caller:
    """Who a request's token says it is: the entry's id, its tenant, and whether it is an operator's (admin)."""

    token_id: str
    tenant: str = DEFAULT_TENANT
    admin: bool = False

    def sees(self, tenant: str) -> bool:
        """Whether this caller may reach a fork of `tenant` (its own, or any for an admin)."""
        return self.admin or tenant == self.tenant


ANYONE: Final = Caller(token_id="", admin=True)  # a server without tokens (loopback, on purpose): one trusted user


@dataclass(frozen=True)
class TokenSet:
    """The SHA-256 digests of the accepted tokens, each with its tenant, and which are operators'."""

    digests: tuple[bytes, ...]
    tenants: tuple[str, ...] = ()
    admins: tuple[bool, ...] = ()

    @classmethod
    def parse(cls, tokens: SecretStr | None, admin_tokens: SecretStr | None = None) -> TokenSet:
        """From FORKQ_API_TOKENS (`TENANT=TOKEN` entries) and FORKQ_API_ADMIN_TOKENS (validated by `Settings`)."""
        entries = [(tenant, token, False) for tenant, token in tenant_tokens(tokens)]
        entries += [(DEFAULT_TENANT, token, True) for token in api_token_entries(admin_tokens)]
        digests = []
        for _, entry, _ in entries:
            if entry.startswith(TOKEN_HASH_PREFIX):
                digests.append(bytes.fromhex(entry.removeprefix(TOKEN_HASH_PREFIX)))
            else:
                digests.append(hashlib.sha256(entry.encode()).digest())
        return cls(tuple(digests), tuple(t for t, _, _ in entries), tuple(a for _, _, a in entries))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def match(self, token: bytes) -> Caller | None:
        """The caller `token` names (its entry's id is the first 16 hex digits of its digest's SHA-256), or None.

        Every entry is compared, in constant time, whether an earlier one matched or not.
        """
        presented = hashlib.sha256(token).digest()
        found: int | None = None
        for index, digest in enumerate(self.digests):
            if hmac.compare_digest(presented, digest):
                found = index
        if found is None:
            return None
        token_id = hashlib.sha256(self.digests[found]).hexdigest()[:16]
        return Caller(token_id, self.tenants[found], self.admins[found])


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the request's `Authorization: Bearer <token>` header (its bytes), or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            token = token.strip()
            if scheme.lower() == b"bearer" and token and len(token) <= MAX_TOKEN_BYTES:
                return token
            return None
    return None


class BearerAuth:
    """ASGI middleware: every request but those of `open_paths` needs a token of `tokens`, else 401 (nothing read or
    written).

    The matched `Caller` goes into the request's state (`caller`): its tenant scopes what it reaches, its entry's id
    its idempotency keys and workspace uploads.
    """

    def __init__(self, app: ASGIApp, tokens: TokenSet, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.tokens = tokens
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        caller = None if token is None else self.tokens.match(token)
        if caller is None:
            problem = "no bearer token" if token is None else "the bearer token is not one this server accepts"
            message = f"{problem}: send `Authorization: Bearer <token>` with a token of FORKQ_API_TOKENS"
            await send_error(send, 401, message, headers=[CHALLENGE])
            return
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)

"""Bearer tokens: the `FORKQ_API_TOKENS` a server accepts, and the middleware that checks every request.

Each entry is a token, or `sha256:<hex>`, the SHA-256 of a token (so the environment need not hold the
token itself). A presented token is hashed once and compared, in constant time, with the hash of every
entry: how long a check takes says nothing about which entry, or which prefix, came close. A request
without a valid token is answered 401 before the app reads its body; only `GET /healthz` needs none.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Final

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from broker_config.settings import TOKEN_HASH_PREFIX, api_token_entries
from workers.api.problems import send_error

OPEN_PATHS: Final = frozenset({"/healthz"})
CHALLENGE: Final = (b"www-authenticate", b'Bearer realm="forkq"')
MAX_TOKEN_BYTES: Final = 4096


@dataclass(frozen=True)
class TokenSet:
    """The SHA-256 digests of the accepted tokens."""

    digests: tuple[bytes, ...]

    @classmethod
    def parse(cls, tokens: SecretStr | None) -> TokenSet:
        """From FORKQ_API_TOKENS (validated by `Settings`: a `sha256:` entry holds 64 hex digits)."""
        digests = []
        for entry in api_token_entries(tokens):
            if entry.startswith(TOKEN_HASH_PREFIX):
                digests.append(bytes.fromhex(entry.removeprefix(TOKEN_HASH_PREFIX)))
            else:
                digests.append(hashlib.sha256(entry.encode()).digest())
        return cls(tuple(digests))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def match(self, token: bytes) -> str | None:
        """The id of the entry `token` matches (the first 16 hex digits of its digest's SHA-256), or None.

        Every entry is compared, in constant time, whether an earlier one matched or not.
        """
        presented = hashlib.sha256(token).digest()
        found: bytes | None = None
        for digest in self.digests:
            if hmac.compare_digest(presented, digest):
                found = digest
        return None if found is None else hashlib.sha256(found).hexdigest()[:16]


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

    The matched entry's id goes into the request's state (`token_id`), which scopes idempotency keys by caller.
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
        token_id = None if token is None else self.tokens.match(token)
        if token_id is None:
            problem = "no bearer token" if token is None else "the bearer token is not one this server accepts"
            message = f"{problem}: send `Authorization: Bearer <token>` with a token of FORKQ_API_TOKENS"
            await send_error(send, 401, message, headers=[CHALLENGE])
            return
        scope.setdefault("state", {})["token_id"] = token_id
        await self.app(scope, receive, send)

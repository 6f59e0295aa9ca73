"""Idempotency keys of launches: which fork a key launched, and with which body.

A key is claimed with `SET NX` before the launch, so of several servers that receive the same key at
once exactly one launches; the others find the claim and answer with its fork. A launch that is
refused gives its claim up again (compare-and-delete), so that a refused request leaves nothing behind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final, cast

import redis

from workers.base.keys import Keys

# KEYS: the claim. ARGV: the value it must hold. Deletes it only if it is still this launch's.
_RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Claim:
    """What a key holds: the digest of the body it was first sent with, and the fork that launch made."""

    body: str
    fork_id: str

    def encode(self) -> str:
        """The stored JSON."""
        return json.dumps({"body": self.body, "fork_id": self.fork_id}, separators=(",", ":"))


class IdempotencyKeys:
    """Claims of Idempotency-Keys in Redis, each kept `ttl_s` seconds."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._release = client.register_script(_RELEASE)

    def claim(self, key_digest: str, claim: Claim) -> Claim | None:
        """Claim the key for `claim` (None: it is ours now), or the claim another launch holds on it."""
        key = self.keys.idempotency(key_digest)
        if self.client.set(key, claim.encode(), nx=True, ex=self.ttl_s):
            return None
        return self.held(key_digest)

    def held(self, key_digest: str) -> Claim | None:
        """The claim on the key, or None when there is none (never claimed, expired, or given up)."""
        raw = cast(bytes | None, self.client.get(self.keys.idempotency(key_digest)))
        if raw is None:
            return None
        fields = json.loads(raw)
        return Claim(body=str(fields["body"]), fork_id=str(fields["fork_id"]))

    def release(self, key_digest: str, claim: Claim) -> None:
        """Give the key up, if it still holds `claim` (the launch it was claimed for was refused)."""
        self._release(keys=[self.keys.idempotency(key_digest)], args=[claim.encode()])

"""A parent session's token budget in Redis: its limit, what its forks used (each response charged once), and the
forks it paused.

Every fork of a session, and every nested subagent below them (they keep the caller's `parent_session`), charges
the session's `used` after each model response, keyed by fork and model step: a retried charge, or a revived run
that asks the model again for a step its dead worker already charged, counts nothing more. A budget is a limit
someone sets (`set`); without one, `used` still counts, so a budget set later starts from what was used.
"""

from __future__ import annotations

from typing import Any, cast

import redis
from pydantic import BaseModel, ConfigDict

from workers.base.keys import Keys
from workers.store.pipelined import ScriptCall
from workers.store.script_parts import lua_script

# KEYS: budget, charged. ARGV: fork id, step, tokens, ttl_s. Adds the tokens to `used` unless the fork's step was
# charged already (its last charged step is at or past it); the reply: the limit ('' for none) and `used`.
CHARGE = lua_script(
    """
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > last then
  redis.call('HINCRBY', KEYS[1], 'used', ARGV[3])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
end
for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return {redis.call('HGET', KEYS[1], 'tokens') or '', redis.call('HGET', KEYS[1], 'used') or '0'}
"""
)

# KEYS: budget. The limit ('' for none) and `used`: a worker's read before a model call, sent as a script so that it
# rides on the fork's checkpoint (`workers.store.pipelined`).
READ = lua_script("return {redis.call('HGET', KEYS[1], 'tokens') or '', redis.call('HGET', KEYS[1], 'used') or '0'}")

# KEYS: budget, paused. ARGV: tokens, ttl_s. Sets the limit; the reply: `used`, and the forks the budget paused
# when the new limit is above `used` (they are resumed by the caller, which then takes each out of the set).
SET = lua_script(
    """
redis.call('HSET', KEYS[1], 'tokens', ARGV[1])
redis.call('HSETNX', KEYS[1], 'used', 0)
redis.call('EXPIRE', KEYS[1], ARGV[2])
local used = tonumber(redis.call('HGET', KEYS[1], 'used'))
local paused = {}
if tonumber(ARGV[1]) > used then paused = redis.call('SMEMBERS', KEYS[2]) end
return {used, paused}
"""
)


class SessionBudget(BaseModel):
    """A session's token budget: its limit (None: none set), the tokens its forks used, and what is left."""

    model_config = ConfigDict(frozen=True)

    session: str
    tokens: int | None
    used: int
    left: int | None  # None without a limit; never below 0
    resumed: list[str] = []  # the forks a raise of the budget resumed (none on a read)

    @classmethod
    def of(cls, session: str, tokens: int | None, used: int) -> SessionBudget:
        """The budget with its `left` worked out."""
        return cls(session=session, tokens=tokens, used=used, left=_left(tokens, used))

    @property
    def reached(self) -> bool:
        """True when a limit is set and used up."""
        return self.tokens is not None and self.used >= self.tokens


def _left(limit: int | None, used: int) -> int | None:
    """The tokens left under `limit` (None without one), never below 0."""
    return None if limit is None else max(limit - used, 0)


def _int(raw: Any) -> int | None:
    return None if raw is None or raw in (b"", "") else int(raw)


def budget_of(session: str, reply: Any) -> SessionBudget:
    """The budget a `READ` or `CHARGE` reply (the limit or '', and `used`) says."""
    limit, used = cast(list[Any], reply)
    return SessionBudget.of(session, _int(limit), _int(used) or 0)


class BudgetStore:
    """Session budgets over one Redis client."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._charge = client.register_script(CHARGE)
        self._set = client.register_script(SET)
        self._read = client.register_script(READ)

    def read(self, session: str) -> SessionBudget:
        """The session's budget as it stands."""
        script, keys, args = self.read_call(session)
        return budget_of(session, script(keys=keys, args=args))

    def read_call(self, session: str) -> ScriptCall:
        """`read` as a script call, to ride on a fork's write; `budget_of` gives its reply's meaning."""
        return ScriptCall(self._read, [self.keys.session_budget(session)], [])

    def charge(self, session: str, fork_id: str, step: int, tokens: int) -> SessionBudget:
        """Charge one model response (`step` of `fork_id`) to the session, once; the budget afterwards."""
        script, keys, args = self.charge_call(session, fork_id, step, tokens)
        return budget_of(session, script(keys=keys, args=args))

    def charge_call(self, session: str, fork_id: str, step: int, tokens: int) -> ScriptCall:
        """`charge` as a script call, to ride on a fork's write; `budget_of` gives its reply's meaning."""
        k = self.keys
        keys = [k.session_budget(session), k.session_budget_charged(session)]
        return ScriptCall(self._charge, keys, [fork_id, step, tokens, self.ttl_s])

    def set(self, session: str, tokens: int) -> tuple[SessionBudget, list[str]]:
        """Set the session's limit; the budget, and the forks it paused that may now resume (`done` each after)."""
        k = self.keys
        keys = [k.session_budget(session), k.session_budget_paused(session)]
        used, paused = cast(list[Any], self._set(keys=keys, args=[tokens, self.ttl_s]))
        forks = sorted(p.decode() if isinstance(p, bytes) else str(p) for p in paused)
        return SessionBudget.of(session, tokens, int(used)), forks

    def resumed(self, session: str, fork_id: str) -> None:
        """Take a fork out of the session's budget-paused forks (it was resumed, or is paused no longer)."""
        self.client.srem(self.keys.session_budget_paused(session), fork_id)

    def paused(self, session: str) -> list[str]:
        """The forks the session's budget paused, sorted."""
        members = cast(set[bytes], self.client.smembers(self.keys.session_budget_paused(session)))
        return sorted(m.decode() for m in members)


class ForkBudget(BaseModel):
    """A fork's budgets: its own `max_tokens` (None: none) with used and left, and its session's budget."""

    model_config = ConfigDict(frozen=True)

    fork_id: str
    max_tokens: int | None
    used: int
    left: int | None  # None without max_tokens; never below 0
    session: SessionBudget

    @classmethod
    def of(cls, fork_id: str, max_tokens: int | None, used: int, session: SessionBudget) -> ForkBudget:
        """The fork's budgets with its `left` worked out."""
        return cls(fork_id=fork_id, max_tokens=max_tokens, used=used, left=_left(max_tokens, used), session=session)

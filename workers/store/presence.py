"""Worker presence: a worker's open Redis connection says it is alive, so a dead worker's forks move on at once.

When a worker process dies (SIGKILL, an OOM kill, a crash), the kernel closes its TCP connections
and Redis forgets them within milliseconds, long before the forks' leases expire. Each worker
runtime therefore keeps one connection of its own open (`Presence`), pings on it every
`interval_s`, and names that connection's `CLIENT ID` under its presence token in `{ns}:procs`,
again after every reconnect (a restarted Redis included). Its claims' owner tokens carry the
token's random mark (`owner_token`).

A sweeper (`PresenceWatch`) asks Redis which of the named connections exist (`HGETALL` of the names,
then `CLIENT LIST ID`: two round trips, whatever the number of workers). A runtime whose named
connection has been gone for `grace_s`, without the runtime naming a new one, is dead: its forks
are revived without waiting for their leases (`workers.store.lease.Leases.revive` with the dead
owner). The grace covers a connection dropped
while the worker lives (a `CLIENT KILL`, a proxy reset, a Redis restart): such a worker reconnects
and names its new connection within a ping or two. Any error of the sweeper's own Redis calls starts
every observation afresh.

A worker that is alive but silent (stopped, paused by the collector, cut off by a partition that
sends no reset) keeps its connection, and its forks are revived only when their leases expire: the
lease TTL stays the rule for it, and the fencing epoch stops it if it wakes up.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Final, cast

import redis

from workers.base.keys import Keys

log = logging.getLogger("forkq.presence")

# the worker names its connection again every this many pings even when its id did not change, so an
# entry a sweeper removed (after a drop it took for a death) comes back
RENAME_EVERY: Final = 25

# KEYS: procs. ARGV: token, client id. Remove the entry only while it still names that connection.
FORGET: Final = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


def refused(exc: redis.ResponseError) -> bool:
    """Whether Redis refuses a command for good: an ACL without it, or a command renamed or disabled (managed
    Redis services often disable CLIENT). A READONLY reply during a failover is not."""
    return isinstance(exc, redis.exceptions.NoPermissionError) or "unknown command" in str(exc).lower()


def presence_token() -> str:
    """A worker runtime's presence token: host, pid and a random part (unique even when a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_token(presence: str) -> str:
    """A claim's owner token, `host:pid:thread:<presence mark>.<claim random>`, naming its runtime's presence.

    The pid is this process's own: a prefork pool child shares its main process's presence token (the
    runtime was made before the fork), and its claims still name the child that runs them.
    """
    host, _, mark = presence.rsplit(":", 2)  # the host named once, as the presence token was made (no uname per claim)
    return f"{host}:{os.getpid()}:{threading.get_ident()}:{mark}.{uuid.uuid4().hex[:12]}"


def owner_mark(owner: str) -> str | None:
    """The presence mark (the random part of a presence token) an owner token names, or None (a token
    written before presence existed)."""
    parts = owner.rsplit(":", 3)
    if len(parts) != 4:
        return None
    mark, dot, _ = parts[3].partition(".")
    return mark if dot and mark else None


def owns(presence: str, owner: str) -> bool:
    """Whether `owner` is the owner token of a claim made under the presence token `presence`."""
    return owner_mark(owner) == presence.rsplit(":", 1)[-1]


@dataclass
class Presence:
    """The worker side: one connection kept open and named in `{ns}:procs` under `token`."""

    client: redis.Redis  # a client holding one connection of its own (`single_connection_client`)
    keys: Keys
    token: str
    interval_s: float
    _named: int | None = None  # the connection id last written
    _pings: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _failing: bool = False

    def start(self) -> None:
        """Name the connection now (best effort), then ping from a daemon thread."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="forkq-presence", daemon=True)
        self._thread.start()

    def beat(self) -> bool:
        """One ping (`CLIENT ID`); names the connection again when it changed (a reconnect). False on a Redis error."""
        try:
            cid = self.client.client_id()
            self._pings += 1
            if cid != self._named or self._pings % RENAME_EVERY == 0:
                self.client.hset(self.keys.procs, self.token, cid)
                self._named = cid
        except redis.ResponseError as exc:
            if not refused(exc):  # READONLY during a failover, a script error: retried like a dropped connection
                return self._failed(exc)
            log.warning(
                "worker presence off: Redis refused %s; a sweeper revives this worker's forks only when their leases "
                "expire. Allow CLIENT ID and HSET for forkq's Redis user (ACL +client|id +hset)",
                exc,
            )
            self._stop.set()
            return False
        except redis.RedisError as exc:
            return self._failed(exc)
        if self._failing:
            log.warning("worker presence: connection %d named again", cid)
        self._failing = False
        return True

    def _failed(self, exc: redis.RedisError) -> bool:
        if not self._failing:
            log.warning("worker presence: Redis unreachable (%s); reconnecting every %.2f s", exc, self.interval_s)
        self._failing = True
        self._named = None
        return False

    def _run(self) -> None:
        # a fixed interval, no backoff: after a drop the worker must name its new connection before the grace ends
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        """Stop pinging and remove the entry (a worker that shuts down releases its forks itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
        if self._named is not None:
            try:
                self.client.eval(FORGET, 1, self.keys.procs, self.token, self._named)
            except redis.RedisError as exc:  # a sweeper removes it once the connection is gone
                log.warning("worker presence: entry not removed (%s)", exc)
        self.client.close()


@dataclass
class PresenceWatch:
    """The sweeper side: which worker runtimes have lost their named connection for longer than `grace_s`."""

    client: redis.Redis
    keys: Keys
    grace_s: float
    # presence token -> (the connection id it names, when that connection was first seen gone: monotonic)
    _missing: dict[str, tuple[int, float]] = field(default_factory=dict)
    _list_by_id: bool = True  # CLIENT LIST ID (Redis 6.2); else the whole CLIENT LIST

    def dead(self) -> list[tuple[str, int]]:
        """One look (two round trips): the (token, connection id) of every runtime gone for `grace_s`.

        A runtime's connection is gone once when it is not listed; `grace_s` later, if the runtime has named
        no new connection meanwhile, it is dead.

        A Redis error forgets every observation (and is raised): a sweeper that lost its own connection
        cannot tell which others dropped with it.
        """
        try:
            return self._look()
        except redis.RedisError:
            self._missing.clear()
            raise

    def _look(self) -> list[tuple[str, int]]:
        named_raw = cast(dict[bytes, bytes], self.client.hgetall(self.keys.procs))
        named = {k.decode(errors="replace"): int(v) for k, v in named_raw.items() if v.isdigit() and len(v) < 20}
        if not named:
            self._missing.clear()
            return []
        alive = self._connected(sorted(set(named.values())))
        now = time.monotonic()
        dead: list[tuple[str, int]] = []
        for token, cid in named.items():
            if cid in alive:
                self._missing.pop(token, None)
                continue
            seen = self._missing.get(token)
            if seen is None or seen[0] != cid:  # first seen gone, or the runtime named a new connection since
                self._missing[token] = (cid, now)
            elif now - seen[1] >= self.grace_s:
                dead.append((token, cid))
        for token in set(self._missing) - set(named):
            del self._missing[token]
        return dead

    def _connected(self, ids: list[int]) -> set[int]:
        """Which of these client ids Redis has connected now."""
        listing: list[dict[str, str]] = []
        if self._list_by_id:
            try:
                listing = self.client.client_list(client_id=list(ids))
            except redis.ResponseError:  # before Redis 6.2: the whole list, filtered here
                self._list_by_id = False
        if not self._list_by_id:
            listing = self.client.client_list()
        return {int(entry["id"]) for entry in listing} & set(ids)

    def forget(self, token: str, cid: int) -> None:
        """Remove a dead runtime's entry, unless it named a new connection meanwhile."""
        self.client.eval(FORGET, 1, self.keys.procs, token, cid)
        self._missing.pop(token, None)

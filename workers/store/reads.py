"""Reads of a fork's records, written once for the blocking client and the asyncio server (sans-IO).

Each read is a generator: it yields the Redis commands it needs next (one batch, one round trip),
is sent their replies, and returns what they mean. It does no I/O itself, so the key of every
record, the decoding of every reply and every read of several steps (a record and its chunks, a
session's forks, a wait for the end) are written once; `run` drives a read with `redis.Redis`
(`ForkStore`, `ForkClient`), `run_async` with `redis.asyncio.Redis` (`AsyncForkReader`, `forkq serve`).
A generator over commands, not a function over a connection: the two clients differ only in whether a
reply is awaited, and a function that calls the connection would have to be written twice for that.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar, cast

import redis

from broker_config.settings import DEFAULT_TENANT
from workers.base import codec
from workers.base.keys import Keys
from workers.errors import ForkNotFound, RecordDecodeError
from workers.records.fork import BootstrapRecord, ForkResult, ForkState, Status
from workers.records.journal import JournalEntry

if TYPE_CHECKING:  # a type only: the blocking client never loads redis.asyncio
    import redis.asyncio

T = TypeVar("T")

BLOCK_MAX_MS: Final = 1000  # a wait re-reads the result at least this often (a result with no event cannot hide)
EMPTY: Final[Mapping[str, object]] = MappingProxyType({})  # no keyword arguments (read-only: shared by commands)


class Command(NamedTuple):
    """One Redis command as a redis-py method call: the same on both clients and on their pipelines."""

    method: str
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] = EMPTY


# an event as the stream holds it: its id and fields (`workers.store.forks.decode_event` gives its meaning)
StreamEntry = tuple[bytes, dict[bytes, bytes]]
# yields a batch of commands, is sent their replies (in order), returns the read's value
Read = Generator[list[Command], list[Any], T]


def run(client: redis.Redis, read: Read[T]) -> T:
    """Drive `read` with a blocking client: each batch in one round trip (a pipeline for several commands)."""
    try:
        batch = next(read)
        while True:
            if len(batch) == 1:
                replies = [getattr(client, batch[0].method)(*batch[0].args, **batch[0].kwargs)]
            else:
                pipe = client.pipeline(transaction=False)
                for command in batch:
                    getattr(pipe, command.method)(*command.args, **command.kwargs)
                replies = pipe.execute()
            batch = read.send(replies)
    except StopIteration as done:
        return cast(T, done.value)


async def run_async(client: redis.asyncio.Redis, read: Read[T]) -> T:
    """Drive `read` with an asyncio client, as `run` does: a read waiting on Redis holds no thread."""
    try:
        batch = next(read)
        while True:
            if len(batch) == 1:
                replies = [await getattr(client, batch[0].method)(*batch[0].args, **batch[0].kwargs)]
            else:
                pipe = client.pipeline(transaction=False)
                for command in batch:
                    getattr(pipe, command.method)(*command.args, **command.kwargs)
                replies = await pipe.execute()
            batch = read.send(replies)
    except StopIteration as done:
        return cast(T, done.value)


# ── one fork ──────────────────────────────────────────────────────────────────────────────────


def not_found(fork_id: str) -> ForkNotFound:
    """The error for a fork that is not in Redis."""
    return ForkNotFound(f"fork {fork_id}: not found (never launched, or past its retention)", fork_id=fork_id)


def no_record(fork_id: str) -> ForkNotFound:
    """The error for a fork whose bootstrap record is not in Redis."""
    return ForkNotFound(f"fork {fork_id}: no bootstrap record in Redis (never launched, or expired)", fork_id=fork_id)


def state_of(fork_id: str, fields: Mapping[bytes, bytes]) -> ForkState:
    """A `ForkState` from its hash as HGETALL returns it."""
    return ForkState.from_hash(fork_id, {k.decode(): v.decode() for k, v in fields.items()})


def state(keys: Keys, fork_id: str) -> Read[ForkState]:
    """The fork's current state (ForkNotFound if there is none)."""
    (fields,) = yield [Command("hgetall", (keys.state(fork_id),))]
    if not fields:
        raise not_found(fork_id)
    return state_of(fork_id, fields)


def status(keys: Keys, fork_id: str) -> Read[Status | None]:
    """The fork's status alone, or None when it is not in Redis."""
    (value,) = yield [Command("hget", (keys.state(fork_id), "status"))]
    return None if value is None else Status(cast(bytes, value).decode())


def result(keys: Keys, fork_id: str) -> Read[ForkResult | None]:
    """The final result, or None while the fork has not ended."""
    (data,) = yield [Command("get", (keys.result(fork_id),))]
    return None if data is None else ForkResult.decode(cast(bytes, data), fork_id=fork_id)


def events(
    keys: Keys, fork_id: str, *, after: str = "0-0", block_ms: int | None = None, count: int = 1000
) -> Read[list[StreamEntry]]:
    """Event entries after stream id `after`; with `block_ms` (1 or more), wait up to that long for new ones."""
    (reply,) = yield [Command("xread", ({keys.events(fork_id): after},), {"count": count, "block": block_ms})]
    return [(eid, fields) for _, entries in reply or [] for eid, fields in entries]


def latest_events(keys: Keys, fork_id: str, *, count: int) -> Read[list[StreamEntry]]:
    """The fork's newest `count` event entries, newest first."""
    (reply,) = yield [Command("xrevrange", (keys.events(fork_id),), {"count": count})]
    return [(eid, fields) for eid, fields in reply]


def journal(keys: Keys, fork_id: str) -> Read[list[JournalEntry]]:
    """Every journal entry of the fork, in order."""
    (raw,) = yield [Command("lrange", (keys.journal(fork_id), 0, -1))]
    return [JournalEntry.decode(item, fork_id=fork_id) for item in raw]


def record(keys: Keys, fork_id: str, digest_hex: str | None) -> Read[BootstrapRecord]:
    """The bootstrap record with its context (not its seed), verified against `digest_hex` when given.

    Raises:
        ForkNotFound: no record (never launched, or past retention).
        RecordIntegrityError: the stored bytes or context do not match their digests.
    """
    (data,) = yield [Command("get", (keys.bootstrap(fork_id),))]
    if data is None:
        raise no_record(fork_id)
    named = BootstrapRecord.chunk_refs(data, fork_id=fork_id)
    wanted = named.refs[: 2 if named.indexed else 1]  # the context, and the seed index when the record has one
    (found,) = yield [Command("mget", ([keys.chunk(named.parent_session, d.hex()) for d in wanted],))]
    context, index = found[0] or b"", (found[1] if named.indexed else None) or b""
    return BootstrapRecord.decode(data, fork_id=fork_id, context=context, index=index, expected_digest=digest_hex)


def ended(keys: Keys, fork_id: str, *, deadline: float | None) -> Read[ForkResult | ForkState]:
    """The result once the fork has ended, waiting until `deadline` (`time.monotonic()`; None: no limit); else
    its state: at once for a parked fork (`awaiting_approval`, `paused`: only a person ends its wait), or once
    the deadline has passed. Each round reads the newest event id, the result and the state in one round trip,
    then blocks for the next event (at most `BLOCK_MAX_MS`). Raises ForkNotFound.
    """
    while True:
        # the event id before the result: the event of a result written next is then seen
        newest, data, fields = yield [
            Command("xrevrange", (keys.events(fork_id),), {"count": 1}),
            Command("get", (keys.result(fork_id),)),
            Command("hgetall", (keys.state(fork_id),)),
        ]
        if data is not None:
            return ForkResult.decode(data, fork_id=fork_id)
        if not fields:
            raise not_found(fork_id)
        now = state_of(fork_id, fields)
        # at most a second per read, computed in seconds first: a deadline 1e308 s away must not overflow
        left_ms = BLOCK_MAX_MS if deadline is None else int(min(deadline - time.monotonic(), 1.0) * 1000)
        if now.status.parked or left_ms <= 0:
            return now
        after = cast(bytes, newest[0][0]).decode() if newest else "0-0"
        yield [Command("xread", ({keys.events(fork_id): after},), {"count": 1, "block": max(1, left_ms)})]


# ── a parent session ──────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class SessionFork:
    """One fork of a parent session, as a listing shows it."""

    fork_id: str
    kind: str
    name: str | None
    description: str
    status: str
    created_ms: int | None
    updated_ms: int | None
    tenant: str = DEFAULT_TENANT


def session_forks(keys: Keys, parent_session: str, *, limit: int) -> Read[list[SessionFork]]:
    """The newest `limit` forks launched from a parent session that are still in Redis, newest first."""
    (members,) = yield [Command("zrevrange", (keys.session_forks(parent_session), 0, limit - 1))]
    ids = [cast(bytes, member).decode() for member in members]
    if not ids:
        return []
    replies = yield [
        command
        for fid in ids
        for command in (
            Command("hgetall", (keys.state(fid),)),
            Command("get", (keys.bootstrap(fid),)),
            Command("xrevrange", (keys.events(fid),), {"count": 1}),
        )
    ]
    forks = []
    for i, fid in enumerate(ids):
        fields, data, newest = replies[3 * i : 3 * i + 3]
        if fields:  # past its retention: the index outlives it until the next launch trims it
            forks.append(session_fork(fid, fields, data, newest))
    return forks


def session_fork(fork_id: str, fields: dict[bytes, bytes], data: bytes | None, newest: list[Any]) -> SessionFork:
    """One fork of a session listing, from its state hash, bootstrap record and newest event."""
    now = state_of(fork_id, fields)
    # the newest event's stream id starts with the milliseconds Redis recorded it at
    updated = int(newest[0][0].split(b"-", 1)[0]) if newest else now.finished_ms or now.started_ms or now.created_ms
    return SessionFork(
        fork_id=fork_id,
        kind=now.kind,
        name=_record_name(fork_id, data),
        description=now.description,
        status=now.status.value,
        created_ms=now.created_ms,
        updated_ms=updated,
        tenant=now.tenant,
    )


def _record_name(fork_id: str, data: bytes | None) -> str | None:
    """The teammate name a bootstrap record keeps (None for none, or for a record that cannot be read)."""
    if data is None:
        return None
    try:
        fields = codec.decode(data, what=f"fork {fork_id}: bootstrap record")
    except RecordDecodeError:
        return None
    name = fields.get("name") if isinstance(fields, dict) else None
    return name if isinstance(name, str) else None

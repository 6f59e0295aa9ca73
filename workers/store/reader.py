"""Reads of forks with `redis.asyncio`, for a server that follows many forks at once (`forkq serve`).

A reader waiting for a fork's events blocks in `XREAD BLOCK` on one connection, never on a thread,
so a thousand followers fit in one process. Every read is of the records `ForkStore` writes and
decodes them the same way: a state here is what `ForkStore.state` returns, an event what
`ForkStore.events` returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final, cast

import redis.asyncio

from workers.base import codec
from workers.base.keys import Keys
from workers.errors import ForkNotFound, RecordDecodeError
from workers.records.fork import BootstrapRecord, ForkResult, ForkState, Status
from workers.records.journal import JournalEntry
from workers.store.forks import ForkEvent, decode_event

BLOCK_MAX_MS: Final = 1000  # a wait re-reads the result at least this often (a result with no event cannot hide)
PARKED: Final = (Status.AWAITING_APPROVAL, Status.PAUSED)


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


class AsyncForkReader:
    """A fork's state, result, events, journal and record, and a session's forks, read without a thread."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    async def state(self, fork_id: str) -> ForkState:
        """The fork's current state (ForkNotFound if there is none)."""
        fields = cast(dict[bytes, bytes], await self.client.hgetall(self.keys.state(fork_id)))
        if not fields:
            raise not_found(fork_id)
        return ForkState.from_hash(fork_id, {k.decode(): v.decode() for k, v in fields.items()})

    async def status(self, fork_id: str) -> Status | None:
        """The fork's status alone, or None when it is not in Redis."""
        value = cast(bytes | None, await self.client.hget(self.keys.state(fork_id), "status"))
        return None if value is None else Status(value.decode())

    async def result(self, fork_id: str) -> ForkResult | None:
        """The final result, or None while the fork has not ended."""
        data = cast(bytes | None, await self.client.get(self.keys.result(fork_id)))
        return None if data is None else ForkResult.decode(data, fork_id=fork_id)

    async def last_event_id(self, fork_id: str) -> str:
        """The id of the fork's newest event (`0-0` for none): a wait reads what comes after it."""
        newest = cast(list[Any], await self.client.xrevrange(self.keys.events(fork_id), count=1))
        return cast(bytes, newest[0][0]).decode() if newest else "0-0"

    async def events(
        self, fork_id: str, *, after: str = "0-0", block_ms: int | None = None, count: int = 100
    ) -> list[ForkEvent]:
        """Events after stream id `after`; with `block_ms` (1 or more), wait up to that long for new ones."""
        key = self.keys.events(fork_id)
        reply = cast(list[Any], await self.client.xread({key: after}, count=count, block=block_ms))
        return [decode_event(eid, fields) for _, entries in reply or [] for eid, fields in entries]

    async def result_within(self, fork_id: str, wait_s: float) -> ForkResult | ForkState:
        """The result once the fork has ended, waiting up to `wait_s` seconds; else its state.

        A parked fork (`awaiting_approval`, `paused`) ends only after a person acts: its state comes
        back at once. Raises ForkNotFound.
        """
        deadline = time.monotonic() + wait_s
        while True:
            after = await self.last_event_id(fork_id)  # before the result: the event of a result written next is seen
            result = await self.result(fork_id)
            if result is not None:
                return result
            state = await self.state(fork_id)
            left_ms = int(min(deadline - time.monotonic(), BLOCK_MAX_MS / 1000) * 1000)
            if state.status in PARKED or left_ms <= 0:
                return state
            await self.events(fork_id, after=after, block_ms=left_ms, count=1)

    async def journal(self, fork_id: str) -> list[JournalEntry]:
        """Every journal entry of the fork, in order."""
        raw = cast(list[bytes], await self.client.lrange(self.keys.journal(fork_id), 0, -1))
        return [JournalEntry.decode(item, fork_id=fork_id) for item in raw]

    async def record(self, fork_id: str, digest_hex: str | None) -> BootstrapRecord:
        """The bootstrap record with its context (not its seed), verified against `digest_hex` when given.

        Raises:
            ForkNotFound: no record (never launched, or past retention).
            RecordIntegrityError: the stored bytes or context do not match their digests.
        """
        data = cast(bytes | None, await self.client.get(self.keys.bootstrap(fork_id)))
        if data is None:
            raise not_found(fork_id)
        named = BootstrapRecord.chunk_refs(data, fork_id=fork_id)
        wanted = named.refs[: 2 if named.indexed else 1]  # the context, and the seed index when the record has one
        found = cast(
            list[bytes | None], await self.client.mget([self.keys.chunk(named.parent_session, d.hex()) for d in wanted])
        )
        context, index = found[0] or b"", (found[1] if named.indexed else None) or b""
        return BootstrapRecord.decode(data, fork_id=fork_id, context=context, index=index, expected_digest=digest_hex)

    async def session_forks(self, parent_session: str, *, limit: int) -> list[SessionFork]:
        """The newest `limit` forks launched from a parent session that are still in Redis, newest first."""
        members = cast(list[bytes], await self.client.zrevrange(self.keys.session_forks(parent_session), 0, limit - 1))
        ids = [member.decode() for member in members]
        pipe = self.client.pipeline(transaction=False)
        for fid in ids:
            pipe.hgetall(self.keys.state(fid))
            pipe.get(self.keys.bootstrap(fid))
            pipe.xrevrange(self.keys.events(fid), count=1)
        replies = await pipe.execute()
        forks = []
        for i, fid in enumerate(ids):
            state, record, newest = replies[3 * i : 3 * i + 3]
            if state:  # past its retention: the index outlives it until the next launch trims it
                forks.append(session_fork(fid, state, record, newest))
        return forks


def not_found(fork_id: str) -> ForkNotFound:
    """The error for a fork that is not in Redis (the message `ForkStore` gives)."""
    return ForkNotFound(f"fork {fork_id}: not found (never launched, or past its retention)", fork_id=fork_id)


def session_fork(fork_id: str, fields: dict[bytes, bytes], record: bytes | None, newest: list[Any]) -> SessionFork:
    """One fork of a session listing, from its state hash, bootstrap record and newest event (`ForkClient.list` too)."""
    state = ForkState.from_hash(fork_id, {k.decode(): v.decode() for k, v in fields.items()})
    updated = decode_event(*newest[0]).at_ms if newest else state.finished_ms or state.started_ms or state.created_ms
    return SessionFork(
        fork_id=fork_id,
        kind=state.kind,
        name=_record_name(fork_id, record),
        description=state.description,
        status=state.status.value,
        created_ms=state.created_ms,
        updated_ms=updated,
    )


def _record_name(fork_id: str, record: bytes | None) -> str | None:
    """The teammate name a bootstrap record keeps (None for none, or for a record that cannot be read)."""
    if record is None:
        return None
    try:
        fields = codec.decode(record, what=f"fork {fork_id}: bootstrap record")
    except RecordDecodeError:
        return None
    name = fields.get("name") if isinstance(fields, dict) else None
    return name if isinstance(name, str) else None

"""Reads of forks with `redis.asyncio`, for a server that follows many forks at once (`forkq serve`).

A reader waiting for a fork's events blocks in `XREAD BLOCK` on one connection, never on a thread,
so a thousand followers fit in one process. Every read is one of `workers.store.reads`, the reads
`ForkStore` and `ForkClient` run on a blocking client: a state here is what `ForkStore.state` returns,
an event what `ForkStore.events` returns, a session's listing what `ForkClient.list` shows.
"""

from __future__ import annotations

import time

import redis.asyncio

from workers.base.keys import Keys
from workers.records.events import StreamEvent, decode_event  # a server reads events: no reason to defer them
from workers.records.fork import BootstrapRecord, ForkResult, ForkState, Status
from workers.records.journal import JournalEntry
from workers.store import reads
from workers.store.reads import SessionFork


class AsyncForkReader:
    """A fork's state, result, events, journal and record, and a session's forks, read without a thread."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    async def state(self, fork_id: str) -> ForkState:
        """The fork's current state (ForkNotFound if there is none)."""
        return await reads.run_async(self.client, reads.state(self.keys, fork_id))

    async def status(self, fork_id: str) -> Status | None:
        """The fork's status alone, or None when it is not in Redis."""
        return await reads.run_async(self.client, reads.status(self.keys, fork_id))

    async def result(self, fork_id: str) -> ForkResult | None:
        """The final result, or None while the fork has not ended."""
        return await reads.run_async(self.client, reads.result(self.keys, fork_id))

    async def events(
        self, fork_id: str, *, after: str = "0-0", block_ms: int | None = None, count: int = 100
    ) -> list[StreamEvent]:
        """Events after stream id `after`; with `block_ms` (1 or more), wait up to that long for new ones."""
        read = reads.events(self.keys, fork_id, after=after, block_ms=block_ms, count=count)
        return [decode_event(*entry) for entry in await reads.run_async(self.client, read)]

    async def result_within(self, fork_id: str, wait_s: float) -> ForkResult | ForkState:
        """The result once the fork has ended, waiting up to `wait_s` seconds; else its state.

        A parked fork (`awaiting_approval`, `paused`) ends only after a person acts: its state comes
        back at once. Raises ForkNotFound.
        """
        read = reads.ended(self.keys, fork_id, deadline=time.monotonic() + wait_s)
        return await reads.run_async(self.client, read)

    async def journal(self, fork_id: str) -> list[JournalEntry]:
        """Every journal entry of the fork, in order."""
        return await reads.run_async(self.client, reads.journal(self.keys, fork_id))

    async def record(self, fork_id: str, digest_hex: str | None) -> BootstrapRecord:
        """The bootstrap record with its context (not its seed), verified against `digest_hex` when given.

        Raises:
            ForkNotFound: no record (never launched, or past retention).
            RecordIntegrityError: the stored bytes or context do not match their digests.
        """
        return await reads.run_async(self.client, reads.record(self.keys, fork_id, digest_hex))

    async def session_forks(self, parent_session: str, *, limit: int) -> list[SessionFork]:
        """The newest `limit` forks launched from a parent session that are still in Redis, newest first."""
        return await reads.run_async(self.client, reads.session_forks(self.keys, parent_session, limit=limit))

"""Cancelling a whole parent session: every fork launched from it, nested subagents included, and its tombstone.

A nested subagent is launched with its caller's parent session (`workers.service.spawn`), so the session's fork
index holds it too. The cancel first writes the session's tombstone, then reads the index: a launch into the
session checks the tombstone atomically with its write to the index (`fork_scripts.LAUNCH`), so one racing the
cancel either landed before the tombstone (and is in the index the cancel reads) or is refused. The forks are
cancelled in batches of `BATCH` (three pipelined round trips each, `ForkStore.cancel_many`), oldest first: callers
before the subagents they launched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final, cast

from pydantic import BaseModel, Field

from workers.store import fork_scripts
from workers.store.forks import Cancel, ForkStore

BATCH: Final = 200  # forks per batch: bounds the journals one batch reads at once


class SessionCancel(BaseModel):
    """What a session cancel did: the forks it cancelled (ids, oldest first) and how many had already ended."""

    session: str
    cancelled: int = Field(description="Forks this cancel ended (the length of `forks`).")
    forks: list[str] = Field(description="The ids of the forks this cancel ended, oldest first.")
    already_ended: int = Field(description="Forks of the session that had ended before (succeeded, failed, cancelled).")
    refused_until_ms: int = Field(
        description="Launches into the session are refused until then (Unix ms, Redis's clock): its tombstone."
    )


def cancel_session(store: ForkStore, session: str, *, tombstone_s: int) -> tuple[SessionCancel, dict[str, Cancel]]:
    """Write the session's tombstone, then cancel every fork of the session; what it did, and each fork's cancel.

    Raises:
        ValueError: `session` is not a parent session id (`workers.base.keys.SESSION_RE`).
    """
    keys = store.keys
    tombstone = store.client.register_script(fork_scripts.TOMBSTONE)
    index = keys.session_forks(session)
    until_ms, size = cast(list[int], tombstone(keys=[keys.session_cancelled(session), index], args=[tombstone_s]))
    cancels: dict[str, Cancel] = {}
    for batch in _batches(store, index, int(size)):
        cancels |= store.cancel_many(batch)
    forks = [fid for fid, cancel in cancels.items() if cancel.newly]
    ended = sum(1 for cancel in cancels.values() if not cancel.newly and cancel.after is not None)
    outcome = SessionCancel(
        session=session, cancelled=len(forks), forks=forks, already_ended=ended, refused_until_ms=int(until_ms)
    )
    return outcome, cancels


def _batches(store: ForkStore, index: str, size: int) -> Iterator[list[str]]:
    """The index's fork ids, oldest first, `BATCH` at a time. No launch adds to it once the tombstone is written,
    so reading it by rank in pages sees each fork once."""
    for start in range(0, size, BATCH):
        members = cast(list[bytes], store.client.zrange(index, start, start + BATCH - 1))
        if members:
            yield [member.decode() for member in members]

"""The words the store's Lua scripts answer, as enums, and the one reading of each script's reply.

A script answers one word (a claim a list that starts with one). Besides the fork's `Status` (a script that
finds the fork in a state it does not act on answers that status), each word belongs to one of these enums.
`workers.store.script_parts` writes every word a script answers or stores as a Lua constant made from
these enums and `Status`, so the words in Redis and the words compared here are the same values.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final, TypeVar

from workers.errors import RecordDecodeError
from workers.records.fork import Status
from workers.records.parked import AdmissionLimit

E = TypeVar("E", bound=enum.StrEnum)


class Written(enum.StrEnum):
    """A script that took effect (or whose first attempt had): what it did."""

    OK = "ok"  # journal entries appended (and events published)
    MAIL = "mail"  # as `ok`, and messages wait in the fork's inbox
    CLAIMED = "claimed"  # the fork's lease taken
    FINISHED = "finished"  # the result written, the lease ended
    CONTINUED = "continued"  # a fork that would succeed has mail: queued again instead of finished
    RELEASED = "released"  # the lease given back (released, paused or parked)
    RESUMED = "resumed"  # a paused fork queued again
    CREATED = "created"  # a launch wrote the fork's record and state
    EXISTS = "exists"  # a launch found this very record written (a retried launch)


class RefusalReason(enum.StrEnum):
    """Why a claim took nothing."""

    MISSING = "missing"  # no such fork (never launched, or past its retention)
    FORGED = "forged"  # the delivery's digest is not the fork's launch digest (the fork is left untouched)
    LEASED = "leased"  # queued, but another worker holds its lease
    NOT_QUEUED = "not_queued"  # running, finished, cancelled or parked: `Refusal.status` says which


class Refused(enum.StrEnum):
    """A script that wrote nothing, for a reason other than the fork's status."""

    MISSING = "missing"  # no such fork (never launched, or past its retention)
    STALE = "stale"  # another epoch: the fork was claimed again since
    LOST = "lost"  # another owner holds the lease
    SEQ = "seq"  # the journal is not at the expected length
    INBOX = "inbox"  # the inbox no longer starts with the messages to deliver
    UNKNOWN_CALL = "unknown_call"  # no pending call has the decided call id
    CONFLICT = "conflict"  # a launch found another record under its fork id
    SESSION_CANCELLED = "session_cancelled"  # a launch into a session whose tombstone exists (a session cancel)


class Revival(enum.StrEnum):
    """The sweeper's check of one fork, besides its status (`failed`: its worker was lost too often)."""

    REVIVE = "revive"  # now queued: enqueue it
    REQUEUE = "requeue"  # revived earlier and its job never confirmed: enqueue it again
    ALIVE = "alive"  # its lease still holds
    GRACE = "grace"  # its lease lapsed moments ago: left to its worker to take back


class SendReply(enum.StrEnum):
    """What `ForkStore.send` did with a message: queued or continued, else why it refused it."""

    QUEUED = "queued"  # in the inbox of a fork that runs, waits or is parked
    CONTINUED = "continued"  # a succeeded fork queued again for its next exchange: the caller sends its job
    FULL = "full"  # the inbox holds the most messages it keeps
    SESSION_CANCELLED = "session_cancelled"  # a succeeded fork of a session cancelled moments ago: not continued
    MISSING = "missing"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Decision(enum.StrEnum):
    """What a person's decision on a parked call did to the fork."""

    RECORDED = "recorded"  # recorded; other calls still wait
    QUEUED = "queued"  # the last call decided: the fork goes on (queued again)

    @classmethod
    def after(cls, status: Status) -> Decision:
        """The decision's outcome from the fork's status after it (`queued`, or still `awaiting_approval`)."""
        return cls.QUEUED if status is Status.QUEUED else cls.RECORDED


class Admitted(enum.StrEnum):
    """What an admission script did with a model call (`workers.store.admission`)."""

    GRANTED = "granted"  # the call may go out now
    LATER = "later"  # queued: its process learns of the grant later


FencedReply = Written | Refused | Status
RevivalReply = Revival | Refused | Status

# every word a script may answer, by its value (the vocabularies share no value)
_FENCED: Final[dict[str, FencedReply]] = {m.value: m for kind in (Written, Refused, Status) for m in kind}
_REVIVAL: Final[dict[str, RevivalReply]] = {m.value: m for kind in (Revival, Refused, Status) for m in kind}


def _unknown(word: str, script: str, fork_id: str, expected: Iterable[str]) -> RecordDecodeError:
    shown = ", ".join(sorted(expected))
    return RecordDecodeError(
        f"fork {fork_id}: the {script} script answered {word[:80]!r}, expected one of {shown}; the script and "
        "this process disagree (run workers and clients of one forkq version)",
        fork_id=fork_id,
    )


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def fenced_reply(raw: bytes | str, *, script: str, fork_id: str) -> FencedReply:
    """A fenced write's (or emit's) answer: what it wrote, why it refused, or the status it found.

    Raises:
        RecordDecodeError: the word is none of those.
    """
    word = _text(raw)
    found = _FENCED.get(word)
    if found is None:
        raise _unknown(word, script, fork_id, _FENCED)
    return found


def revival_reply(raw: bytes | str, *, fork_id: str) -> RevivalReply:
    """The sweeper's check of one fork: a `Revival`, `missing`, or the fork's status.

    Raises:
        RecordDecodeError: the word is none of those.
    """
    word = _text(raw)
    found = _REVIVAL.get(word)
    if found is None:
        raise _unknown(word, "revive", fork_id, _REVIVAL)
    return found


def word_of(kind: type[E], raw: bytes | str, *, script: str, fork_id: str) -> E:
    """The script's answer as a member of `kind`.

    Raises:
        RecordDecodeError: the word is not one of `kind`'s.
    """
    word = _text(raw)
    try:
        return kind(word)
    except ValueError:
        raise _unknown(word, script, fork_id, [m.value for m in kind]) from None


# every enum whose words a Lua script answers or stores, in the order their constants are resolved
LUA_WORDS: Final[tuple[type[enum.StrEnum], ...]] = (
    Status,
    Written,
    Refused,
    RefusalReason,
    Revival,
    SendReply,
    Decision,
    Admitted,
    AdmissionLimit,
)

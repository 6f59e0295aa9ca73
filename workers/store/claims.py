"""What a claim of a fork gets besides a `Claim`: a `Refusal` saying why it took nothing; and what a first
claim writes with it (`FirstWrite`), prepared by the worker from the job before it claims."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from workers.errors import RecordDecodeError
from workers.records.fork import Status
from workers.records.journal import JournalEntry
from workers.store.replies import RefusalReason

if TYPE_CHECKING:  # a type only: the event models load at the first event read or written
    from workers.records.events import ModelCallEvent


NOT_QUEUED: Final = tuple(s.value for s in Status if s is not Status.QUEUED)  # what a refused claim may find


@dataclass(frozen=True, slots=True)
class Refusal:
    """A claim that took nothing: why, and for a fork that is not queued, its status."""

    reason: RefusalReason
    status: Status | None = None  # NOT_QUEUED only

    @classmethod
    def from_reply(cls, word: str, *, fork_id: str) -> Refusal:
        """The refusal the claim script answered for `fork_id`: `missing`, `forged`, `leased`, or the fork's status.

        Raises:
            RecordDecodeError: the word is none of those (a claim script of another version, or a damaged state).
        """
        if word in (RefusalReason.MISSING, RefusalReason.FORGED, RefusalReason.LEASED):
            return cls(RefusalReason(word))
        if word in NOT_QUEUED:
            return cls(RefusalReason.NOT_QUEUED, Status(word))
        expected = ", ".join([RefusalReason.MISSING, RefusalReason.FORGED, RefusalReason.LEASED, *NOT_QUEUED])
        raise RecordDecodeError(
            f"fork {fork_id}: the claim answered {word[:80]!r}, expected one of {expected}; the claim script "
            "and this worker disagree (run workers and Redis scripts of one forkq version)",
            fork_id=fork_id,
        )

    @property
    def word(self) -> str:
        """The script's own word for it: the fork's status, or `missing`, `forged`, `leased`."""
        return self.reason.value if self.status is None else self.status.value


@dataclass(frozen=True, slots=True)
class FirstWrite:
    """What a first claim writes before the first model call, built from the record it checks against."""

    record: bytes  # the stored record bytes it was built from (the claim primes only if they are the fork's)
    surface: JournalEntry  # the tool surface entry (journal entry 0)
    model_call: ModelCallEvent  # the first `model_call` event

"""What a claim of a fork gets besides a `Claim`: a `Refusal` saying why it took nothing; and what a first
claim writes with it (`FirstWrite`), prepared by the worker from the job before it claims."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from workers.records.fork import Status
from workers.records.journal import JournalEntry


class RefusalReason(enum.StrEnum):
    """Why a claim took nothing."""

    MISSING = "missing"  # no such fork (never launched, or past its retention)
    FORGED = "forged"  # the delivery's digest is not the fork's launch digest (the fork is left untouched)
    LEASED = "leased"  # queued, but another worker holds its lease
    NOT_QUEUED = "not_queued"  # running, finished, cancelled or parked: `Refusal.status` says which


@dataclass(frozen=True, slots=True)
class Refusal:
    """A claim that took nothing: why, and for a fork that is not queued, its status."""

    reason: RefusalReason
    status: Status | None = None  # NOT_QUEUED only

    @classmethod
    def from_reply(cls, word: str) -> Refusal:
        """The refusal the claim script answered: `missing`, `forged`, `leased`, or the fork's status."""
        if word in (RefusalReason.MISSING, RefusalReason.FORGED, RefusalReason.LEASED):
            return cls(RefusalReason(word))
        return cls(RefusalReason.NOT_QUEUED, Status(word))

    @property
    def word(self) -> str:
        """The script's own word for it: the fork's status, or `missing`, `forged`, `leased`."""
        return self.reason.value if self.status is None else self.status.value


@dataclass(frozen=True, slots=True)
class FirstWrite:
    """What a first claim writes before the first model call, built from the record it checks against."""

    record: bytes  # the stored record bytes it was built from (the claim primes only if they are the fork's)
    surface: JournalEntry  # the tool surface entry (journal entry 0)
    model_call: dict[str, Any]  # the first `model_call` event's data

"""How one `run_fork` delivery ended: the runner's typed answer, the task's return value, and its Flower event.

A delivery either claimed the fork and ran it (its run ended `succeeded`, `failed`, `cancelled`, parked
`paused` or `awaiting_approval`, `released` at a worker's shutdown, or `lease_lost`), or claimed nothing
(`duplicate` of a fork that is not queued, `handed_back` by a stopping worker, `refused` or `rejected`).
The task returns the outcome's text (`succeeded`, `duplicate:running`, `refused:RecordIntegrityError`):
Celery hands its worker only that value's repr for the final task event, so `RunOutcome.from_wire` is the
one way back from the text, and the text and the event names are fixed words on the wire.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class Outcome(enum.StrEnum):
    """What happened to a delivery; the value is its word in metrics labels and Flower event names."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PAUSED = "paused"
    AWAITING_APPROVAL = "awaiting_approval"
    RELEASED = "released"
    LEASE_LOST = "lease_lost"
    DUPLICATE = "duplicate"  # the fork was not queued (running, finished, parked) or another worker held it
    HANDED_BACK = "handed_back"  # a stopping worker sent the delivery back to the queue
    REFUSED = "refused"  # a forged or corrupted job, or a fork that does not exist: dead-lettered
    REJECTED = "rejected"  # a malformed job: dead-lettered


# the ends of a claimed run (the `forkq_forks_finished` statuses), and the deliveries that claimed nothing
# (the `forkq_deliveries_skipped` reasons), each in this order
CLAIMED_RUN: Final = (
    Outcome.SUCCEEDED,
    Outcome.FAILED,
    Outcome.CANCELLED,
    Outcome.PAUSED,
    Outcome.AWAITING_APPROVAL,
    Outcome.RELEASED,
    Outcome.LEASE_LOST,
)
SKIPPED: Final = (Outcome.DUPLICATE, Outcome.HANDED_BACK, Outcome.REFUSED, Outcome.REJECTED)
FINISHED: Final = (Outcome.SUCCEEDED, Outcome.FAILED)  # runs whose last step ended with them


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """A delivery's outcome: its kind and, for a skipped one, what it found.

    `detail` is the fork's status (or `leased`) for `duplicate`, the error's class for `refused`, why for
    `rejected` (`malformed`); empty otherwise.
    """

    kind: Outcome
    detail: str = ""

    def __str__(self) -> str:
        """The task's return value: the kind, then `:` and the detail when there is one."""
        return f"{self.kind.value}:{self.detail}" if self.detail else self.kind.value

    @classmethod
    def from_wire(cls, text: str) -> RunOutcome | None:
        """The outcome a task returned as `text` (or its repr, quoted); None when it is not one."""
        kind, _, detail = text.strip("'\"").partition(":")
        try:
            return cls(Outcome(kind), detail)
        except ValueError:
            return None

    @property
    def final_event(self) -> str | None:
        """The Celery event that ends the delivery in Flower; None for a success (Celery's own `task-succeeded`).

        A fork that failed ends `task-failed`; refused and rejected jobs both end `task-rejected`; every
        other outcome has its own final state: `task-released`, `task-paused`, `task-awaiting_approval`,
        `task-cancelled`, `task-lease_lost`, `task-handed_back`, `task-duplicate`.
        """
        if self.kind is Outcome.SUCCEEDED:
            return None
        if self.kind in (Outcome.REFUSED, Outcome.REJECTED):
            return "task-rejected"
        return f"task-{self.kind.value}"

"""How one `run_fork` delivery ended: the runner's typed answer, the task's return value, and its Flower event.

A delivery either claimed the fork and ran it (its run ended `succeeded`, `failed`, `cancelled`, parked
`paused` or `awaiting_approval`, `released` at a worker's shutdown, or `lease_lost`), or claimed nothing
(`duplicate` of a fork that is not queued, `handed_back` by a stopping worker, `refused` or `rejected`).
The task returns the outcome's text (`succeeded`, `duplicate:running`, `refused:RecordIntegrityError`):
Celery hands its worker only that value's repr for the final task event, so `RunOutcome.from_wire` is the
one way back from the text, and the text and the event names are fixed words on the wire.

Three vocabularies name how a run ends, each for its own reader: the fork's stored `Status` (every client
reads it), the loop's `StopReason` (why a loop stopped before its result; the loop knows nothing of
deliveries), and a delivery's `Outcome` (metrics and Flower, which also count deliveries that claimed
nothing). An outcome that is a status has the status's value, and this module holds the only mappings
between them: `ENDED` (a written status to its outcome) and `STOPPED` (a stop to its outcome).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from workers.loop.child import StopReason
from workers.records.fork import Status
from workers.store.replies import FencedReply


class Outcome(enum.StrEnum):
    """What happened to a delivery; the value is its word in metrics labels and Flower event names."""

    SUCCEEDED = Status.SUCCEEDED.value
    FAILED = Status.FAILED.value
    CANCELLED = Status.CANCELLED.value
    PAUSED = Status.PAUSED.value
    AWAITING_APPROVAL = Status.AWAITING_APPROVAL.value
    RELEASED = "released"
    LEASE_LOST = StopReason.LEASE_LOST.value
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

# the outcome of a run that wrote its fork's status: its result (succeeded, failed, cancelled) or its park
ENDED: Final[Mapping[Status, Outcome]] = {
    Status.SUCCEEDED: Outcome.SUCCEEDED,
    Status.FAILED: Outcome.FAILED,
    Status.CANCELLED: Outcome.CANCELLED,
    Status.PAUSED: Outcome.PAUSED,
    Status.AWAITING_APPROVAL: Outcome.AWAITING_APPROVAL,
}
# the outcome of a run whose loop stopped before its result. A park is written apart (`Parked`, then ENDED):
# a stop for `awaiting_approval` without it parked nothing, and is absent here (`stop_outcome`)
STOPPED: Final[Mapping[StopReason, Outcome]] = {
    StopReason.SHUTDOWN: Outcome.RELEASED,
    StopReason.CANCELLED: Outcome.CANCELLED,
    StopReason.LEASE_LOST: Outcome.LEASE_LOST,
    StopReason.BUDGET_REACHED: Outcome.PAUSED,  # parked by the runner (`workers.service.budget`)
}


def stop_reason(refused: FencedReply) -> StopReason:
    """Why a run stops when a fenced write or check found the fork no longer its own: cancelled, or lost."""
    return StopReason.CANCELLED if refused is Status.CANCELLED else StopReason.LEASE_LOST


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

"""Delivery outcomes: one enum for the runner, the task's return value, metrics labels and Flower events."""

from __future__ import annotations

import pytest

from workers.service.metrics import RUN_STATUSES, SKIP_REASONS
from workers.service.outcome import CLAIMED_RUN, SKIPPED, Outcome, RunOutcome
from workers.service.tasks import final_event

EVERY = [
    RunOutcome(Outcome.SUCCEEDED),
    RunOutcome(Outcome.FAILED),
    RunOutcome(Outcome.CANCELLED),
    RunOutcome(Outcome.PAUSED),
    RunOutcome(Outcome.AWAITING_APPROVAL),
    RunOutcome(Outcome.RELEASED),
    RunOutcome(Outcome.LEASE_LOST),
    RunOutcome(Outcome.DUPLICATE, "running"),
    RunOutcome(Outcome.DUPLICATE, "leased"),
    RunOutcome(Outcome.HANDED_BACK),
    RunOutcome(Outcome.REFUSED, "RecordIntegrityError"),
    RunOutcome(Outcome.REJECTED, "malformed"),
]


def test_the_metrics_label_values_are_the_outcomes_words_and_stay_the_words_on_the_wire() -> None:
    assert RUN_STATUSES == (
        "succeeded",
        "failed",
        "cancelled",
        "paused",
        "awaiting_approval",
        "released",
        "lease_lost",
        "error",
        "other",
    )
    assert SKIP_REASONS == ("duplicate", "handed_back", "refused", "rejected")
    assert {*CLAIMED_RUN, *SKIPPED} == set(Outcome) and not set(CLAIMED_RUN) & set(SKIPPED)


@pytest.mark.parametrize("outcome", EVERY, ids=str)
def test_every_outcome_reads_back_from_the_tasks_return_value_and_its_repr(outcome: RunOutcome) -> None:
    assert RunOutcome.from_wire(str(outcome)) == outcome
    assert RunOutcome.from_wire(repr(str(outcome))) == outcome  # what Celery hands its worker's final event


@pytest.mark.parametrize(
    ("outcome", "text", "event"),
    [
        (RunOutcome(Outcome.SUCCEEDED), "succeeded", None),
        (RunOutcome(Outcome.LEASE_LOST), "lease_lost", "task-lease_lost"),
        (RunOutcome(Outcome.HANDED_BACK), "handed_back", "task-handed_back"),
        (RunOutcome(Outcome.DUPLICATE, "succeeded"), "duplicate:succeeded", "task-duplicate"),
        (RunOutcome(Outcome.REJECTED, "malformed"), "rejected:malformed", "task-rejected"),
        (RunOutcome(Outcome.REFUSED, "ForkNotFound"), "refused:ForkNotFound", "task-rejected"),
    ],
)
def test_an_outcome_is_the_same_text_and_flower_event_as_before(
    outcome: RunOutcome, text: str, event: str | None
) -> None:
    assert str(outcome) == text
    assert outcome.final_event == event == final_event(repr(text))


@pytest.mark.parametrize("text", ["", "'whatever'", "succeeded-ish", "'started:1'"])
def test_a_return_value_that_is_no_outcome_keeps_celerys_own_success_event(text: str) -> None:
    assert RunOutcome.from_wire(text) is None
    assert final_event(text) is None

"""Token budgets, counted as a provider bills them: a fork's own `max_tokens` and its session's budget.

A model response costs its input plus its output tokens, with the part of the input read from the provider's
prompt cache counted at the provider's cached-input weight: `ceil(cached × weight)` in place of `cached`. The
weight of a model is the first `FORKQ_CACHED_INPUT_WEIGHTS` glob it matches, else its provider's default
(`DEFAULT_CACHED_WEIGHTS`: OpenAI bills cached input at half price or less, Gemini at a quarter or less; the
scripted model counts every token). A fork's used tokens are the fold of its journal's model entries, so a
revived or resumed run counts exactly what its journal holds. The budgets themselves are checked by the
worker's guard (`workers.service.budget`) before each model call: at a limit the loop stops with
`workers.loop.budget.BudgetReached`, and the fork is parked `paused` with reason `budget_reached`.
"""

from __future__ import annotations

import enum
import fnmatch
import math
from collections.abc import Iterable
from typing import Final

from broker_config.settings import Settings
from workers.base.keys import session_named
from workers.errors import ConfigurationError
from workers.providers import TokenUsage
from workers.providers.routing import provider_kind
from workers.records.journal import EntryKind, JournalEntry

# the weight of a cached input token, by provider kind, when no FORKQ_CACHED_INPUT_WEIGHTS glob names the model
DEFAULT_CACHED_WEIGHTS: Final = {"openai": 0.5, "gemini": 0.25, "scripted": 1.0}


class BudgetKind(enum.StrEnum):
    """Which budget a fork reached."""

    FORK = "max_tokens"  # the launch's own max_tokens: immutable
    SESSION = "session"  # its parent session's budget, shared by every fork and nested subagent of the session


def cached_weight(settings: Settings, model: str | None) -> float:
    """The weight of one cached input token of `model`: its FORKQ_CACHED_INPUT_WEIGHTS glob, else its provider's."""
    if model:
        for pattern, weight in settings.cached_input_weights.items():
            if fnmatch.fnmatchcase(model, pattern):
                return weight
    try:
        return DEFAULT_CACHED_WEIGHTS[provider_kind(settings, model)]
    except ConfigurationError:  # no provider serves it: the call fails anyway, and nothing is discounted
        return 1.0


def billed_tokens(input_tokens: int, output_tokens: int, cached_input_tokens: int | None, weight: float) -> int:
    """The tokens one model response costs: input and output, its cached input at `weight`."""
    cached = min(max(cached_input_tokens or 0, 0), max(input_tokens, 0))
    return max(input_tokens, 0) - cached + math.ceil(cached * weight) + max(output_tokens, 0)


def usage_tokens(usage: TokenUsage, weight: float) -> int:
    """The tokens a provider's reported usage costs."""
    return billed_tokens(usage.input_tokens, usage.output_tokens, usage.cached_input_tokens, weight)


def journal_tokens(entries: Iterable[JournalEntry], weight: float) -> int:
    """The tokens a fork's journal's model responses cost: what its `max_tokens` counts."""
    return sum(
        billed_tokens(e.input_tokens, e.output_tokens, e.cached_input_tokens, weight)
        for e in entries
        if e.kind is EntryKind.MODEL
    )


def budget_detail(kind: BudgetKind, *, fork_id: str, session: str, used: int, limit: int) -> str:
    """Why a fork paused at a budget, and what to do, in words."""
    if kind is BudgetKind.FORK:
        return (
            f"its own max_tokens is reached: used {used:,} of {limit:,} tokens. A launch's max_tokens cannot be "
            f"raised: the journal and workspace are kept; `forkq cancel {fork_id}` ends it (with its usage)"
        )
    named = session_named(session)  # the id its tenant uses (its scope says the tenant too)
    return (
        f"the budget of session {named} is reached: used {used:,} of {limit:,} tokens. Raise it and every fork "
        f"it paused resumes: `forkq budget --session {named} --tokens N` (N above {used:,})"
    )

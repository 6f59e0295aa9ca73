"""What a model response costs in a token budget: input plus output, cached input at its provider's weight."""

from __future__ import annotations

from typing import Any

import pytest

from broker_config.settings import Settings
from workers.providers import TokenUsage
from workers.records.budget import billed_tokens, cached_weight, journal_tokens, usage_tokens
from workers.records.journal import JournalEntry


def settings(**values: Any) -> Settings:
    return Settings(**{"redis_url": "redis://127.0.0.1:1/0", **values})


def test_a_response_costs_its_input_and_output_with_cached_input_at_its_weight_rounded_up() -> None:
    assert billed_tokens(1_000, 200, None, 0.5) == 1_200
    assert billed_tokens(1_000, 200, 600, 0.5) == 400 + 300 + 200
    assert billed_tokens(1_000, 200, 601, 0.25) == 399 + 151 + 200  # ceil(150.25)
    assert billed_tokens(100, 10, 500, 0.0) == 10  # cached past the input counts as all of it
    assert usage_tokens(TokenUsage(input_tokens=10, output_tokens=5, cached_input_tokens=10), 1.0) == 15


@pytest.mark.parametrize(
    ("model", "expected"),
    [("gpt-5-mini", 0.1), ("gpt-4o", 0.5), ("gemini-2.5-pro", 0.25), ("scripted-model", 1.0)],
)
def test_a_models_cached_input_weight_is_its_first_matching_glob_else_its_providers(
    model: str, expected: float
) -> None:
    routed = settings(
        provider="scripted",
        provider_routes={"gpt-*": "openai", "gemini-*": "gemini"},
        cached_input_weights={"gpt-5*": 0.1, "gpt-*": 0.5},
    )

    assert cached_weight(routed, model) == expected


def test_a_model_no_provider_serves_counts_its_cached_input_whole() -> None:
    assert cached_weight(settings(), "unknown-model") == 1.0


def test_a_weight_outside_zero_to_one_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="cached_input_weights"):
        settings(cached_input_weights={"gpt-*": 1.5})


def test_a_forks_used_tokens_are_its_journals_model_responses() -> None:
    entries = [
        JournalEntry(seq=0, step=0, kind="surface", tools=[]),
        JournalEntry(seq=1, step=0, kind="model", input_tokens=100, output_tokens=20, cached_input_tokens=40),
        JournalEntry(seq=2, step=0, kind="tool_result", call_id="c", name="t", response={"output": "ok"}),
        JournalEntry(seq=3, step=1, kind="model", input_tokens=150, output_tokens=30),
    ]

    assert journal_tokens(entries, 0.5) == (60 + 20 + 20) + 180

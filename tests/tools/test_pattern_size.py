"""The size estimate of a regular expression, checked before `grep_search` compiles it."""

from __future__ import annotations

import pytest

from workers.tools.pattern_size import GREP_MAX_PATTERN_SIZE, expanded_size


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        ("abc", 3),
        ("a{10}", 10),
        ("(ab{10}){10}", 120),
        ("(a|b|c){2}", 8),
        ("x{,5}", 5),
        ("a{2,}", 2),
        (r"\d{1,3}(\.\d{1,3}){3}", 18),
        (r"\{3}", 3),  # an escaped brace is a character, the count is literal text
        ("[{]{5}", 5),
        (r"\p{L}{3}", 3),
        ("[]a]{4}", 4),
    ],
)
def test_the_estimate_multiplies_nested_counted_repeats(pattern: str, size: int) -> None:
    assert expanded_size(pattern) == size


@pytest.mark.parametrize("bomb", ["((a{200}){200}){200}", "(((a{100}){100}){100}){100}", "(a*){20000}", "a{0,65535}"])
def test_a_compile_bomb_is_over_the_bound(bomb: str) -> None:
    assert expanded_size(bomb) > GREP_MAX_PATTERN_SIZE

"""`forkq budget`: a session's token budget shown and set, in text and JSON; bad input exits 2 naming the field."""

from __future__ import annotations

import json

import pytest
import redis

from tests.cli_support import Run
from tests.test_cli_args import refused


def test_budget_shows_a_session_without_one_as_no_limit_and_sets_it_in_text_and_json(forkq: Run) -> None:
    assert forkq("budget", "--session", "s-cli") == (0, "session s-cli: no limit, used 0 tokens\n", "")

    code, out, _ = forkq("budget", "--session", "s-cli", "--tokens", "120000", "--json")

    assert (code, json.loads(out)) == (
        0,
        {"session": "s-cli", "tokens": 120000, "used": 0, "left": 120000, "resumed": []},
    )
    assert forkq("budget", "--session", "s-cli")[1] == "session s-cli: used 0 of 120,000 tokens, 120,000 left\n"


@pytest.mark.parametrize("tokens", ["-5", "many", "1.5", "", "1e6", "1000000000000001"])
def test_budget_tokens_that_are_not_a_whole_number_up_to_10_15_exit_2_naming_the_option(
    forkq: Run, capsys: pytest.CaptureFixture[str], redis_client: redis.Redis, tokens: str
) -> None:
    err = refused(forkq, capsys, "budget", "--session", "s-cli", f"--tokens={tokens}")

    assert "argument --tokens:" in err and "is not a whole number of tokens from 0 to 10^15" in err, err
    assert redis_client.dbsize() == 0


def test_budget_of_a_session_id_with_braces_or_spaces_exits_2_naming_the_session(
    forkq: Run, redis_client: redis.Redis
) -> None:
    code, out, err = forkq("budget", "--session", "a {b}", "--tokens", "10")

    assert (code, out) == (2, "")
    assert err.startswith("forkq budget: session 'a {b}' is not a valid parent session id"), err
    assert redis_client.dbsize() == 0

"""Examples for workers.history.params: the Agent tool's parameters (docs/fork-history.md §4)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from workers.errors import InvalidAgentParams
from workers.history.params import (
    MSG_FORK_TURNS_DIGITS,
    MSG_SEED_MODE_FORK_TOOLS,
    MSG_SEED_MODE_FORK_TURNS,
    MSG_SEED_MODE_NOT_FORK,
    MSG_SEED_MODE_TEAMMATE,
    SEED_MODES,
    AgentParams,
    agent_tool_schema,
    check_seed_mode,
    normalize_seed_mode,
    validate_agent_params,
)

VALUE = 'Parameter "fork_turns" must be "all" or a positive integer string such as "3".'
NOT_FORK = 'Parameter "fork_turns" can only be used with subagent_type "fork".'
TEAMMATE = 'Parameter "fork_turns" cannot be used when spawning a named teammate.'
MODEL = 'Parameter "model" cannot be used with subagent_type "fork".'

REJECTED = ["none", "0", "-1", "1.5", " 3 ", "ALL", "03", "+3", "", 3, 0, -1, 1.5, None, True, False]
MORE_REJECTED = ["All", "3 ", " 3", "3\n", "1e3", "0x3", "٣", "all ", ["3"], {"n": 3}]
ACCEPTED = ["all", "1", "3", "10", "100", "99999999999999999999"]


def params(**overrides: Any) -> dict[str, Any]:
    """A valid fork call, with `overrides` applied (a value of `...` removes the key)."""
    raw: dict[str, Any] = {"description": "rename things", "prompt": "Rename parse_args.", "subagent_type": "fork"}
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not ...}


def rejection(raw: dict[str, Any]) -> InvalidAgentParams:
    with pytest.raises(InvalidAgentParams) as caught:
        validate_agent_params(raw)
    return caught.value


# ── the value ─────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("value", REJECTED + MORE_REJECTED)
def test_every_fork_turns_value_but_all_or_a_positive_integer_string_is_rejected(value: Any) -> None:
    error = rejection(params(fork_turns=value))
    assert str(error) == VALUE
    assert error.field == "fork_turns"


@pytest.mark.parametrize("value", ACCEPTED)
def test_all_and_positive_integer_strings_are_accepted_and_kept_as_given(value: str) -> None:
    assert validate_agent_params(params(fork_turns=value)).fork_turns == value


def test_an_omitted_fork_turns_is_accepted_for_a_fork() -> None:
    assert validate_agent_params(params()).fork_turns is None


def test_a_null_fork_turns_counts_as_given_and_is_rejected() -> None:
    assert str(rejection(params(fork_turns=None))) == VALUE


# ── the order of checks ───────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("field", ["description", "prompt"])
@pytest.mark.parametrize("bad", [..., None, "", 5], ids=["missing", "null", "empty", "number"])
def test_description_and_prompt_are_required_non_empty_strings_checked_before_everything(field: str, bad: Any) -> None:
    # Given a call that also breaks every fork_turns and model rule
    raw = params(**{field: bad}, fork_turns="0", subagent_type="general", name="bob", model="m")
    # Then the missing or empty description/prompt is what is reported
    error = rejection(raw)
    assert error.field == field
    assert field in str(error)


def test_description_is_checked_before_prompt() -> None:
    assert rejection(params(description=..., prompt=...)).field == "description"


def test_the_value_is_checked_before_the_fork_only_rule() -> None:
    assert str(rejection(params(fork_turns="0", subagent_type="general"))) == VALUE


def test_the_value_is_checked_before_the_teammate_rule() -> None:
    assert str(rejection(params(fork_turns="ALL", name="bob"))) == VALUE


@pytest.mark.parametrize("subagent_type", ["general-purpose", "forks", "fork ", "", ...])
def test_fork_turns_is_only_valid_with_subagent_type_fork(subagent_type: Any) -> None:
    error = rejection(params(fork_turns="3", subagent_type=subagent_type))
    assert str(error) == NOT_FORK
    assert error.field == "fork_turns"


def test_a_missing_subagent_type_is_not_a_fork() -> None:
    assert str(rejection(params(fork_turns="all", subagent_type=...))) == NOT_FORK


@pytest.mark.parametrize("subagent_type", ["FORK", "Fork", "fOrK"])
def test_subagent_type_fork_is_compared_case_insensitively(subagent_type: str) -> None:
    assert validate_agent_params(params(fork_turns="2", subagent_type=subagent_type)).fork_turns == "2"


def test_the_fork_only_rule_is_checked_before_the_teammate_rule() -> None:
    assert str(rejection(params(fork_turns="3", subagent_type="general", name="bob"))) == NOT_FORK


@pytest.mark.parametrize("name", ["bob", ""])
def test_fork_turns_is_never_valid_with_a_teammate_name_even_an_empty_one(name: str) -> None:
    error = rejection(params(fork_turns="3", name=name))
    assert str(error) == TEAMMATE
    assert error.field == "fork_turns"


def test_the_teammate_rule_is_checked_before_the_model_rule() -> None:
    assert str(rejection(params(fork_turns="3", name="bob", model="gemini-2.5-pro"))) == TEAMMATE


def test_the_fork_only_rule_is_checked_before_the_model_rule() -> None:
    assert str(rejection(params(fork_turns="3", subagent_type=..., model="gemini-2.5-pro"))) == NOT_FORK


@pytest.mark.parametrize("fork_turns", ["3", ...], ids=["with-fork-turns", "without-fork-turns"])
@pytest.mark.parametrize("subagent_type", ["fork", "FORK"])
def test_model_is_rejected_for_forks_after_the_fork_turns_checks(fork_turns: Any, subagent_type: str) -> None:
    error = rejection(params(fork_turns=fork_turns, subagent_type=subagent_type, model="gemini-2.5-pro"))
    assert str(error) == MODEL
    assert error.field == "model"


def test_model_is_accepted_for_a_regular_subagent() -> None:
    raw = params(subagent_type="general-purpose", model="gemini-2.5-flash")
    assert validate_agent_params(raw).model == "gemini-2.5-flash"


def test_a_regular_subagent_and_a_teammate_without_fork_turns_are_accepted() -> None:
    assert validate_agent_params(params(subagent_type="general-purpose")).subagent_type == "general-purpose"
    assert validate_agent_params(params(subagent_type="general-purpose", name="bob")).name == "bob"


# ── the advertised schema ─────────────────────────────────────────────────────────────────────


def fork_turns_schema() -> dict[str, Any]:
    return agent_tool_schema()["properties"]["fork_turns"]


def branches_accepting(value: str) -> int:
    """How many oneOf branches of the fork_turns schema accept `value` (string branches only)."""
    count = 0
    for branch in fork_turns_schema()["oneOf"]:
        assert branch.get("type", "string") == "string"
        if "const" in branch:
            count += value == branch["const"]
        elif "pattern" in branch:
            count += re.search(branch["pattern"], value) is not None and not value.endswith("\n")
    return count


def test_the_schema_advertises_fork_turns_as_one_of_all_or_the_positive_integer_pattern() -> None:
    branches = fork_turns_schema()["oneOf"]
    assert len(branches) == 2
    assert {"type": "string", "const": "all"} in branches or {"const": "all"} in branches
    assert [b["pattern"] for b in branches if "pattern" in b] == ["^[1-9][0-9]*$"]


@pytest.mark.parametrize("value", ACCEPTED)
def test_the_schema_accepts_each_valid_value_in_exactly_one_branch(value: str) -> None:
    assert branches_accepting(value) == 1


@pytest.mark.parametrize("value", [v for v in REJECTED + MORE_REJECTED if isinstance(v, str)])
def test_the_schema_accepts_no_rejected_string(value: str) -> None:
    assert branches_accepting(value) == 0


def test_the_schema_gives_fork_turns_no_default() -> None:
    assert "default" not in fork_turns_schema()
    assert all("default" not in branch for branch in fork_turns_schema()["oneOf"])


def test_the_schema_says_fork_turns_is_only_valid_with_subagent_type_fork() -> None:
    description = fork_turns_schema()["description"]
    assert "subagent_type" in description
    assert '"fork"' in description


def test_the_schema_requires_description_and_prompt() -> None:
    schema = agent_tool_schema()
    assert schema["type"] == "object"
    assert set(schema["required"]) == {"description", "prompt"}
    assert {"description", "prompt", "subagent_type", "name", "fork_turns", "model"} <= set(schema["properties"])


# ── decisions recorded in docs/fork-history.md ────────────────────────────────────────────────


def test_a_null_name_counts_as_given_like_any_present_key() -> None:
    assert str(rejection(params(fork_turns="3", name=None))) == TEAMMATE


def test_a_null_model_counts_as_given_for_a_fork() -> None:
    assert str(rejection(params(model=None))) == MODEL


@pytest.mark.parametrize("field", ["description", "prompt"])
def test_a_blank_description_or_prompt_is_rejected_like_an_empty_one(field: str) -> None:
    assert rejection(params(**{field: " \n\t"})).field == field


# ── bounds, and AgentParams built without validation ─────────────────────────────────────────


def test_a_fork_turns_of_5000_digits_is_refused_with_the_bound_and_the_fix() -> None:
    error = rejection(params(fork_turns="9" * 5000))

    assert str(error) == MSG_FORK_TURNS_DIGITS
    assert error.field == "fork_turns"
    assert validate_agent_params(params(fork_turns="9" * 20)).turns == int("9" * 20)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("description", "d" * 1001),
        ("prompt", "p" * 1_000_001),
        ("subagent_type", "t" * 201),
        ("model", "m" * 201),
    ],
)
def test_a_text_parameter_past_its_length_is_refused_naming_it(field: str, value: str) -> None:
    raw = params(**{field: value}, subagent_type="general-purpose") if field == "model" else params(**{field: value})

    error = rejection(raw)

    assert error.field == field
    assert f'Parameter "{field}" is {len(value):,} characters long' in str(error)


def test_a_fork_tools_list_past_its_bound_is_refused() -> None:
    assert rejection(params(fork_tools=[f"t{i}" for i in range(1001)])).field == "fork_tools"
    assert rejection(params(fork_tools=["t" * 201])).field == "fork_tools"


def test_an_unknown_parameter_with_a_huge_name_is_named_briefly() -> None:
    error = rejection(params(**{"x" * 100_000: 1}))

    assert len(str(error)) < 300


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"description": "d", "prompt": " "}, 'Parameter "prompt" is required'),
        ({"description": "d", "prompt": "p", "fork_turns": "3"}, NOT_FORK),
        ({"description": "d", "prompt": "p", "subagent_type": "fork", "name": "bob", "fork_turns": "3"}, TEAMMATE),
        ({"description": "d", "prompt": "p", "subagent_type": "fork", "model": "m"}, MODEL),
        ({"description": "d", "prompt": "p", "turns": 3}, 'Unknown parameter "turns"'),
    ],
)
def test_an_agent_params_built_directly_is_held_to_every_rule(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        AgentParams(**fields)

    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    "raw",
    [params(), params(fork_turns="3", fork_tools=["read_file"]), params(subagent_type="x", name="", model="m")],
)
def test_an_agent_params_built_from_a_validated_ones_fields_equals_it(raw: dict[str, Any]) -> None:
    agent = validate_agent_params(raw)

    fields = {name: getattr(agent, name) for name in raw}
    assert AgentParams(**fields) == agent


def test_none_is_a_keyword_left_out_when_built_directly_and_a_given_null_in_an_agent_call() -> None:
    assert AgentParams(description="d", prompt="p", fork_turns=None, name=None).fork_turns is None
    assert AgentParams(description="d", prompt="p", name=None).name is None
    assert validate_agent_params(params(name=None)).name == ""
    with pytest.raises(InvalidAgentParams, match="fork_turns"):
        validate_agent_params(params(fork_turns=None))


def test_fork_turns_is_normalized_once_as_the_call_is_validated() -> None:
    assert validate_agent_params(params(subagent_type="fork", fork_turns="12")).turns == 12
    assert validate_agent_params(params(subagent_type="fork")).turns == "all"
    assert "turns" not in validate_agent_params(params(subagent_type="fork", fork_turns="2")).model_dump()


def test_the_agent_params_schema_is_the_agent_tools_own() -> None:
    assert AgentParams.model_json_schema() == agent_tool_schema()


@pytest.mark.parametrize("field", ["description", "prompt", "subagent_type", "name", "model"])
def test_a_text_parameter_holding_a_lone_surrogate_is_refused_naming_it(field: str) -> None:
    # what Python makes of the byte 0xff on a command line: it cannot be stored as UTF-8
    regular = {"subagent_type": "general-purpose"} if field in ("name", "model") else {}

    error = rejection(params(**regular, **{field: "bad \udcff byte"}))

    assert error.field == field
    assert str(error) == (
        f'Parameter "{field}" is not valid Unicode text: character 4 is a lone surrogate (U+DCFF, the byte 0xff '
        "that is not UTF-8); send UTF-8 text."
    )


def test_a_fork_tools_entry_holding_a_lone_surrogate_is_refused_naming_the_entry() -> None:
    error = rejection(params(fork_tools=["read_file", "grep\ud800"]))

    assert error.field == "fork_tools"
    assert str(error).startswith('Parameter "fork_tools" entry 1 is not valid Unicode text: character 4')


def test_text_parameters_in_any_script_with_surrogate_pairs_are_accepted() -> None:
    agent = validate_agent_params(params(description="café 😀", prompt="Привет, 世界 \U0001f600"))

    assert agent.prompt == "Привет, 世界 😀"


# ── seed modes ────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("given", "mode"),
    [
        (None, "fork_turns"),
        ("fork_turns", "fork_turns"),
        ("fork-turns", "fork_turns"),
        ("completed_turns", "completed_turns"),
        ("completed-turns", "completed_turns"),
    ],
)
def test_a_seed_mode_is_normalized_from_either_spelling(given: str | None, mode: str) -> None:
    assert normalize_seed_mode(given) == mode
    assert check_seed_mode(given, validate_agent_params(params())) == mode
    assert SEED_MODES == ("fork_turns", "completed_turns")


@pytest.mark.parametrize("given", ["completed", "COMPLETED_TURNS", "completed turns", " fork_turns", "", 1, True])
def test_an_unknown_seed_mode_is_refused_naming_both_modes_and_the_cli_spelling(given: object) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        check_seed_mode(given, validate_agent_params(params()))

    assert caught.value.field == "seed_mode"
    assert '"fork_turns" or "completed_turns"' in caught.value.message
    assert '"completed-turns"' in caught.value.message


@pytest.mark.parametrize("subagent_type", [..., "general-purpose", "forks"])
def test_a_completed_turn_seed_is_refused_for_anything_but_a_fork(subagent_type: object) -> None:
    agent = validate_agent_params(params(subagent_type=subagent_type))

    with pytest.raises(InvalidAgentParams) as caught:
        check_seed_mode("completed_turns", agent)

    assert (caught.value.message, caught.value.field) == (MSG_SEED_MODE_NOT_FORK, "seed_mode")
    assert check_seed_mode("fork_turns", agent) == "fork_turns"


def test_a_completed_turn_seed_is_refused_for_a_named_teammate() -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        check_seed_mode("completed_turns", validate_agent_params(params(name="reviewer")))

    assert (caught.value.message, caught.value.field) == (MSG_SEED_MODE_TEAMMATE, "seed_mode")


@pytest.mark.parametrize("fork_turns", ["all", "1"])
def test_fork_turns_is_refused_with_a_completed_turn_seed(fork_turns: str) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        check_seed_mode("completed-turns", validate_agent_params(params(fork_turns=fork_turns)))

    assert (caught.value.message, caught.value.field) == (MSG_SEED_MODE_FORK_TURNS, "fork_turns")
    assert caught.value.message == (
        'Parameter "fork_turns" cannot be used with seed_mode "completed_turns"; the completed-turn fork always '
        "inherits the parent's completed turns."
    )


@pytest.mark.parametrize("fork_tools", [[], ["read_file"]])
def test_fork_tools_is_refused_with_a_completed_turn_seed(fork_tools: list[str]) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        check_seed_mode("completed_turns", validate_agent_params(params(fork_tools=fork_tools)))

    assert (caught.value.message, caught.value.field) == (MSG_SEED_MODE_FORK_TOOLS, "fork_tools")
    assert "tool_filter" in caught.value.message


def test_a_fork_in_any_case_spelling_takes_a_completed_turn_seed() -> None:
    assert check_seed_mode("completed_turns", validate_agent_params(params(subagent_type="Fork"))) == "completed_turns"

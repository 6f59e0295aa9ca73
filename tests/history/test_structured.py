"""Structured output as pure rules (workers/history/structured.py): the schema, the answer and the feedback."""

from __future__ import annotations

import json

import pytest

from workers.errors import InvalidAgentParams
from workers.history.structured import check_answer, check_schema, feedback_text

SCHEMA = {
    "type": "object",
    "properties": {"verdict": {"enum": ["ok", "broken"]}, "issues": {"type": "array", "items": {"type": "string"}}},
    "required": ["verdict", "issues"],
    "additionalProperties": False,
}


def test_a_valid_schema_is_kept_as_given() -> None:
    assert check_schema(SCHEMA) is SCHEMA


def test_an_invalid_schema_is_refused_saying_where() -> None:
    with pytest.raises(InvalidAgentParams, match="output_schema is not a valid JSON schema") as caught:
        check_schema({"type": "object", "properties": {"n": {"type": 5}}})
    assert caught.value.field == "output_schema"


@pytest.mark.parametrize(
    "text",
    [
        '{"verdict": "ok", "issues": []}',
        '  {"verdict": "ok", "issues": []}\n',
        '```json\n{"verdict": "ok", "issues": []}\n```',
        '```\n{"verdict": "ok", "issues": []}\n```',
    ],
    ids=["whole-text", "whitespace", "fenced-json", "fenced-plain"],
)
def test_a_valid_answer_is_the_whole_text_or_one_fenced_json_block(text: str) -> None:
    value, problem = check_answer(text, SCHEMA)
    assert problem is None and value is not None
    assert json.loads(value) == {"verdict": "ok", "issues": []}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("All good, no issues.", "the answer is not JSON"),
        ('Here it is:\n```json\n{"verdict": "ok", "issues": []}\n```', "the answer is not JSON"),
        ('{"verdict": "fine", "issues": []}', "at verdict:"),
        ('{"verdict": "ok"}', "'issues' is a required property"),
        ('{"verdict": "ok", "issues": [3]}', "at issues/0:"),
    ],
    ids=["prose", "prose-around-fence", "bad-enum", "missing", "wrong-item-type"],
)
def test_an_answer_that_is_not_json_or_does_not_validate_says_what_is_wrong(text: str, expected: str) -> None:
    value, problem = check_answer(text, SCHEMA)
    assert value is None
    assert problem is not None and expected in problem


def test_the_feedback_message_carries_the_validation_error() -> None:
    text = feedback_text("at verdict: 'fine' is not one of ['ok', 'broken']")
    assert "does not match the required output schema" in text
    assert "at verdict: 'fine' is not one of ['ok', 'broken']" in text

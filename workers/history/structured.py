"""Structured output: a fork's final answer checked against the launch's JSON schema."""

from __future__ import annotations

import json
import re
from typing import Any, Final

from workers.errors import InvalidAgentParams

_FENCED: Final = re.compile(r"\A\s*```(?:json)?\s*\n(.*?)\n\s*```\s*\Z", re.DOTALL)


def check_schema(schema: object) -> dict[str, Any]:
    """The launch's output schema, checked once at launch.

    Raises:
        InvalidAgentParams: not an object, or not a valid JSON schema (`.field` is `output_schema`).
    """
    # jsonschema on first use: a parent that only follows forks (`forkq status`) never pays for it
    from jsonschema import Draft202012Validator, SchemaError  # noqa: PLC0415
    from jsonschema.validators import validator_for  # noqa: PLC0415

    if not isinstance(schema, dict):
        raise InvalidAgentParams(
            f"output_schema must be a JSON schema object, got {type(schema).__name__}", field="output_schema"
        )
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        raise InvalidAgentParams(
            f"output_schema is not a valid JSON schema: {exc.message} (at {'/'.join(map(str, exc.path)) or 'root'})",
            field="output_schema",
            cause=exc,
        ) from exc
    return schema


def check_answer(text: str, schema: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the answer's JSON text, None) when it validates, else (None, what is wrong).

    The answer is the whole final text, or one fenced ```json block that is the whole text.
    """
    from jsonschema import Draft202012Validator  # noqa: PLC0415
    from jsonschema.exceptions import best_match  # noqa: PLC0415
    from jsonschema.validators import validator_for  # noqa: PLC0415

    match = _FENCED.match(text)
    body = match.group(1) if match else text.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"the answer is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    validator = validator_for(schema, default=Draft202012Validator)(schema)
    error = best_match(validator.iter_errors(value))
    if error is None:
        return body, None
    where = "/".join(map(str, error.absolute_path)) or "the top level"
    return None, f"at {where}: {error.message}"


def feedback_text(problem: str) -> str:
    """The user message that sends a failing final answer back to the model."""
    return (
        f"Your final answer does not match the required output schema: {problem}. "
        "Reply again with only a JSON value that matches the schema, and nothing else."
    )

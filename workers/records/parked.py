"""The calls an `awaiting_approval` fork is parked on: the state's `pending` field and the park event's `calls`.

Stored as compact JSON (a list of objects with `call_id`, `index`, `step`, `name`, `args`, in that order),
written when the fork parks and rewritten by each decision; decoded here, once, where it is read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from workers.errors import RecordDecodeError


class ParkedCall(BaseModel):
    """One call a parked fork waits on: a person approves or denies it by `call_id`."""

    model_config = ConfigDict(frozen=True)

    call_id: str  # the model's call id, or `<step>.<index>` for a call without one
    index: int  # the call's place in its model response
    step: int  # the step (model call) that made it
    name: str  # the tool
    args: dict[str, Any] = Field(default_factory=dict)  # the call's arguments, as the model sent them

    def wire(self) -> dict[str, Any]:
        """The call as plain JSON data (the stored object, what `forkq status --json` prints)."""
        return self.model_dump()


_CALLS = TypeAdapter(list[ParkedCall])


def encode_parked(calls: Sequence[ParkedCall]) -> str:
    """The stored JSON of parked calls: compact, UTF-8 text kept as it is, fields in declaration order."""
    return json.dumps([call.wire() for call in calls], ensure_ascii=False, separators=(",", ":"))


def decode_parked(text: str, *, fork_id: str) -> list[ParkedCall]:
    """The parked calls in a fork state's `pending` field (none when it is empty).

    Raises:
        RecordDecodeError: the field is not a JSON list of parked calls.
    """
    if not text:
        return []
    try:
        return _CALLS.validate_python(json.loads(text))
    except ValueError as exc:  # JSONDecodeError and pydantic's ValidationError are ValueErrors
        raise RecordDecodeError(
            f"fork {fork_id}: the pending calls of its state are not a JSON list of parked calls "
            f"(call_id, index, step, name, args): {exc}",
            fork_id=fork_id,
            cause=exc,
        ) from exc

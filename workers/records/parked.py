"""What a parked fork waits on: the calls an `awaiting_approval` fork is parked on (the state's `pending` field
and the park event's `calls`), and `WaitingFor`, the state's account of what it waits for.

The calls are stored as compact JSON (a list of objects with `call_id`, `index`, `step`, `name`, `args`, in that
order), written when the fork parks and rewritten by each decision; decoded here, once, where it is read.
A paused fork's reason is the state's `waiting` field (states written before it kept it in `error`), and the
human account of a budget pause its `waiting_detail` field (absent in other states, and in older ones).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

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


class WaitingCall(BaseModel):
    """A call a person must approve or deny, by id and tool."""

    model_config = ConfigDict(frozen=True)

    call_id: str
    name: str


class ApprovalWait(BaseModel):
    """The fork waits for a person to approve or deny `calls` (`forkq approve` / `forkq deny`)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["approval"] = "approval"
    calls: list[WaitingCall]


class PauseReason(enum.StrEnum):
    """A paused fork's `reason` when it is a word a program acts on (other pauses give a sentence)."""

    BUDGET_REACHED = "budget_reached"  # its max_tokens, or its session's budget, is used up


class ResumeWait(BaseModel):
    """The fork is paused for `reason` (a missing tool, `budget_reached`, ...): once fixed, `forkq resume` it.

    A pause by a session budget resumes by itself when that budget is raised. `detail` is the human account of a
    budget pause: which budget, used, limit, and the command that raises it.
    """

    model_config = ConfigDict(frozen=True)

    kind: Literal["resume"] = "resume"
    reason: str
    detail: str | None = None


class AdmissionLimit(enum.StrEnum):
    """What keeps a model call waiting for admission (FORKQ_MODEL_LIMITS, docs/capacity.md)."""

    CONCURRENCY = "concurrency"  # the model's calls in flight, cluster-wide
    RPM = "rpm"  # calls admitted in the last 60 s
    TPM = "tpm"  # tokens of the calls admitted in the last 60 s
    COOLDOWN = "cooldown"  # the endpoint answered 429 or 503 with Retry-After: every call waits it out


class ModelWait(BaseModel):
    """A running fork's model call waits for admission to `model`, held by `limit`, since `since_ms` (Redis ms)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["model"] = "model"
    model: str
    limit: AdmissionLimit
    since_ms: int

    def stored(self) -> str:
        """The state's `model_wait` field."""
        return self.model_dump_json(exclude={"kind"})


# what a fork waits for, by `kind`: a parked fork on a person (approval) or an operator (resume), a running one
# on its model's admission
WaitingFor = Annotated[ApprovalWait | ResumeWait | ModelWait, Field(discriminator="kind")]


def read_model_wait(fields: Mapping[str, str]) -> ModelWait | None:
    """A running fork's admission wait (its state's `model_wait` field), or None (none, or unreadable: a wait is
    shown, never a reason to fail a read)."""
    text = fields.get("model_wait")
    if not text:
        return None
    try:
        return ModelWait.model_validate_json(text)
    except ValueError:
        return None


def approval_wait(calls: Sequence[ParkedCall]) -> ApprovalWait:
    """The wait of a fork parked on `calls`."""
    return ApprovalWait(calls=[WaitingCall(call_id=c.call_id, name=c.name) for c in calls])


def read_wait(calls: Sequence[ParkedCall] | None, fields: Mapping[str, str]) -> tuple[WaitingFor, str | None]:
    """A parked state's wait, on `calls` (awaiting approval) or else a resume, and its error, from its hash.

    A state parked before the `waiting` field existed kept why it waits in `error`: that text is the paused
    fork's reason (an approval's is its calls), and the state has no error.
    """
    error = fields.get("error") or None
    if "waiting" in fields:
        reason = fields["waiting"]
    else:  # written by an earlier version: the error was the wait
        reason, error = error or "", None
    if calls is not None:
        return approval_wait(calls), error
    return ResumeWait(reason=reason or "paused", detail=fields.get("waiting_detail") or None), error


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

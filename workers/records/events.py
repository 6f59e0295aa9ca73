"""A fork's progress events: one model per event type, its data typed, tagged by `type`, from Redis to the API.

An event is one entry of the fork's stream (`Keys.events`) with two fields: `type`, the event's word, and
`data`, its JSON. Every writer in Python builds one of the models below and writes `Event.encoded()` (or
only its data's JSON, where the script names the type); the Lua scripts that write an event of their own
(claim, cancel, resume, send, release, revive) write the same fields, and a test reads each of them back
as its model. The JSON keeps the keys the event was built with, in
declaration order (`EventData.wire`), so an event's stored bytes are those the plain dicts made before,
and an event read back goes out (SSE, `forkq events --json`) as it was stored.

| type | written by | data |
|---|---|---|
| `queued` | launch | `QueuedData` |
| `started` | claim (Lua) | `StartedData` |
| `model_call` | the loop, or the claim for a first call | `ModelCallData` |
| `step` | the loop, after a model call | `StepData` |
| `tool` | the loop, a tool call answered | `ToolData` |
| `feedback` | the loop, a final answer sent back to fit the schema | `FeedbackData` |
| `message` | send (Lua), or the loop delivering messages | `MessageData` |
| `awaiting_approval` | park | `AwaitingApprovalData` |
| `approved`, `denied` | a person's decision | `DecisionData` |
| `paused` | a run that lacks a declared tool | `ReasonData` |
| `resumed` | resume (Lua) | `ResumedData` |
| `released` | release, or finish continuing the fork (Lua) | `ReasonData` |
| `revived` | the sweeper (Lua) | `RevivedData` |
| `model_wait` | a model call's admission, when it must wait (FORKQ_MODEL_LIMITS) | `ModelWaitData` |
| `finished` | finish, cancel and revive (Lua): the last event | `FinishedData` |

`ForkEvent` is the union of these, the one the API documents. An event this version cannot read as one
of them (a type a newer version writes, or data that does not fit its type's model) is read as an
`UnknownEvent`, logged, and passed on as it is: a reader never fails on it, and `UnknownEvent` stays out
of the documented union.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Annotated, Any, ClassVar, Final, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypeAliasType

from workers.records.fork import Status, Usage
from workers.records.parked import AdmissionLimit, ParkedCall

log = logging.getLogger("forkq.events")

TERMINAL: Final = "finished"  # the type of a fork's last event


def _keys_as_stored(schema: dict[str, Any]) -> None:
    """An event's data holds the keys its writer gave (`EventData.wire`): one with a default may be absent, so
    the schema names no defaults (a reader must not count on a value that was never sent)."""
    for prop in schema.get("properties", {}).values():
        prop.pop("default", None)


class EventData(BaseModel):
    """The data of an event: keys a newer writer added are kept, and go out again as they came."""

    model_config = ConfigDict(extra="allow", frozen=True, defer_build=True, json_schema_extra=_keys_as_stored)

    # park's event was written compact, with UTF-8 text as it is: its bytes stay so
    compact: ClassVar[bool] = False

    def wire(self) -> dict[str, Any]:
        """The data as JSON: the keys it was built or read with (declaration order, then any unknown ones).

        A key left out when the event was built (or absent from the stored event) stays out, and one given
        as None stays null: the JSON is the one the writer meant, whatever the defaults.
        """
        given = self.model_fields_set
        return {key: value for key, value in self.model_dump(mode="json").items() if key in given}

    def to_json(self) -> str:
        """The stream entry's `data` field."""
        if self.compact:
            return json.dumps(self.wire(), ensure_ascii=False, separators=(",", ":"))
        return json.dumps(self.wire())


class _Entry(BaseModel):
    """What every event read from a stream has: its stream id and its type."""

    # built on first use: a launcher that never reads an event does not pay for thirty models
    model_config = ConfigDict(frozen=True, json_schema_serialization_defaults_required=True, defer_build=True)

    id: str = Field("", description="The Redis stream id (`<ms>-<seq>`); empty until the event is written.")
    type: str

    @property
    def at_ms(self) -> int:
        """When Redis recorded the event (Unix milliseconds)."""
        return int(self.id.split("-", 1)[0])

    @property
    def terminal(self) -> bool:
        """True for the event that ends a fork."""
        return self.type == TERMINAL


class Event(_Entry):
    """An event of a known type: its data is its type's model."""

    data: EventData

    def wire_data(self) -> dict[str, Any]:
        """The data as JSON (`EventData.wire`)."""
        return self.data.wire()

    def encoded(self) -> tuple[str, str]:
        """The stream entry's `type` and `data` fields, as the writing script takes them."""
        return self.type, self.data.to_json()


class UnknownEvent(_Entry):
    """An event this version cannot read as a `ForkEvent` (a newer writer's): its type and data as stored."""

    data: dict[str, Any] = Field(default_factory=dict)

    def wire_data(self) -> dict[str, Any]:
        """The data as stored."""
        return self.data


# ── the data of each type ─────────────────────────────────────────────────────────────────────


class QueuedData(EventData):
    """The fork was launched: its kind, launch digest and the number of messages in its seed."""

    kind: Literal["fork", "spawn"]
    digest: str = Field(description="The launch digest (hex): the bootstrap record's, which each job names.")
    messages: int = Field(0, description="Messages in the fork's seed.")


class StartedData(EventData):
    """A worker claimed the fork: its owner token, the attempt and the fencing epoch."""

    owner: str
    attempt: int
    epoch: int


class ModelCallData(EventData):
    """A model call is about to be made: its 1-based step and the digest of its request."""

    step: int
    request_digest: str


class StepData(EventData):
    """A model call answered: the tools it called (none: the final answer) and its tokens."""

    step: int
    tool_calls: list[str]
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0


class ToolData(EventData):
    """A tool call answered; `ok` is false when its answer is an error."""

    step: int
    tool: str
    ok: bool


class FeedbackData(EventData):
    """A final answer did not fit the output schema and was sent back to the model with the problem."""

    step: int
    error: str


class MessageData(EventData):
    """A message for the fork: `waiting`, `status` (and `continued`) when it was sent; `step` and `count`
    when the worker delivered it (and that many others) to the model."""

    waiting: int | None = Field(None, description="Messages in the fork's inbox, this one included.")
    status: Status | None = Field(None, description="The fork's status when the message came.")
    continued: bool | None = Field(None, description="True: it continued a succeeded fork.")
    step: int | None = Field(None, description="The step before which the messages were delivered.")
    count: int | None = Field(None, description="Messages delivered at once.")


class AwaitingApprovalData(EventData):
    """The fork parked on calls a person must approve or deny."""

    compact: ClassVar[bool] = True

    reason: str
    calls: list[ParkedCall]


class DecisionData(EventData):
    """A person's decision on one parked call."""

    call_id: str
    name: str
    reason: str | None = None


class ReasonData(EventData):
    """Why the fork stopped running (paused) or was handed back to the queue (released)."""

    reason: str


class ResumedData(EventData):
    """A paused fork was queued again (no data)."""


class RevivedData(EventData):
    """A fork whose worker was lost was queued again: its attempt, the runs lost so far, and how the loss was seen."""

    attempt: int
    lost: int
    via: Literal["connection", "lease"] = "lease"


class ModelWaitData(EventData):
    """A model call waits for admission: the step of the call (1-based, as `model_call`), the model, what holds it."""

    step: int
    model: str
    limit: AdmissionLimit


class FinishedData(EventData):
    """The fork ended: its status, its error and (except for a fork failed by the sweeper) its usage."""

    status: Status
    error: str | None = None
    usage: Usage | None = None


# ── the events ────────────────────────────────────────────────────────────────────────────────


class QueuedEvent(Event):
    """`queued`: the fork was launched."""

    type: Literal["queued"] = "queued"
    data: QueuedData


class StartedEvent(Event):
    """`started`: a worker claimed the fork."""

    type: Literal["started"] = "started"
    data: StartedData


class ModelCallEvent(Event):
    """`model_call`: a model call is about to be made."""

    type: Literal["model_call"] = "model_call"
    data: ModelCallData


class StepEvent(Event):
    """`step`: a model call answered."""

    type: Literal["step"] = "step"
    data: StepData


class ToolEvent(Event):
    """`tool`: a tool call answered."""

    type: Literal["tool"] = "tool"
    data: ToolData


class FeedbackEvent(Event):
    """`feedback`: a final answer was sent back to fit the output schema."""

    type: Literal["feedback"] = "feedback"
    data: FeedbackData


class MessageEvent(Event):
    """`message`: a message was sent to the fork, or delivered to its model."""

    type: Literal["message"] = "message"
    data: MessageData


class AwaitingApprovalEvent(Event):
    """`awaiting_approval`: the fork parked on calls a person must decide."""

    type: Literal["awaiting_approval"] = "awaiting_approval"
    data: AwaitingApprovalData


class ApprovedEvent(Event):
    """`approved`: a person approved a parked call."""

    type: Literal["approved"] = "approved"
    data: DecisionData


class DeniedEvent(Event):
    """`denied`: a person denied a parked call."""

    type: Literal["denied"] = "denied"
    data: DecisionData


class PausedEvent(Event):
    """`paused`: the fork stopped until an operator resumes it."""

    type: Literal["paused"] = "paused"
    data: ReasonData


class ResumedEvent(Event):
    """`resumed`: a paused fork was queued again."""

    type: Literal["resumed"] = "resumed"
    data: ResumedData = Field(default_factory=ResumedData)


class ReleasedEvent(Event):
    """`released`: the run handed the fork back to the queue (shutdown, or messages to deliver)."""

    type: Literal["released"] = "released"
    data: ReasonData


class RevivedEvent(Event):
    """`revived`: the fork's worker was lost, and the fork queued again."""

    type: Literal["revived"] = "revived"
    data: RevivedData


class ModelWaitEvent(Event):
    """`model_wait`: a model call waits for its model's admission (a slot, a rate window or a cooldown)."""

    type: Literal["model_wait"] = "model_wait"
    data: ModelWaitData


class FinishedEvent(Event):
    """`finished`: the fork ended; its last event."""

    type: Literal["finished"] = "finished"
    data: FinishedData


ForkEvent = TypeAliasType(
    "ForkEvent",
    Annotated[
        Union[  # noqa: UP007 (a discriminated union needs the members as one Union)
            QueuedEvent,
            StartedEvent,
            ModelCallEvent,
            StepEvent,
            ToolEvent,
            FeedbackEvent,
            MessageEvent,
            AwaitingApprovalEvent,
            ApprovedEvent,
            DeniedEvent,
            PausedEvent,
            ResumedEvent,
            ReleasedEvent,
            RevivedEvent,
            ModelWaitEvent,
            FinishedEvent,
        ],
        Field(discriminator="type", description="One event of a fork: its type's model, tagged by `type`."),
    ],
)


def decision_event(decision: Literal["approve", "deny"], data: DecisionData) -> ApprovedEvent | DeniedEvent:
    """The event of a person's decision on a parked call."""
    return ApprovedEvent(data=data) if decision == "approve" else DeniedEvent(data=data)


StreamEvent = ForkEvent | UnknownEvent  # an event as read: one of the union, or one this version does not know


@functools.cache
def _adapter() -> TypeAdapter[ForkEvent]:
    """The union's validator, built at the first read (not at import: `forkq status` starts without it)."""
    return TypeAdapter(ForkEvent)


# every type the union knows: each member's `type`
EVENT_TYPES: Final = frozenset(m.model_fields["type"].default for m in get_args(get_args(ForkEvent.__value__)[0]))


def decode_event(event_id: bytes, fields: dict[bytes, bytes]) -> StreamEvent:
    """The event of one XREAD/XRANGE entry; an `UnknownEvent` when it is none of `ForkEvent`'s (logged)."""
    eid, kind, raw = event_id.decode(), fields.get(b"type", b"").decode(), fields.get(b"data", b"{}")
    try:
        data = json.loads(raw)
    except ValueError:
        data = {"text": raw.decode("utf-8", "replace")}
    try:
        return _adapter().validate_python({"id": eid, "type": kind, "data": data})
    except ValidationError as exc:
        if kind in EVENT_TYPES:  # a known type with data its model refuses: a writer's bug, or a changed model
            log.warning("event %s (%s): data does not fit its model, passed on as it is: %s", eid, kind, exc)
        else:  # a newer version's type
            log.info("event %s: type %r unknown to this version, passed on as it is", eid, kind)
        return UnknownEvent(id=eid, type=kind, data=data if isinstance(data, dict) else {"value": data})

"""The conversation format: Gemini `Content` and `Part` as pydantic models, wire form camelCase.

Unknown keys anywhere in a message are kept as extra fields and survive a round trip. A message's
own key whose value is null counts as absent (dumps use `exclude_none=True`); data inside `args`,
`response` and the values of unknown keys is kept exactly, nulls included.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from workers.base.collector import collector_paused
from workers.base.limits import MAX_NESTING_DEPTH, bad_text, has_bad_text, nesting_problem, shown, too_deep
from workers.errors import InvalidHistory

Role = Literal["user", "model"]


class WireModel(BaseModel):
    """Base of the message models: strict types, camelCase aliases, unknown keys kept."""

    model_config = ConfigDict(
        extra="allow",  # parents send what their provider sends; unknown keys must round-trip
        strict=True,  # no coercion: "1" is not a bool, 5 is not a text
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The wire (camelCase JSON-compatible) form, nulls of the message's own keys dropped."""
        return self.model_dump(by_alias=True, exclude_none=True)


class FunctionCall(WireModel):
    """A model's request to run a tool."""

    id: str | None = None
    name: str | None = None
    args: dict[str, Any] | None = None


class FunctionResponse(WireModel):
    """A tool's answer to a `FunctionCall`: `response` is `{"output": ...}` or `{"error": ...}`."""

    id: str | None = None
    name: str | None = None
    response: dict[str, Any] | None = None
    parts: list[Part] | None = None


class Blob(WireModel):
    """Inline media (`inlineData`): base64 data and its MIME type."""

    mime_type: str | None = None
    data: str | None = None


class FileData(WireModel):
    """Media referenced by URI (`fileData`)."""

    mime_type: str | None = None
    file_uri: str | None = None


class Part(WireModel):
    """One payload of a Content: text (maybe a thought), a call, a response, or media."""

    text: str | None = None
    thought: bool | None = None
    thought_signature: str | None = None
    function_call: FunctionCall | None = None
    function_response: FunctionResponse | None = None
    inline_data: Blob | None = None
    file_data: FileData | None = None


class Content(WireModel):
    """One message of a conversation: a role and its parts."""

    role: Role
    parts: list[Part] = Field(default_factory=list)

    @field_validator("parts", mode="before")
    @classmethod
    def _null_parts_are_absent(cls, value: object) -> object:
        return [] if value is None else value


FunctionResponse.model_rebuild()

_HISTORY = TypeAdapter(list[Content])


PAUSE_GC_FROM: Final = 2000  # below this many Contents the collector's cost is noise


@contextmanager
def _collector_paused(size: int) -> Iterator[None]:
    """Pause the cyclic GC while pydantic-core builds or dumps thousands of small objects.

    Bulk copies allocate several tracked containers per Part; with the collector on, its
    generation scans over the (large) parent history make a 20,000-message copy ~3× slower
    (bench/history.py). Nothing built here is cyclic, so pausing loses nothing; the previous
    state is restored, and concurrent callers at worst leave the collector on.
    """
    if size < PAUSE_GC_FROM:
        yield
        return
    with collector_paused():
        yield


def dump_contents(contents: Sequence[Content]) -> list[dict[str, Any]]:
    """The wire form of many Contents (one call into pydantic-core; new dicts and lists)."""
    with _collector_paused(len(contents)):
        return _HISTORY.dump_python(list(contents), by_alias=True, exclude_none=True)  # type: ignore[no-any-return]


def load_contents(raw: list[dict[str, Any]]) -> list[Content]:
    """Contents from wire dicts (strict validation; raises pydantic's ValidationError)."""
    with _collector_paused(len(raw)):
        return _HISTORY.validate_python(raw)


def copy_contents(contents: Sequence[Content]) -> list[Content]:
    """A deep copy: no object, list or dict of the result is shared with the input."""
    return load_contents(dump_contents(contents))


def parse_history(raw: object) -> list[Content]:
    """Parse a raw history (a list of wire Contents).

    Raises:
        InvalidHistory: naming the first bad message (`.index`) and what is wrong with it, including a
            message nested deeper than `workers.base.limits.MAX_NESTING_DEPTH` or holding a string that is not
            valid Unicode text (a lone surrogate).
    """
    if not isinstance(raw, list):
        raise InvalidHistory(
            f"history must be a list of Contents, got {type(raw).__name__}; "
            'send [{"role": "user", "parts": [{"text": "..."}]}, ...]',
            index=None,
        )
    if too_deep(raw, MAX_NESTING_DEPTH + 1):  # one walk of the whole list; per message only to name the culprit
        index = next(i for i, item in enumerate(raw) if too_deep(item))
        raise InvalidHistory(nesting_problem(f"history[{index}]"), index=index)
    check_history_text(raw)
    try:  # one call into pydantic-core for the whole history; per-message only to explain a failure
        return load_contents(raw)
    except ValidationError:
        return [parse_content(item, index=i) for i, item in enumerate(raw)]


def check_history_text(raw: list[Any]) -> None:
    """Every string of a wire history (texts, arguments, keys) must be valid Unicode to be stored as UTF-8.

    Raises:
        InvalidHistory: naming the first message holding one that is not, and where in it.
    """
    if has_bad_text(raw):  # one walk of the whole list; per message only to name the culprit
        index = next(i for i, item in enumerate(raw) if has_bad_text(item))
        raise InvalidHistory(bad_text(f"history[{index}]", raw[index]) or f"history[{index}]", index=index)


def parse_content(item: object, *, index: int) -> Content:
    """Parse one wire Content, raising `InvalidHistory` that names `index` and the problem."""
    where = f"history[{index}]"
    if not isinstance(item, dict):
        raise InvalidHistory(f"{where}: a Content must be an object, got {type(item).__name__}", index=index)
    role = item.get("role")
    if role is None:
        raise InvalidHistory(
            f'{where}: missing "role"; every Content needs role "user" or "model"', index=index, field="role"
        )
    if role not in ("user", "model"):
        raise InvalidHistory(
            f'{where}: role {shown(role)} is not allowed; use "user" or "model"', index=index, field="role"
        )
    parts = item.get("parts")
    if parts is not None and not (isinstance(parts, list) and all(isinstance(p, dict) for p in parts)):
        raise InvalidHistory(
            f'{where}: "parts" must be a list of objects (Parts), got {_describe(parts)}', index=index, field="parts"
        )
    try:
        return Content.model_validate(item)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InvalidHistory(
            f"{where}.{loc}: {first['msg']} (got {_describe(first.get('input'))})", index=index, field=loc, cause=exc
        ) from exc


def _describe(value: object) -> str:
    return f"{type(value).__name__} {shown(value)}"

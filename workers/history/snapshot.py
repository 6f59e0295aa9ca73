"""The parent snapshot: what a parent agent hands forkq at launch (the CLI's `--parent` file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from workers.base.limits import (
    MAX_NESTING_DEPTH,
    MAX_PARENT_FILE_BYTES,
    MAX_SNAPSHOT_DEPTH,
    find_bad_text,
    has_bad_text,
    nesting_problem,
    text_problem,
    too_deep,
)
from workers.errors import ForkqError, InvalidHistory, InvalidParentSnapshot
from workers.history.messages import Content, check_history_text, dump_contents, parse_history

ApprovalMode = Literal["plan", "default", "auto-edit", "yolo"]

_HISTORY_PARSED: Final = "history_parsed"  # validation context: parse_parent_snapshot parsed the history already


def _shallow(value: Any) -> Any:
    """A tool declaration or system instruction nested past MAX_NESTING_DEPTH, or holding a string that is
    not valid Unicode, cannot be encoded or sent."""
    if too_deep(value):
        raise PydanticCustomError("too_deep", nesting_problem("the value"))
    if has_bad_text(value):  # parse_parent_snapshot names the string, with the field's path
        raise PydanticCustomError("bad_text", "a string in it is not valid Unicode text; send UTF-8 text")
    return value


class ParentSnapshot(BaseModel):
    """The launching parent: session, system instruction, tools, model, mode, cwd, history, depth.

    Strict: `"depth": "0"` is refused, not read as 0. Tool declarations, the system instruction and
    each history message are bounded in nesting (`workers.base.limits.MAX_NESTING_DEPTH`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    schema_version: int = 1
    session_id: str = Field(min_length=1, max_length=200, pattern=r"^[^{}\s]+$")
    system_instruction: Annotated[str | dict[str, Any] | None, AfterValidator(_shallow)] = None
    tools: list[Annotated[dict[str, Any], AfterValidator(_shallow)]] = Field(default_factory=list)
    model: str | None = Field(None, max_length=200)
    approval_mode: ApprovalMode = "default"
    cwd: str = Field(".", max_length=4096)
    history: list[Content] = Field(default_factory=list)
    depth: int = Field(0, ge=0, le=MAX_SNAPSHOT_DEPTH)

    @field_validator("history", mode="before")
    @classmethod
    def _bounded_history(cls, value: Any, info: ValidationInfo) -> Any:
        """Wire dicts are parsed (and bounded) by parse_history; hand-built Contents are bounded here."""
        if info.context and info.context.get(_HISTORY_PARSED):
            return value
        try:
            if isinstance(value, list) and all(isinstance(c, Content) for c in value):
                wire = dump_contents(value)
                if too_deep(wire, MAX_NESTING_DEPTH + 1):
                    index = next(i for i, c in enumerate(wire) if too_deep(c))
                    raise InvalidHistory(nesting_problem(f"history[{index}]"), index=index)
                check_history_text(wire)
                return value
            return parse_history(value)
        except InvalidHistory as exc:
            field = "history" if exc.index is None else f"history[{exc.index}]"
            raise InvalidParentSnapshot(f"parent snapshot: {exc}", field=field, cause=exc) from exc


def parse_parent_snapshot(data: object, *, source: str = "parent snapshot") -> ParentSnapshot:
    """Validate a parent snapshot given as parsed JSON.

    Raises:
        InvalidParentSnapshot: naming the bad field (`history[3].parts`, `tools[1]`, ...) and the fix.
    """
    if not isinstance(data, dict):
        raise InvalidParentSnapshot(
            f"{source}: expected a JSON object with session_id, history, tools, ..., got {type(data).__name__}",
            field=None,
        )
    fields = dict(data)
    try:
        fields["history"] = parse_history(fields.get("history") or [])
    except InvalidHistory as exc:
        field = "history" if exc.index is None else f"history[{exc.index}]"
        raise InvalidParentSnapshot(f"{source}: {exc}", field=field, cause=exc) from exc
    try:
        return ParentSnapshot.model_validate(fields, context={_HISTORY_PARSED: True})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        message = f"field {field!r}: {first['msg']}"
        found = find_bad_text(first["input"], field) if first["type"] in ("bad_text", "string_unicode") else None
        if found is not None:  # pydantic's words do not say what is wrong with the text, nor where
            message = text_problem(f"field {found[0]!r}", found[1]) or message
        hint = "" if first["type"] in _OWN_MESSAGES else _HINTS.get(str(first["loc"][0]) if first["loc"] else "", "")
        raise InvalidParentSnapshot(f"{source}: {message}{hint}", field=field, cause=exc) from exc


def load_parent_snapshot(path: Path) -> ParentSnapshot:
    """Read and validate a parent snapshot JSON file (UTF-8, at most `MAX_PARENT_FILE_BYTES`).

    Raises:
        InvalidParentSnapshot: the file cannot be read, is too large, is not UTF-8 or JSON, is
            nested too deep, or is not a valid snapshot; the message names the file and the fix.
    """
    name = f"parent snapshot {str(path)!r}"
    data = read_json_file(path, what=name, max_bytes=MAX_PARENT_FILE_BYTES, error=InvalidParentSnapshot)
    return parse_parent_snapshot(data, source=name)


def read_json_file(path: Path, *, what: str, max_bytes: int, error: type[ForkqError], field: str | None = None) -> Any:
    """The JSON document in a UTF-8 file of at most `max_bytes`, or `error` (a ForkqError class) saying why not."""
    try:
        with path.open("rb") as file:
            raw = file.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read {what}: {exc.strerror}", field=field) from exc
    if len(raw) > max_bytes:
        raise error(f"{what} is larger than {max_bytes:,} bytes; send a smaller document", field=field)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{what} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save it as UTF-8",
            field=field,
        ) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", field=field) from exc
    except ValueError as exc:  # int() refuses a number of more than 4,300 digits
        raise error(
            f"{what} holds a number of more than 4,300 digits; write it with fewer digits", field=field
        ) from exc
    except RecursionError as exc:  # the parser's own recursion limit, far past MAX_NESTING_DEPTH
        raise error(nesting_problem(what), field=field) from exc


_OWN_MESSAGES: Final = ("too_deep", "bad_text", "string_unicode")  # they say the fix themselves

_HINTS = {
    "session_id": " (a non-empty id without braces or spaces, such as the parent's session UUID)",
    "approval_mode": ' (one of "plan", "default", "auto-edit", "yolo")',
    "tools": " (a list of function declarations: objects with name, description, parameters)",
    "depth": " (0 for a top-level session)",
}

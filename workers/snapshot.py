"""The parent snapshot: what a parent agent hands forkq at launch (the CLI's `--parent` file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.errors import InvalidHistory, InvalidParentSnapshot
from workers.messages import Content, parse_history

ApprovalMode = Literal["plan", "default", "auto-edit", "yolo"]


class ParentSnapshot(BaseModel):
    """The launching parent: session, system instruction, tools, model, mode, cwd, history, depth."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = 1
    session_id: str = Field(min_length=1, max_length=200, pattern=r"^[^{}\s]+$")
    system_instruction: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    model: str | None = None
    approval_mode: ApprovalMode = "default"
    cwd: str = "."
    history: list[Content] = Field(default_factory=list)
    depth: int = Field(0, ge=0)


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
        return ParentSnapshot.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        hint = _HINTS.get(str(first["loc"][0]) if first["loc"] else "", "")
        raise InvalidParentSnapshot(f"{source}: field {field!r}: {first['msg']}{hint}", field=field, cause=exc) from exc


def load_parent_snapshot(path: Path) -> ParentSnapshot:
    """Read and validate a parent snapshot JSON file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidParentSnapshot(f"cannot read parent snapshot {str(path)!r}: {exc.strerror}", field=None) from exc
    except json.JSONDecodeError as exc:
        raise InvalidParentSnapshot(
            f"parent snapshot {str(path)!r} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", field=None
        ) from exc
    return parse_parent_snapshot(data, source=f"parent snapshot {str(path)!r}")


_HINTS = {
    "session_id": " (a non-empty id without braces or spaces, such as the parent's session UUID)",
    "approval_mode": ' (one of "plan", "default", "auto-edit", "yolo")',
    "tools": " (a list of function declarations: objects with name, description, parameters)",
    "depth": " (0 for a top-level session)",
}

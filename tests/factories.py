"""Small builders for Gemini Contents, shared by the history, codec and property tests.

Every builder returns fresh objects: a Part is a wire dict, a Content is a parsed `Content`.
A plain string given where a part is expected becomes a text part.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import BaseModel

from workers.history.messages import Content

PartLike = str | dict[str, Any]

LEGACY_ACK = "Got it. Thanks for the context!"
SUMMARY_ACK = "Got it. Thanks for the additional context!"
SUMMARY_TEXT = "This session continues an earlier one. Resume the prior task from this summary: refactor the parser."
ATTACHMENT_PREFIXES = (
    "<plan-mode-active>",
    "<background-tasks>",
    "The following files were recently accessed before context was compacted.",
    "Recently accessed file (full current content embedded):",
    "Recent visual snapshots preserved from before context was compacted",
)
PLACEHOLDER_OUTPUT = "Fork started — processing in background"
ACK_TEXT = "Understood. Executing directive now."
BEGIN = "Begin."


# ── parts ─────────────────────────────────────────────────────────────────────────────────────


def text(value: str, **extra: Any) -> dict[str, Any]:
    """A text part; `extra` adds wire keys such as `thought=True` or `thoughtSignature="sig"`."""
    return {"text": value, **extra}


def thought(value: str, signature: str | None = "sig-1") -> dict[str, Any]:
    """A reasoning part, with a thought signature unless `signature` is None."""
    part: dict[str, Any] = {"text": value, "thought": True}
    if signature is not None:
        part["thoughtSignature"] = signature
    return part


def reminder_text(body: str = "The date is 2025-01-01.") -> str:
    """A system-reminder text."""
    return f"<system-reminder>{body}</system-reminder>"


def call(call_id: str, name: str = "read_file", args: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A functionCall part; `extra` goes into the functionCall object."""
    return {"functionCall": {"id": call_id, "name": name, "args": {"path": "a.py"} if args is None else args, **extra}}


def agent_call(call_id: str, directive: str, **args: Any) -> dict[str, Any]:
    """A functionCall part of the Agent tool that launches a fork with `directive`."""
    return call(call_id, "Agent", {"description": "fork task", "prompt": directive, "subagent_type": "fork", **args})


def response(call_id: str, name: str = "read_file", output: Any = "file contents", **extra: Any) -> dict[str, Any]:
    """A functionResponse part answering `call_id`."""
    return {"functionResponse": {"id": call_id, "name": name, "response": {"output": output}, **extra}}


def media(mime_type: str = "image/png", data: str = "iVBORw0KGgo=") -> dict[str, Any]:
    """An inlineData part (no text at all)."""
    return {"inlineData": {"mimeType": mime_type, "data": data}}


# ── Contents ──────────────────────────────────────────────────────────────────────────────────


def _part(value: PartLike) -> dict[str, Any]:
    return text(value) if isinstance(value, str) else json.loads(json.dumps(value))


def wire(role: str, *parts: PartLike, **extra: Any) -> dict[str, Any]:
    """A wire Content dict."""
    return {"role": role, "parts": [_part(p) for p in parts], **extra}


def user(*parts: PartLike, **extra: Any) -> Content:
    """A user Content."""
    return Content.model_validate(wire("user", *parts, **extra))


def model(*parts: PartLike, **extra: Any) -> Content:
    """A model Content."""
    return Content.model_validate(wire("model", *parts, **extra))


def reminder(*bodies: str) -> Content:
    """A pure-reminder user Content, one reminder part per body."""
    return user(*(reminder_text(b) for b in (bodies or ("env: linux, cwd /repo",))))


def legacy_startup() -> list[Content]:
    """The legacy startup pair: environment text, then the model's fixed acknowledgement."""
    return [user("This is the environment: linux, cwd /repo."), model(LEGACY_ACK)]


def summary(*, attachments: str | None = None, follow_call: bool = False) -> list[Content]:
    """A compacted-history summary of length 2, 3 (with `attachments` prefix) or 4 (plus a call)."""
    contents = [user(SUMMARY_TEXT), model(SUMMARY_ACK)]
    if attachments is not None:
        contents.append(user(f"{attachments} src/parser.py"))
        if follow_call:
            contents.append(model(call("c-summary", "read_file")))
    return contents


def tool_round(call_id: str, *, name: str = "read_file", output: Any = "file contents") -> list[Content]:
    """A model call and the user Content answering it."""
    return [model(call(call_id, name)), user(response(call_id, name, output))]


# ── inspection ────────────────────────────────────────────────────────────────────────────────


def dump(contents: Iterable[Content]) -> list[dict[str, Any]]:
    """The wire form of Contents."""
    return [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in contents]


def texts(content: Content) -> list[str]:
    """The texts of a Content's parts (parts without text are skipped)."""
    return [p.text for p in content.parts if p.text is not None]


def all_texts(contents: Iterable[Content]) -> list[str]:
    """Every part text of every Content, in order."""
    return [t for c in contents for t in texts(c)]


def calls(content: Content) -> list[dict[str, Any]]:
    """The wire functionCall objects of a Content."""
    return [p["functionCall"] for p in dump([content])[0]["parts"] if "functionCall" in p]


def responses(content: Content) -> list[dict[str, Any]]:
    """The wire functionResponse objects of a Content."""
    return [p["functionResponse"] for p in dump([content])[0]["parts"] if "functionResponse" in p]


def containers(value: Any) -> Iterator[Any]:
    """Every model, dict and list reachable from `value` (models' extra dicts included)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, BaseModel):
            yield item
            extra = item.__pydantic_extra__
            if extra is not None:
                yield extra
                stack.extend(extra.values())
            stack.extend(getattr(item, name) for name in type(item).model_fields)
        elif isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            if isinstance(item, list):
                yield item
            stack.extend(item)

"""The tool registry: declarations, handlers and their flags; tools act inside the fork's cwd."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from workers.messages import FunctionCall


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a handler may know about the fork that calls it."""

    fork_id: str
    cwd: Path
    call_id: str | None
    idempotency_key: str


log = logging.getLogger("forkq.tools")

ENTRY_POINT_GROUP = "forkq.tools"

Handler = Callable[[Mapping[str, Any], ToolContext], Any]


class ToolError(Exception):
    """Raised by a handler for a failure the model should read (becomes `{"error": message}`)."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool a worker can execute."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    handler: Handler
    mutating: bool = False
    idempotent: bool = False

    @property
    def declaration(self) -> dict[str, Any]:
        """The function declaration a model sees."""
        return {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}


@dataclass
class ToolRegistry:
    """Tools by name; `run` turns a call into a response dict and never raises for tool failures."""

    tools: dict[str, Tool] = field(default_factory=dict)

    def register(self, tool: Tool) -> None:
        """Add (or replace) a tool."""
        self.tools[tool.name] = tool

    def get(self, name: str | None) -> Tool | None:
        """The tool named `name`, if this worker has it."""
        return self.tools.get(name or "")

    def run(self, call: FunctionCall, ctx: ToolContext) -> dict[str, Any]:
        """`{"output": ...}` or `{"error": ...}` for one call."""
        tool = self.get(call.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return {"error": f"tool {call.name!r} is not available on this worker (available: {available})"}
        try:
            return {"output": tool.handler(call.args or {}, ctx)}
        except ToolError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # a tool's bug must not crash the fork: the model reads the error
            return {"error": f"tool {call.name!r} failed: {type(exc).__name__}: {exc}"}


def resolve_inside(cwd: Path, path: str) -> Path:
    """`path` resolved against `cwd` (symlinks followed); refuses anything outside `cwd`."""
    root = cwd.resolve()
    target = (root / path).resolve()
    if target != root and root not in target.parents:
        raise ToolError(f"path {path!r} is outside the working directory {str(root)!r}; use a path inside it")
    return target


def _list_directory(args: Mapping[str, Any], ctx: ToolContext) -> str:
    target = resolve_inside(ctx.cwd, str(args.get("path") or "."))
    if not target.is_dir():
        raise ToolError(f"{args.get('path')!r} is not a directory")
    return "\n".join(sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir()))


def _read_file(args: Mapping[str, Any], ctx: ToolContext) -> str:
    target = resolve_inside(ctx.cwd, str(args.get("path", "")))
    if not target.is_file():
        raise ToolError(f"{args.get('path')!r} is not a file")
    lines = target.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    offset = int(args.get("offset") or 0)
    limit = int(args.get("limit") or 2000)
    return "".join(lines[offset : offset + limit])


def builtin_tools() -> ToolRegistry:
    """The read-only built-ins: `list_directory` and `read_file`, confined to the fork's cwd."""
    registry = ToolRegistry()
    registry.register(
        Tool(
            "list_directory",
            "List a directory of the working directory.",
            {"type": "object", "properties": {"path": {"type": "string"}}},
            _list_directory,
            idempotent=True,
        )
    )
    registry.register(
        Tool(
            "read_file",
            "Read a text file of the working directory.",
            {
                "type": "object",
                "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
            _read_file,
            idempotent=True,
        )
    )
    return registry


def _as_tools(obj: object) -> list[Tool]:
    if isinstance(obj, Tool):
        return [obj]
    if callable(obj):
        return _as_tools(obj())
    if isinstance(obj, Iterable) and not isinstance(obj, str | bytes):
        items = list(obj)
        if all(isinstance(item, Tool) for item in items):
            return items
    raise TypeError(f"expected a Tool, a list of Tools, or a callable returning them; got {type(obj).__name__}")


def load_tools() -> ToolRegistry:
    """The built-ins plus every tool deployers register in the `forkq.tools` entry point group.

    An entry point names a `Tool`, a list of them, or a zero-argument callable returning either.
    A broken entry point is logged and skipped: a worker with fewer tools still runs, and a fork
    that declares a missing tool gets an error response naming it.
    """
    registry = builtin_tools()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            for tool in _as_tools(ep.load()):
                registry.register(tool)
        except Exception as exc:  # a deployer's plugin must not keep the worker from starting
            log.error("tool entry point %s (%s) could not be loaded: %s", ep.name, ep.value, exc)
    return registry

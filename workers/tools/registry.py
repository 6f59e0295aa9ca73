"""The tool registry: declarations, handlers and their flags; arguments are checked against the schema first.

A `Tool` pairs a function declaration (name, description, JSON-schema parameters) with the handler a
worker runs and the flags the child loop and the approval modes read. `ToolRegistry.run` validates a
call's arguments against the tool's schema (compiled once, at registration) before the handler
runs, and turns every outcome into `{"output": ...}` or `{"error": ...}`: a tool failure is
something the model reads, never an exception that ends the fork.

Every call has a deadline: the tool's own time limit (`Tool.timeout_s`, else the registry's
`default_timeout_s`, `FORKQ_TOOL_TIMEOUT_S` on a worker), never past the fork's wall-clock limit
(`ToolContext.deadline`). The handler runs in another thread (the registry's `HandlerThreads`: an idle
one is reused, else a new one starts) that the caller waits on, so a
handler blocked where Python cannot interrupt it (a FIFO, a hung network mount, a plugin's stuck
call) costs its call an error response at the deadline, or at once when the fork is cancelled,
and never the worker slot: the caller goes on, and the handler's thread is left to end by itself.
Those threads are counted per tool (`ABANDONED`, which a worker's metrics serve as the gauge
`forkq_tool_calls_abandoned`): a tool with TOOL_MAX_ABANDONED of them still running is refused until
one ends, so a model retrying a stuck call cannot pile up threads.

The built-in coding tools are declared in `workers.tools.builtins`; deployers add their own through
the `forkq.tools` entry point group.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.protocols import Validator
from jsonschema.validators import Draft202012Validator, validator_for

from workers.errors import ConfigurationError, ForkqError
from workers.history.messages import FunctionCall
from workers.tools.threads import HandlerThreads
from workers.workspace.sandbox import Confinement

log = logging.getLogger("forkq.tools")

# how many schema violations one error response lists: enough to fix a call in one retry
MAX_REPORTED_ERRORS = 5
# a violation message quotes the bad value; a huge wrong-typed argument must not flood the context
MAX_ERROR_MESSAGE_CHARS = 300
DEFAULT_TOOL_TIMEOUT_S = 300.0  # a call's time limit when neither its tool nor the worker sets one
TOOL_WAIT_POLL_S = 0.1  # how often a waiting caller asks `ctx.cancelled` (it may be a Redis round trip)
TOOL_STOP_GRACE_S = 1.0  # after a cancel or the deadline: time a handler that watches `cancelled` gets to stop
# (0.5 s proved too short on a loaded machine: a search past its time limit was abandoned before its own answer came)
# abandoned calls of one tool whose threads still run in this process; past it the tool is refused: a
# model retrying a stuck plugin call would otherwise leave one more thread behind at every retry
TOOL_MAX_ABANDONED = 4


class AbandonedCalls:
    """Handler threads of this process whose caller gave up on them and that still run, by tool name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tool: dict[str, int] = {}

    def add(self, tool: str) -> None:
        """One more abandoned call of `tool` is running."""
        with self._lock:
            self._by_tool[tool] = self._by_tool.get(tool, 0) + 1

    def remove(self, tool: str) -> None:
        """An abandoned call of `tool` ended by itself."""
        with self._lock:
            left = self._by_tool.get(tool, 0) - 1
            if left > 0:
                self._by_tool[tool] = left
            else:
                self._by_tool.pop(tool, None)

    def count(self, tool: str) -> int:
        """Abandoned calls of `tool` still running."""
        with self._lock:
            return self._by_tool.get(tool, 0)

    def snapshot(self) -> dict[str, int]:
        """Abandoned calls still running, by tool (the gauge `forkq_tool_calls_abandoned`)."""
        with self._lock:
            return dict(self._by_tool)


ABANDONED = AbandonedCalls()  # per process: the threads are the process's; workers.service.metrics reads it


def never_cancelled() -> bool:
    """The default `ToolContext.cancelled`: nobody cancels this call."""
    return False


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a handler may know about the fork that calls it.

    `cancelled` is polled by long-running handlers (`run_shell_command`, `grep_search`) so a
    cancelled fork stops its work without waiting for a timeout; it also turns true when the call's
    deadline has passed and its caller gave up on it. `deadline` (`time.monotonic()`) is when the
    call's answer is due: the fork's wall-clock limit, and within `ToolRegistry.run` the tool's own
    time limit too.
    """

    fork_id: str
    cwd: Path
    call_id: str | None
    idempotency_key: str
    cancelled: Callable[[], bool] = never_cancelled
    deadline: float = math.inf
    # a snapshot fork's sandbox: `cwd` is then its workspace (`confinement.root`), seen at `confinement.alias`
    confinement: Confinement | None = None

    def __post_init__(self) -> None:
        # the file tools act in `cwd` and the shell in `confinement.root`: one folder, or the tools disagree
        if self.confinement is not None and os.path.abspath(self.cwd) != os.path.abspath(self.confinement.root):
            raise ValueError(f"a confined tool context's cwd {str(self.cwd)!r} is not its workspace's root")

    def seconds_left(self) -> float:
        """Seconds until the deadline (negative once past it)."""
        return self.deadline - time.monotonic()


Handler = Callable[[Mapping[str, Any], ToolContext], Any]


class ToolError(ForkqError):
    """Raised by a handler for a failure the model should read (becomes `{"error": message}`)."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool a worker can execute.

    `mutating`: it changes something outside the model's context (files, processes).
    `idempotent`: running it twice has the effect of running it once, so a call interrupted by a
    worker's death may be re-run on revival. `edit`: a file-edit tool, approved automatically in the
    `auto-edit` approval mode. `timeout_s`: the call's time limit (None: the registry's default).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    handler: Handler
    mutating: bool = False
    idempotent: bool = False
    edit: bool = False
    timeout_s: float | None = None

    @property
    def declaration(self) -> dict[str, Any]:
        """The function declaration a model sees."""
        return {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}


def compile_schema(tool: Tool) -> Validator:
    """A validator for the tool's parameters: the draft its `$schema` names, else Draft 2020-12.

    Raises:
        ConfigurationError: the parameters are not a valid JSON schema.
    """
    # an unknown `$schema` falls back to 2020-12 too (default given: no deprecation warning)
    cls = validator_for(tool.parameters, default=Draft202012Validator)
    try:
        cls.check_schema(dict(tool.parameters))
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise ConfigurationError(
            f"tool {tool.name!r}: its parameters are not a valid JSON schema ({exc.message} at {where}); "
            "fix the tool's declaration",
            field=tool.name,
            cause=exc,
        ) from exc
    return cls(tool.parameters)


def describe_parameters(schema: Mapping[str, Any]) -> str:
    """`path (string, required), offset (integer)`: a parameter list for error messages."""
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or not properties:
        return "none declared"
    required = set(schema.get("required") or ())
    described = []
    for name, spec in properties.items():
        kind = spec.get("type", "any") if isinstance(spec, Mapping) else "any"
        described.append(f"{name} ({kind}{', required' if name in required else ''})")
    return ", ".join(described)


def _violation(error: ValidationError) -> str:
    where = "/".join(str(p) for p in error.path)
    message = error.message
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS] + "…"
    return f"argument {where!r}: {message}" if where else message


def invalid_arguments(tool: Tool, errors: list[ValidationError]) -> str:
    """The error a model reads for a call whose arguments break the schema: what is wrong, what is expected."""
    lines = [_violation(e) for e in errors[:MAX_REPORTED_ERRORS]]
    if len(errors) > MAX_REPORTED_ERRORS:
        lines.append(f"(and {len(errors) - MAX_REPORTED_ERRORS} more)")
    return (
        f"invalid arguments for tool {tool.name!r}: " + "; ".join(lines) + f". Nothing was run; call {tool.name} "
        f"again with arguments matching its parameters: {describe_parameters(tool.parameters)}"
    )


@dataclass
class ToolRegistry:
    """Tools by name; `run` turns a call into a response dict and never raises for tool failures."""

    tools: dict[str, Tool] = field(default_factory=dict)
    default_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S  # the time limit of a tool that sets none
    # the validator of each registered tool, kept with the tool it was compiled for
    _validators: dict[str, tuple[Tool, Validator]] = field(default_factory=dict, init=False, repr=False, compare=False)
    # the threads handlers run on: reused, since starting one per call costs the worker's one interpreter more
    threads: HandlerThreads = field(default_factory=HandlerThreads, repr=False, compare=False)

    def register(self, tool: Tool) -> None:
        """Add (or replace) a tool, after checking its parameters are a valid JSON schema.

        Raises:
            ConfigurationError: the tool's parameters are not a valid JSON schema.
        """
        validator = compile_schema(tool)
        self._validators[tool.name] = (tool, validator)
        self.tools[tool.name] = tool

    def get(self, name: str | None) -> Tool | None:
        """The tool named `name`, if this worker has it."""
        return self.tools.get(name or "")

    def _validator(self, tool: Tool) -> Validator:
        compiled = self._validators.get(tool.name)
        if compiled is not None and compiled[0] is tool:
            return compiled[1]
        # put into `tools` directly, not through `register`: compile now, once
        validator = compile_schema(tool)
        self._validators[tool.name] = (tool, validator)
        return validator

    def run(self, call: FunctionCall, ctx: ToolContext) -> dict[str, Any]:
        """`{"output": ...}` or `{"error": ...}` for one call; the handler runs only with valid arguments."""
        tool = self.get(call.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return {"error": f"tool {call.name!r} is not available on this worker (available: {available})"}
        args = call.args if call.args is not None else {}
        try:
            errors = list(self._validator(tool).iter_errors(args))
        except ConfigurationError as exc:
            return {"error": str(exc)}
        if errors:
            return {"error": invalid_arguments(tool, errors)}
        if (stuck := ABANDONED.count(tool.name)) >= TOOL_MAX_ABANDONED:
            return {
                "error": f"tool {tool.name!r} was not run: {stuck} earlier calls of it did not finish within their "
                f"time limit and still run on this worker (at most {TOOL_MAX_ABANDONED}), so it looks stuck (a hung "
                "service or file system). Continue without it, or try again later"
            }
        limit = tool.timeout_s if tool.timeout_s is not None else self.default_timeout_s
        return HandlerCall(tool, args, ctx, limit).result(self.threads)


class WaitEnd(enum.Enum):
    """What ended the wait for a tool's handler: it returned, the fork was cancelled, or its deadline came."""

    DONE = enum.auto()
    CANCELLED = enum.auto()
    DEADLINE = enum.auto()


class HandlerCall:
    """One handler run in another thread, waited for until it answers, the deadline passes or the
    fork is cancelled (see the module docstring)."""

    def __init__(self, tool: Tool, args: Mapping[str, Any], ctx: ToolContext, limit_s: float) -> None:
        self.tool = tool
        self.started = time.monotonic()
        self.limit_s = min(limit_s, ctx.deadline - self.started)
        self.given_up = threading.Event()  # set when the caller stops waiting: the handler should stop too
        self.outer_cancelled = ctx.cancelled
        self.watching = False  # whether the handler ever asked `cancelled`: only then is it given time to stop
        self.ctx = replace(ctx, deadline=self.started + self.limit_s, cancelled=self._cancelled)
        self.args = args
        self.done = threading.Event()
        self.ending = threading.Lock()  # the handler ending and the caller abandoning it: one after the other
        self.abandoned = False
        self.response: dict[str, Any] = {"error": f"tool {tool.name!r} ended without an answer"}

    def _cancelled(self) -> bool:
        self.watching = True
        return self.given_up.is_set() or self.outer_cancelled()

    def _run(self) -> None:
        try:
            self.response = {"output": self.tool.handler(self.args, self.ctx)}
        except ToolError as exc:
            self.response = {"error": str(exc)}
        except Exception as exc:  # a tool's bug must not crash the fork: the model reads the error
            self.response = {"error": f"tool {self.tool.name!r} failed: {type(exc).__name__}: {exc}"}
        finally:
            with self.ending:
                self.done.set()
                if self.abandoned:
                    ABANDONED.remove(self.tool.name)

    def _abandon(self) -> bool:
        """Count the handler as abandoned unless it has just ended; whether it was."""
        with self.ending:
            if self.done.is_set():
                return False
            self.abandoned = True
            ABANDONED.add(self.tool.name)
            return True

    def _wait(self) -> WaitEnd:
        """What ended the wait for the handler."""
        deadline = self.ctx.deadline
        while not self.done.wait(max(0.0, min(TOOL_WAIT_POLL_S, deadline - time.monotonic()))):
            if self.outer_cancelled():
                return WaitEnd.CANCELLED
            if time.monotonic() >= deadline:
                return WaitEnd.DEADLINE
        return WaitEnd.DONE

    def result(self, threads: HandlerThreads) -> dict[str, Any]:
        """The handler's response, or an error response at the deadline or on a cancel."""
        if self.limit_s <= 0:
            return {"error": f"tool {self.tool.name!r} was not run: the fork has no time left (wall-clock limit)"}
        threads.submit(self._run)
        ending = self._wait()
        if ending is WaitEnd.DONE:
            return self.response
        self.given_up.set()
        if self.watching and self.done.wait(TOOL_STOP_GRACE_S):  # it noticed and stopped: its answer says most
            return self.response
        if not self._abandon():
            return self.response
        log.warning(
            "tool %s: the call did not end %s; it was abandoned, its thread is left to finish",
            self.tool.name,
            "after the fork was cancelled"
            if ending is WaitEnd.CANCELLED
            else f"within its time limit of {self.limit_s:.3g} s",
        )
        if ending is WaitEnd.CANCELLED:
            name = self.tool.name
            return {"error": f"the fork was cancelled or stopped while tool {name!r} ran; the call was abandoned"}
        limit = f"{round(self.limit_s, 1):g} s"
        return {
            "error": f"tool {self.tool.name!r} did not finish within its time limit of {limit} (the "
            "tool's limit or the fork's remaining wall-clock time) and was abandoned; its effects, if any, are "
            "unknown. Try a smaller request, or continue without it"
        }


def resolve_inside(cwd: Path, path: str, confinement: Confinement | None = None) -> Path:
    """`path` resolved against `cwd` (symlinks followed); refuses anything outside `cwd`.

    A check of what a path names now, not a way to open it: the file tools open paths beneath the
    working directory in one step (`workers.tools.beneath`), since a symlink can be swapped in between.
    With a `confinement`, an absolute path under the parent's path (`alias`) names the same place in
    the workspace, and messages name the working directory by the parent's path.

    Raises:
        ToolError: the path escapes `cwd` (by `..`, as an absolute path, or through a symlink), or
            cannot be resolved at all.
    """
    root = cwd.resolve()
    if confinement is not None:
        path = confinement.inside(path) or path
    try:
        target = (root / path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # NUL bytes, symlink loops
        raise ToolError(
            f"path {path!r} cannot be resolved ({exc}); use a plain path inside the working directory"
        ) from exc
    if target != root and root not in target.parents:
        shown = confinement.alias if confinement is not None else str(root)
        raise ToolError(f"path {path!r} is outside the working directory {shown!r}; use a path inside it")
    return target

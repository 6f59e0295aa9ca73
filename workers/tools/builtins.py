"""The built-in coding tools (files, search, shell) and the tools deployers add through entry points."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

from workers.tools import files, search, shell
from workers.tools.registry import DEFAULT_TOOL_TIMEOUT_S, Tool, ToolRegistry

log = logging.getLogger("forkq.tools")

ENTRY_POINT_GROUP = "forkq.tools"


def _schema(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    # extra arguments are refused: a misspelt name (`file_path`) must not be silently ignored
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _string(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


PATH_DOC = "Path relative to the working directory (an absolute path must lie inside it)."


# The declarations below are the contract a model sees; the handlers live in `workers.tools.files`
# (whose docstring explains the flags), `workers.tools.search` and `workers.tools.shell`.


def _file_tools() -> list[Tool]:

    return [
        Tool(
            "read_file",
            f"Read a UTF-8 text file. Returns at most `limit` lines (default {files.READ_MAX_LINES}) from line "
            "`offset`, with a marker telling the offset to continue from when the file is longer.",
            _schema(
                {
                    "path": _string(PATH_DOC),
                    "offset": {"type": "integer", "minimum": 0, "description": "0-based line to start at."},
                    "limit": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": files.READ_MAX_LINES,
                        "description": "Lines.",
                    },
                },
                "path",
            ),
            files.read_file,
            idempotent=True,
        ),
        Tool(
            "list_directory",
            "List a directory (default: the working directory), sorted; directories end with '/'.",
            _schema({"path": _string(PATH_DOC)}),
            files.list_directory,
            idempotent=True,
        ),
        Tool(
            "write_file",
            "Write a file with the given content, replacing it if it exists; parent directories are created.",
            _schema({"path": _string(PATH_DOC), "content": _string("The complete new content.")}, "path", "content"),
            files.write_file,
            mutating=True,
            idempotent=True,  # the same content twice is the same file: a re-run after a crash is harmless
            edit=True,
        ),
        Tool(
            "edit",
            "Replace one exact occurrence of old_string with new_string in a file. old_string must match the "
            "file exactly (whitespace included) and exactly once; include surrounding lines to make it unique.",
            _schema(
                {
                    "path": _string(PATH_DOC),
                    "old_string": _string("The exact text to replace, unique in the file."),
                    "new_string": _string("The replacement text."),
                },
                "path",
                "old_string",
                "new_string",
            ),
            files.edit,
            mutating=True,
            edit=True,
        ),
    ]


def _search_and_shell_tools() -> list[Tool]:
    return [
        Tool(
            "glob",
            "Find paths matching a glob pattern such as '**/*.py' or 'src/*.{ts,tsx}' under `path`; sorted, "
            f"relative to the working directory, at most {search.GLOB_MAX_RESULTS}; .git is skipped.",
            _schema({"pattern": _string("Glob pattern, relative; '**' matches any depth."), "path": _string(PATH_DOC)}),
            search.glob,
            idempotent=True,
        ),
        Tool(
            "grep_search",
            "Search file contents with a Python regular expression; returns 'path:line:text' lines "
            f"(at most {search.GREP_MAX_MATCHES}). Binary files, special files and .git are skipped; a search "
            f"stops with an error after {search.GREP_TIME_LIMIT_S:g} s.",
            _schema(
                {
                    "pattern": _string("Python regular expression (re syntax; (?i) for case-insensitive)."),
                    "path": _string("File or directory to search. " + PATH_DOC),
                    "include": _string("Glob on file names, e.g. '*.py' or '*.{ts,tsx}' (with '/': on paths)."),
                },
                "pattern",
            ),
            search.grep_search,
            idempotent=True,
        ),
        Tool(
            "run_shell_command",
            "Run a command with bash in the working directory; returns combined stdout and stderr (the middle "
            f"is cut past {shell.SHELL_OUTPUT_CAP // 1024} KiB) and the exit code. Background processes are "
            "stopped when the command ends.",
            _schema(
                {
                    "command": _string("The bash command line."),
                    "timeout_s": {
                        "type": "number",
                        "minimum": 1,
                        "maximum": shell.SHELL_MAX_TIMEOUT_S,
                        "description": f"Seconds before it is killed (default {shell.SHELL_DEFAULT_TIMEOUT_S}).",
                    },
                },
                "command",
            ),
            shell.run_shell_command,
            mutating=True,
            timeout_s=shell.SHELL_CALL_LIMIT_S,  # the command's own timeout_s (at most 600 s) governs it
        ),
    ]


def builtin_tools() -> ToolRegistry:
    """The built-in coding tools (files, search, shell), confined to the fork's working directory."""
    registry = ToolRegistry()
    for tool in _file_tools() + _search_and_shell_tools():
        registry.register(tool)
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


def load_tools(default_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S) -> ToolRegistry:
    """The built-ins plus every tool deployers register in the `forkq.tools` entry point group.

    `default_timeout_s` is the time limit of a call whose tool sets none (`FORKQ_TOOL_TIMEOUT_S`).

    An entry point names a `Tool`, a list of them, or a zero-argument callable returning either.
    A broken entry point (or a tool whose parameters are not a valid JSON schema) is logged and
    skipped: a worker with fewer tools still runs, and a fork that declares a missing tool gets an
    error response naming it.
    """
    registry = builtin_tools()
    registry.default_timeout_s = default_timeout_s
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            for tool in _as_tools(ep.load()):
                registry.register(tool)
        except Exception as exc:  # a deployer's plugin must not keep the worker from starting
            log.error("tool entry point %s (%s) could not be loaded: %s", ep.name, ep.value, exc)
    return registry

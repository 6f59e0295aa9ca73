"""Scripted model steps, working directories and journal readers for the tests that run forks."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.providers import ModelRequest, ModelResponse
from workers.providers.scripted import Script, ScriptedProvider
from workers.records.journal import JournalEntry
from workers.tools.builtins import builtin_tools

FORK = {"description": "fix the limiter", "prompt": "Fix the rate limiter.", "subagent_type": "fork"}
REGULAR = {"description": "audit", "prompt": "Audit the limiter.", "subagent_type": "general-purpose"}


# ── scripts ───────────────────────────────────────────────────────────────────────────────────


def call(call_id: str | None, name: str, **args: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "args": args}
    if call_id is not None:
        body["id"] = call_id
    return {"functionCall": body}


def step(*parts: dict[str, Any] | str, delay_s: float = 0.0) -> dict[str, Any]:
    wire = [{"text": p} if isinstance(p, str) else p for p in parts]
    return {"delay_s": delay_s, "content": {"role": "model", "parts": wire}}


def write_script(directory: Path, steps: list[dict[str, Any]]) -> Path:
    path = directory / "script.json"
    path.write_text(json.dumps({"steps": steps}), encoding="utf-8")
    return path


# one step calling a read-only tool, a file edit and a shell command, in that order; then an answer
MIXED_STEP = step(
    call("r1", "read_file", path="notes.txt"),
    call("w1", "write_file", path="edited.txt", content="edited"),
    call("s1", "run_shell_command", command="echo ran > shell.txt"),
)
MIXED = [MIXED_STEP, step("done")]


@dataclass
class Recording:
    """The scripted provider, remembering every request (thread-safe: a live worker calls it)."""

    script: Script
    requests: list[ModelRequest] = field(default_factory=list)
    name: str = "recording"
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def generate(self, request: ModelRequest) -> ModelResponse:
        with self._lock:
            self.requests.append(request)
        return ScriptedProvider(self.script).generate(request)


def scripted(steps: list[dict[str, Any]]) -> Recording:
    return Recording(Script.model_validate({"steps": steps}))


def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "notes.txt").write_text("the limiter uses INCR then EXPIRE\n", encoding="utf-8")
    return work


def parent_for(parent: dict[str, Any], work: Path, mode: str = "yolo", **overrides: Any) -> dict[str, Any]:
    return {**parent, "approval_mode": mode, "cwd": str(work), **overrides}


def tool_results(entries: list[JournalEntry]) -> dict[str, dict[str, Any]]:
    """Each answered call's response, by call id (or `<step>.<index>`)."""
    return {
        e.call_id or f"{e.step}.{e.call_index}": e.response or {}
        for e in entries
        if e.kind == "tool_result" and e.response is not None
    }


def ran(entries: list[JournalEntry]) -> set[str]:
    return {cid for cid, response in tool_results(entries).items() if "output" in response}


def started(entries: list[JournalEntry]) -> set[str]:
    return {e.call_id or f"{e.step}.{e.call_index}" for e in entries if e.kind == "tool_started"}


ONLY_READ_FILE = [builtin_tools().tools["read_file"].declaration]
UNDECLARED = (
    "Error: tool 'run_shell_command' is not one of this fork's tools (declared: read_file); it was not run. "
    "Use one of the declared tools, or do without it and say so in your answer."
)


SCHEMA = {
    "type": "object",
    "properties": {"fixed": {"type": "boolean"}, "files": {"type": "array", "items": {"type": "string"}}},
    "required": ["fixed", "files"],
}
VALID = '{"fixed": true, "files": ["app/ratelimit.py"]}'

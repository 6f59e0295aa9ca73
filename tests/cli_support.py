"""Helpers of the `forkq` command's tests (test_cli*.py): the example parent, launching, scripts, polling.

The `forkq` fixture itself (run `forkq ARGS...` in-process) is in conftest.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import workers
from tests.live import wait_until

PARENT = str(Path(workers.__file__).parent / "examples" / "parent.json")
FORKQ = str(Path(sys.executable).parent / "forkq")
PROMPT = "Write the expiry tests."

Run = Callable[..., tuple[int, str, str]]


def launch(forkq: Run, *extra: str) -> str:
    """Launch a fork of the example parent through the CLI; its id."""
    code, out, err = forkq("launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork", *extra)
    assert code == 0, err
    return out.strip()


def parent_file(tmp_path: Path, name: str = "parent.json", **overrides: Any) -> str:
    """The example parent with `overrides`, written as a JSON file."""
    data = {**json.loads(Path(PARENT).read_text(encoding="utf-8")), **overrides}
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def step(*parts: dict[str, Any] | str, delay_s: float = 0.0) -> dict[str, Any]:
    """One scripted model answer: texts and function calls."""
    wire = [{"text": p} if isinstance(p, str) else p for p in parts]
    return {"delay_s": delay_s, "content": {"role": "model", "parts": wire}}


def call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    """A function call part of a scripted answer."""
    return {"functionCall": {"id": call_id, "name": name, "args": args}}


def events_of(forkq: Run, fork_id: str) -> list[dict[str, Any]]:
    """The fork's events, read through `forkq events --json`."""
    code, out, err = forkq("events", fork_id, "--json")
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll `predicate` until it holds; fail after `timeout` seconds naming `what`."""
    wait_until(predicate, timeout, what)

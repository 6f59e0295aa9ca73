"""The end of `forkq demo`'s tour: what each fork inherited (its bootstrap record) and returned (its result)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Any

from workers.client import ForkClient, ForkHandle
from workers.history.messages import Content
from workers.history.selection import is_real_user_turn
from workers.records.fork import ForkResult


def say(line: str) -> None:
    """One line of the tour, at once."""
    print(line, flush=True)


def report(client: ForkClient, handles: Mapping[str, ForkHandle], results: Mapping[str, ForkResult]) -> None:
    """For each fork: what it inherited (its bootstrap record) and what it returned (its result)."""
    say("")
    say("what each fork inherited (its bootstrap record) and returned (its result):")
    for label, handle in handles.items():
        record = client.inspect(handle.fork_id)
        say("")
        say(f"{label}  ({handle.fork_id}, {_kind(record)})")
        for line in _inherited(record):
            say(line)
        say(_files(client, handle.fork_id, record))
        for line in _returned(results.get(label)):
            say(line)


def _files(client: ForkClient, fork_id: str, record: Mapping[str, Any]) -> str:
    """The fork's workspace: its own copy of the parent's files, and what it changed (never the parent's tree)."""
    ref = record.get("workspace") or {}
    if ref.get("mode") != "snapshot":
        return _field("files", f"the parent's {record['cwd']} in place (shared)")
    changes = client.changes(fork_id)
    changed = ", ".join(changes.paths) if changes.paths else "none"
    return _field("files", f"its own copy of {len(changes.base)} files (sandboxed); changed: {clip(changed, 50)}")


def _kind(record: Mapping[str, Any]) -> str:
    """How the record says the child was launched."""
    if record["kind"] == "fork":
        return "completed turns" if record["seed_mode"] == "completed_turns" else f"fork_turns {record['fork_turns']!r}"
    return f"subagent {record['agent']}, {record['agent_source']}"


def _inherited(record: Mapping[str, Any]) -> list[str]:
    """Lines on the fork's seed: sizes, first and last message, directive, task prompt."""
    messages = [Content.model_validate(m) for m in record["initial_messages"]]
    real = sum(is_real_user_turn(c) for c in messages)
    head = f"{len(messages)} messages, {real} real user turns"
    directive = str(record["directive"])
    if not messages:
        head += " (a regular subagent starts fresh)"
    elif any(directive in (p.text or "") for c in messages if is_real_user_turn(c) for p in c.parts):
        head += ", the last one hands over the directive"
    lines = [_field("inherited", head, indent=2)]
    if record["kind"] == "spawn" or record["seed_mode"] == "completed_turns":
        tools = ", ".join(str(t.get("name")) for t in record["tools"])
        prompt = next((line for line in str(record["system_instruction"]).splitlines() if line.strip()), "")
        lines.append(_field("persona", clip(prompt)))
        lines.append(_field("tools", clip(tools, 70)))
    if messages:
        lines.append(_field("first", f"{messages[0].role:<5} {_preview(messages[0])}"))
        lines.append(_field("last", f"{messages[-1].role:<5} {_preview(messages[-1])}"))
    if record["kind"] == "fork":
        lines.append(_field("directive", clip(directive)))
    first_line = next((line for line in str(record["task_prompt"]).splitlines() if line.strip()), "")
    lines.append(_field("task", clip(first_line)))
    return lines


def _returned(result: ForkResult | None) -> list[str]:
    """Lines on the fork's result: status, usage, output."""
    if result is None:
        return [_field("returned", "nothing (the fork did not end in time)", indent=2)]
    usage = result.usage
    head = (
        f"{result.status.value}: {usage.model_calls} model calls, {usage.tool_uses} tool uses, "
        f"{usage.total_tokens:,} tokens ({usage.input_tokens:,} in, {usage.output_tokens:,} out), "
        f"{usage.duration_ms / 1000:.2f} s"
    )
    text = result.output if result.output is not None else f"error: {result.error}"
    wrapped = textwrap.wrap(" ".join(text.split()), width=86) or [""]
    return [
        _field("returned", head, indent=2),
        *(_field("output" if i == 0 else "", chunk) for i, chunk in enumerate(wrapped)),
    ]


def _field(label: str, text: str, *, indent: int = 4) -> str:
    """One report line; labels at two indents, values in one column."""
    return " " * indent + f"{label:<{13 - indent}} {text}"


def _preview(content: Content) -> str:
    """The message's first part in at most 60 characters: its text, or the call or response it holds."""
    if not content.parts:
        return "(no parts)"
    part = content.parts[0]
    if part.function_call is not None:
        text = f"[call {part.function_call.name}]"
    elif part.function_response is not None:
        text = f"[response of {part.function_response.name}]"
    else:
        text = part.text or "[media]"
    more = f" (+{len(content.parts) - 1} more)" if len(content.parts) > 1 else ""
    return clip(text) + more


def clip(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"

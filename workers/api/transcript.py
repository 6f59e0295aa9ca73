"""A fork's transcript: a summary of its seed, then every journaled step, for a person to read.

The steps come from the journal (`workers.records.journal`): model responses (their text and the calls
they made, with arguments), tool results (cut to a limit), people's decisions on parked calls, and the
feedback sent back when a final answer failed the output schema. Entries that only matter to a revival
(`surface`, `tool_started`) are left out. Nothing here reads settings: no API key can reach a transcript.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from workers.history.messages import Content
from workers.records.fork import BootstrapRecord, ForkState, Status
from workers.records.journal import JournalEntry
from workers.subagents.launch import launch_settings


class SeedSummary(BaseModel):
    """What the fork started from: its seed's size and the launch, not the inherited messages themselves."""

    kind: str
    parent_session: str
    messages: int = Field(description="Messages inherited from the parent (0 for a regular subagent).")
    fork_turns: str | None
    task_prompt: str
    directive: str
    model: str | None
    cwd: str
    depth: int
    approval_mode: str
    tools: list[str] = Field(description="The declared tools' names.")
    settings: dict[str, Any] = Field(description="The launch's own settings (as `forkq inspect` shows them).")


class Call(BaseModel):
    """A tool call a model response made."""

    call_id: str | None
    name: str | None
    args: dict[str, Any]


class Step(BaseModel):
    """One journaled step; which fields are set depends on `kind`."""

    seq: int
    step: int
    kind: Literal["model", "tool_result", "approval", "feedback"]
    text: str | None = Field(None, description="model: its text; feedback: the message sent back.")
    calls: list[Call] | None = Field(None, description="model: the tool calls it made.")
    input_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    call_id: str | None = None
    name: str | None = None
    output: str | None = Field(None, description="tool_result: what the tool returned (text or JSON), cut.")
    error: str | None = Field(None, description="tool_result: the error the model read instead, cut.")
    chars: int | None = Field(None, description="tool_result: the length of the whole output or error.")
    truncated: bool | None = None
    decision: Literal["approve", "deny"] | None = None
    reason: str | None = None


class Transcript(BaseModel):
    """A fork's transcript."""

    fork_id: str
    status: Status
    description: str
    seed: SeedSummary
    steps: list[Step]


def build_transcript(
    state: ForkState, record: BootstrapRecord, entries: Sequence[JournalEntry], *, max_chars: int
) -> Transcript:
    """The transcript of a fork from its state, record and journal; tool results cut to `max_chars` characters."""
    seed = SeedSummary(
        kind=record.kind,
        parent_session=record.parent_session,
        messages=record.message_count,
        fork_turns=record.fork_turns,
        task_prompt=record.task_prompt,
        directive=record.directive,
        model=record.model,
        cwd=record.cwd,
        depth=record.depth,
        approval_mode=record.approval_mode,
        tools=[str(tool.get("name")) for tool in record.tools],
        settings=launch_settings(record),
    )
    steps = [step for entry in entries if (step := _step(entry, max_chars)) is not None]
    return Transcript(fork_id=state.fork_id, status=state.status, description=state.description, seed=seed, steps=steps)


def _step(entry: JournalEntry, max_chars: int) -> Step | None:
    common: dict[str, Any] = {"seq": entry.seq, "step": entry.step}
    if entry.kind == "model":
        content = Content.model_validate(entry.content or {"role": "model"})
        calls = [
            Call(call_id=p.function_call.id, name=p.function_call.name, args=p.function_call.args or {})
            for p in content.parts
            if p.function_call is not None
        ]
        return Step(
            **common,
            kind="model",
            text=_text(content),
            calls=calls,
            input_tokens=entry.input_tokens,
            output_tokens=entry.output_tokens,
            finish_reason=entry.finish_reason,
        )
    if entry.kind == "tool_result":
        return Step(**common, kind="tool_result", call_id=entry.call_id, name=entry.name, **_result(entry, max_chars))
    if entry.kind == "approval":
        return Step(
            **common,
            kind="approval",
            call_id=entry.call_id,
            name=entry.name,
            decision=entry.decision,
            reason=entry.reason,
        )
    if entry.kind == "feedback":
        return Step(**common, kind="feedback", text=_text(Content.model_validate(entry.content or {"role": "user"})))
    return None


def _text(content: Content) -> str:
    """The text a message shows (its thoughts left out)."""
    return "".join(part.text for part in content.parts if part.text is not None and not part.thought)


def _result(entry: JournalEntry, max_chars: int) -> dict[str, Any]:
    """A tool result's `output` or `error`, as text cut to `max_chars`, with its whole length."""
    response = entry.response or {}
    field = "error" if "error" in response and "output" not in response else "output"
    value = response.get(field)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return {field: text[:max_chars], "chars": len(text), "truncated": len(text) > max_chars}

"""A fork's transcript: a summary of its seed, then every journaled step, for a person to read.

The steps are those of the journal's fold (`workers.records.conversation`), mapped one to one: model
responses (their text and the calls they made, with arguments), tool results (cut to a limit), people's
decisions on parked calls, the feedback sent back when a final answer failed the output schema, and the
messages `send` gave the fork, as they were delivered. Entries that only matter to a revival (`surface`,
`tool_started`) have no step. Nothing here reads settings: no API key can reach a transcript.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, assert_never

from pydantic import BaseModel, Field

from broker_config.settings import DEFAULT_TENANT
from workers.base.keys import session_named
from workers.records.conversation import (
    Approval,
    Delivered,
    Feedback,
    ModelTurn,
    ReadStep,
    ToolResult,
    fold,
    visible_text,
)
from workers.records.fork import BootstrapRecord, ForkState, Status
from workers.records.journal import JournalEntry
from workers.subagents.launch import launch_settings


class SeedSummary(BaseModel):
    """What the fork started from: its seed's size and the launch, not the inherited messages themselves."""

    kind: str
    parent_session: str
    tenant: str = Field(DEFAULT_TENANT, description="The tenant that launched the fork.")
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
    kind: Literal["model", "tool_result", "approval", "feedback", "message"]
    text: str | None = Field(
        None, description="model: its text; feedback: the message sent back; message: the message delivered."
    )
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
    changed: list[str] | None = Field(None, description="tool_result of a snapshot fork: the files the call changed.")
    decision: Literal["approve", "deny"] | None = None
    reason: str | None = None
    decided_by: str | None = Field(None, description="approval: `token:<id>` of the API token, or `local`.")
    decided_tenant: str | None = Field(None, description="approval: the tenant of who decided.")
    decided_ms: int | None = Field(None, description="approval: when (Unix ms).")


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
        parent_session=session_named(record.parent_session),
        tenant=record.owner_tenant,
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
    steps = [_step(step, max_chars) for step in fold(entries, fork_id=state.fork_id).steps]
    return Transcript(fork_id=state.fork_id, status=state.status, description=state.description, seed=seed, steps=steps)


def _step(step: ReadStep, max_chars: int) -> Step:
    match step:
        case ModelTurn():
            calls = [Call(call_id=c.id, name=c.name, args=c.args or {}) for _, c in step.calls]
            return Step(
                seq=step.seq,
                step=step.step,
                kind="model",
                text=visible_text(step.content),
                calls=calls,
                input_tokens=step.input_tokens,
                output_tokens=step.output_tokens,
                finish_reason=step.finish_reason,
            )
        case ToolResult():
            result = _result(step.response, max_chars)
            return Step(
                seq=step.seq,
                step=step.step,
                kind="tool_result",
                call_id=step.call_id,
                name=step.name,
                changed=list(step.changed) or None,
                **result,
            )
        case Approval():
            return Step(
                seq=step.seq,
                step=step.step,
                kind="approval",
                call_id=step.call_id,
                name=step.name,
                decision=step.decision,
                reason=step.reason,
                decided_by=step.decided_by,
                decided_tenant=step.decided_tenant,
                decided_ms=step.decided_ms,
            )
        case Feedback():
            return Step(seq=step.seq, step=step.step, kind="feedback", text=visible_text(step.content))
        case Delivered():
            return Step(seq=step.seq, step=step.step, kind="message", text=visible_text(step.content))
        case _:
            assert_never(step)


def _result(response: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """A tool result's `output` or `error`, as text cut to `max_chars`, with its whole length."""
    field = "error" if "error" in response and "output" not in response else "output"
    value = response.get(field)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return {field: text[:max_chars], "chars": len(text), "truncated": len(text) > max_chars}

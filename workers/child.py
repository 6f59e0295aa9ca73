"""The child agent loop: model call, tool calls, repeat until the model answers without calls.

The loop is driven by the fork's journal: every model response and every tool call (before it runs
and after) is appended through a fenced writer, so a revived run replays what was recorded and
re-calls nothing. Everything the loop touches is passed in, so it runs without a broker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from workers.history import ForkSeed
from workers.journal import INTERRUPTED_ERROR, JournalEntry, PendingCall, Replay, calls_of, replay, response_part
from workers.journal import request_digest as digest_of
from workers.messages import Content
from workers.providers import ModelProvider, ModelRequest
from workers.records import BootstrapRecord, ForkResult, Status, Usage
from workers.tools import ToolContext, ToolRegistry

NO_OUTPUT = "(subagent produced no model-visible output)"


class ForkIO(Protocol):
    """The loop's link to Redis: buffered progress events and fenced journal writes."""

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        """Queue a progress event (published with the next checkpoint or append)."""
        ...

    def checkpoint(self) -> None:
        """A step boundary: publish queued events; raise `Stopped` if the fork must stop here."""
        ...

    def append(self, entry: JournalEntry, *, boundary: bool = False) -> None:
        """Append a journal entry with the queued events (fenced: raises LeaseLost when refused).

        With `boundary`, the entry starts a side effect: raise `Stopped` first if the fork must stop.
        """
        ...


class Stopped(Exception):
    """The loop stopped at a step boundary (cancel, shutdown, lost lease); `reason` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class ChildLoop:
    """One fork's agent loop over its seed and journal."""

    record: BootstrapRecord
    seed: ForkSeed
    provider: ModelProvider
    tools: ToolRegistry
    io: ForkIO
    entries: list[JournalEntry] = field(default_factory=list)
    max_turns: int = 200
    declarations: list[dict[str, Any]] = field(init=False)  # parsed once, sent with every request

    def __post_init__(self) -> None:
        self.declarations = self.record.tools

    def run(self) -> ForkResult:
        """Run to the final answer or the turn limit.

        Raises:
            Stopped: at a boundary, when the fork must stop (cancel, shutdown, lost lease).
            LeaseLost: a fenced journal write was refused.
        """
        started = time.monotonic()
        state = replay(self.seed, self.entries)
        while state.final is None:
            if state.pending:
                self._run_tools(state)
                continue
            if state.step >= self.max_turns:
                return self._result(
                    state, started, Status.FAILED, None, f"max_turns: stopped after {self.max_turns} model calls"
                )
            self._model_step(state)
        return self._result(state, started, Status.SUCCEEDED, final_text(state.final), None)

    def _write(self, state: Replay, *, boundary: bool = False, **fields: Any) -> JournalEntry:
        entry = JournalEntry(seq=state.next_seq, **fields)
        self.io.append(entry, boundary=boundary)
        state.next_seq += 1
        return entry

    def _model_step(self, state: Replay) -> None:
        request = self._request(state.step, state.messages)
        digest = digest_of(request.model_dump(mode="json", exclude={"directive"}))  # what the model sees
        self.io.emit("model_call", {"step": state.step + 1, "request_digest": digest})
        self.io.checkpoint()
        response = self.provider.generate(request)
        content = response.content
        calls = calls_of(content)
        self.io.emit(
            "step",
            {
                "step": state.step + 1,
                "tool_calls": [c.name for _, c in calls],
                "input_tokens": response.usage.input_tokens,
                "output_tokens": response.usage.output_tokens,
            },
        )
        self._write(
            state,
            step=state.step,
            kind="model",
            content=content.to_wire(),
            request_digest=digest,
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            invalid_calls=response.invalid_calls or None,
        )
        state.messages.append(content)
        state.input_tokens += response.usage.input_tokens
        state.output_tokens += response.usage.output_tokens
        state.step += 1
        state.answers = {}
        invalid = response.invalid_calls
        state.pending = [PendingCall(i, c, started=False, invalid=invalid.get(c.id or "")) for i, c in calls]
        state.final = None if calls else content

    def _run_tools(self, state: Replay) -> None:
        step = state.step - 1
        for pending in list(state.pending):
            call = pending.call
            tool = self.tools.get(call.name)
            if pending.invalid is not None:  # garbled by the provider: the model reads why, nothing runs
                outcome: dict[str, Any] = {"error": pending.invalid}
            elif pending.started and not (tool is not None and tool.idempotent):
                outcome = {"error": INTERRUPTED_ERROR}
            else:
                self._write(
                    state,
                    boundary=True,
                    step=step,
                    kind="tool_started",
                    call_index=pending.index,
                    call_id=call.id,
                    name=call.name,
                )
                ctx = ToolContext(
                    fork_id=self.record.fork_id,
                    cwd=Path(self.record.cwd),
                    call_id=call.id,
                    idempotency_key=f"{self.record.fork_id}:{step}:{call.id or pending.index}",
                )
                outcome = self.tools.run(call, ctx)
            self.io.emit("tool", {"step": step + 1, "tool": call.name, "ok": "error" not in outcome})
            self._write(
                state,
                step=step,
                kind="tool_result",
                call_index=pending.index,
                call_id=call.id,
                name=call.name,
                response=outcome,
            )
            state.answers[pending.index] = response_part(call, outcome)
            state.pending.remove(pending)
            state.tool_uses += 1
        last = state.messages[-1]
        state.messages.append(state.answer_content(calls_of(last)))

    def _request(self, step: int, messages: list[Content]) -> ModelRequest:
        record = self.record
        return ModelRequest(
            fork_id=record.fork_id,
            step=step,
            model=record.model,
            system_instruction=record.system_instruction,
            tools=self.declarations,
            messages=list(messages),
            generation=record.generation,
            directive=record.directive,
        )

    def _result(
        self, state: Replay, started: float, status: Status, output: str | None, error: str | None
    ) -> ForkResult:
        usage = Usage(
            input_tokens=state.input_tokens,
            output_tokens=state.output_tokens,
            total_tokens=state.input_tokens + state.output_tokens,
            tool_uses=state.tool_uses,
            model_calls=state.step,
            duration_ms=int((time.monotonic() - started) * 1000),
        )
        return ForkResult(fork_id=self.record.fork_id, status=status, output=output, usage=usage, error=error)


def final_text(content: Content) -> str:
    """The model-visible text of a final answer (thoughts excluded)."""
    text = "".join(p.text for p in content.parts if p.text is not None and not p.thought)
    return text if text.strip() else NO_OUTPUT

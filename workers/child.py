"""The child agent loop: model call, tool calls, repeat until the model answers without calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.history import ForkSeed
from workers.messages import Content, FunctionResponse, Part
from workers.providers import ModelProvider, ModelRequest
from workers.records import BootstrapRecord, ForkResult, Status, Usage
from workers.tools import ToolContext, ToolRegistry

NO_OUTPUT = "(subagent produced no model-visible output)"

EventSink = Callable[[str, dict[str, Any]], None]


@dataclass
class ChildLoop:
    """One fork's agent loop, with everything it needs passed in (testable without a broker)."""

    record: BootstrapRecord
    seed: ForkSeed
    provider: ModelProvider
    tools: ToolRegistry
    emit: EventSink
    cancelled: Callable[[], bool]
    max_turns: int = 200

    def run(self) -> ForkResult:
        """Run to the final answer, a cancellation, or the turn limit."""
        started = time.monotonic()
        usage = Usage()
        messages = [*self.seed.initial_messages, Content(role="user", parts=[Part(text=self.seed.task_prompt)])]
        for step in range(self.max_turns):
            if self.cancelled():
                return self._result(Status.CANCELLED, None, usage, started, "cancelled by request")
            response = self.provider.generate(self._request(step, messages))
            messages.append(response.content)
            usage.model_calls += 1
            usage.input_tokens += response.usage.input_tokens
            usage.output_tokens += response.usage.output_tokens
            calls = [p.function_call for p in response.content.parts if p.function_call is not None]
            self.emit(
                "step",
                {
                    "step": step + 1,
                    "tool_calls": [c.name for c in calls],
                    "input_tokens": response.usage.input_tokens,
                    "output_tokens": response.usage.output_tokens,
                },
            )
            if not calls:
                return self._result(Status.SUCCEEDED, final_text(response.content), usage, started, None)
            answers = []
            for call in calls:
                if self.cancelled():
                    return self._result(Status.CANCELLED, None, usage, started, "cancelled by request")
                ctx = ToolContext(
                    fork_id=self.record.fork_id,
                    cwd=Path(self.record.cwd),
                    call_id=call.id,
                    idempotency_key=f"{self.record.fork_id}:{step}:{call.id}",
                )
                outcome = self.tools.run(call, ctx)
                usage.tool_uses += 1
                self.emit("tool", {"step": step + 1, "tool": call.name, "ok": "error" not in outcome})
                answers.append(Part(function_response=FunctionResponse(id=call.id, name=call.name, response=outcome)))
            messages.append(Content(role="user", parts=answers))
        return self._result(
            Status.FAILED, None, usage, started, f"max_turns: stopped after {self.max_turns} model calls"
        )

    def _request(self, step: int, messages: list[Content]) -> ModelRequest:
        record = self.record
        return ModelRequest(
            fork_id=record.fork_id,
            step=step,
            model=record.model,
            system_instruction=record.system_instruction,
            tools=record.tools,
            messages=messages,
            generation=record.generation,
            directive=record.directive,
        )

    def _result(
        self, status: Status, output: str | None, usage: Usage, started: float, error: str | None
    ) -> ForkResult:
        usage.total_tokens = usage.input_tokens + usage.output_tokens
        usage.duration_ms = int((time.monotonic() - started) * 1000)
        return ForkResult(fork_id=self.record.fork_id, status=status, output=output, usage=usage, error=error)


def final_text(content: Content) -> str:
    """The model-visible text of a final answer (thoughts excluded)."""
    text = "".join(p.text for p in content.parts if p.text is not None and not p.thought)
    return text if text.strip() else NO_OUTPUT

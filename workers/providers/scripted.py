"""The scripted provider, for demos and tests only: deterministic answers from a JSON script.

Script (`FORKQ_SCRIPT`): `{"steps": [{"delay_s": 0.5, "content": <model Content>}, ...]}`, a step's `usage`
optional (the tokens it reports, e.g. `{"input_tokens": 100, "output_tokens": 20}`; else about a token per four
characters of the request's and the answer's text). The
fork's k-th model call returns step k after sleeping `delay_s`, so a revived fork gets the same
answers; past the last step it answers with a final text. Without a script it answers with a short
report of what the fork received.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.errors import ConfigurationError
from workers.history.messages import Content, Part
from workers.history.selection import is_real_user_turn
from workers.providers import ModelRequest, ModelResponse, TokenUsage

DEFAULT_DELAY_S = 0.2


class ScriptStep(BaseModel):
    """One scripted model answer."""

    model_config = ConfigDict(extra="forbid")

    delay_s: float = Field(0.0, ge=0, le=3600)
    content: Content
    usage: TokenUsage | None = None  # what the step reports (token budgets' tests); None: counted from the text


class Script(BaseModel):
    """A whole script."""

    model_config = ConfigDict(extra="forbid")

    steps: list[ScriptStep]


def load_script(path: Path) -> Script:
    """Read and validate a script file.

    Raises:
        ConfigurationError: unreadable file or wrong shape, with the path and the first problem.
    """
    try:
        return Script.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError, ValidationError) as exc:
        raise ConfigurationError(
            f"FORKQ_SCRIPT {str(path)!r} is not a scripted-provider file ({exc}); expected "
            '{"steps": [{"delay_s": 0.5, "content": {"role": "model", "parts": [...]}}]}',
            field="script",
            cause=exc,
        ) from exc


class ScriptedProvider:
    """Deterministic stand-in for a model; named so that nobody mistakes it for one."""

    name = "scripted"

    def __init__(self, script: Script | None = None, *, default_delay_s: float = DEFAULT_DELAY_S) -> None:
        self.script = script
        self.default_delay_s = default_delay_s

    def generate(self, request: ModelRequest) -> ModelResponse:
        """Step `request.step` of the script, or a final text past its end."""
        if self.script is not None and request.step < len(self.script.steps):
            step = self.script.steps[request.step]
            if step.delay_s:  # sleep(0) would still hand the GIL to another thread
                time.sleep(step.delay_s)
            content = step.content
            if step.usage is not None:
                return ModelResponse(content=content, usage=step.usage)
        else:
            time.sleep(self.default_delay_s if self.script is None else 0.0)
            content = Content(role="model", parts=[Part(text=self._final_text(request))])
        tokens_in = sum(len(p.text or "") for c in request.messages for p in c.parts) // 4
        tokens_out = sum(len(p.text or "") for p in content.parts) // 4
        return ModelResponse(content=content, usage=TokenUsage(input_tokens=tokens_in, output_tokens=tokens_out))

    def _final_text(self, request: ModelRequest) -> str:
        if self.script is not None:
            return f"Scripted run complete after {len(self.script.steps)} scripted steps."
        real = sum(is_real_user_turn(c) for c in request.messages)
        return (
            f"[scripted provider] received {len(request.messages)} messages ({real} real user turns, "
            f"{len(request.tools)} tools); directive: {request.directive}"
        )

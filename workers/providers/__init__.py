"""Model providers: one request in (system instruction, tools, messages, settings), one response out."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from workers.messages import Content


class ModelRequest(BaseModel):
    """Everything a model call sees; identical inputs give identical requests (and digests)."""

    model_config = ConfigDict(frozen=True)

    fork_id: str
    step: int  # the fork's k-th model call, counted from 0
    model: str | None
    system_instruction: str | dict[str, Any] | None
    tools: list[dict[str, Any]]
    messages: list[Content]
    generation: dict[str, Any] = Field(default_factory=dict)
    directive: str = ""


class TokenUsage(BaseModel):
    """Tokens one model call consumed."""

    input_tokens: int = 0
    output_tokens: int = 0


class ModelResponse(BaseModel):
    """A model's answer: a model Content, its token usage and why it stopped."""

    content: Content
    usage: TokenUsage = Field(default_factory=TokenUsage)
    finish_reason: str = "stop"


class ModelProvider(Protocol):
    """Anything that turns a `ModelRequest` into a `ModelResponse`."""

    name: str

    def generate(self, request: ModelRequest) -> ModelResponse:
        """Call the model once."""
        ...

"""Model providers: one request in (system instruction, tools, messages, settings, output schema), one response out."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from workers.errors import ConfigurationError
from workers.history.messages import Content


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
    # the launch's JSON schema of the final answer: adapters send it natively (else as text in the request)
    output_schema: dict[str, Any] | None = None
    # the provider's prompt-cache key: the parent session, shared by sibling forks. It routes the request to a
    # cache and is not what the model reads, so it is left out of dumps and thus of the request digest
    cache_key: str | None = Field(default=None, exclude=True)


class TokenUsage(BaseModel):
    """Tokens one model call consumed; `cached_input_tokens` (part of `input_tokens`) were read from the
    provider's prompt cache, when the provider reports them."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0


class ModelResponse(BaseModel):
    """A model's answer: a model Content, its token usage and why it stopped.

    `finish_reason` is normalised across providers: `stop`, `tool_calls`, `length`, `content_filter`,
    else the provider's own reason in lower case (e.g. Gemini's `malformed_function_call`).

    `invalid_calls` maps a call id to the error text the model must read for a call the provider
    returned in unusable form (e.g. arguments that are not a JSON object). Such a call is still a
    `functionCall` part of `content` (with `args` `{}` and that id), so the history stays paired; the
    loop must answer it with `{"error": <text>}` without running the tool.
    """

    content: Content
    usage: TokenUsage = Field(default_factory=TokenUsage)
    finish_reason: str = "stop"
    invalid_calls: dict[str, str] = Field(default_factory=dict)


class ModelProvider(Protocol):
    """Anything that turns a `ModelRequest` into a `ModelResponse`."""

    name: str

    def generate(self, request: ModelRequest) -> ModelResponse:
        """Call the model once."""
        ...


def require_model(request: ModelRequest, provider: str) -> str:
    """The request's model name.

    Raises:
        ConfigurationError: there is none.
    """
    if not request.model:
        raise ConfigurationError(
            f"fork {request.fork_id}: the {provider} provider needs a model name and the fork has none; "
            "launch it from a parent that names its model",
            fork_id=request.fork_id,
            field="model",
        )
    return request.model

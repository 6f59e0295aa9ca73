"""Gemini through the official `google-genai` client: native Contents, function declarations, usage metadata.

Our Contents are already Gemini's, so they go over the wire as they are, minus the keys the Gemini
API does not know (unknown keys round-trip through forkq, but the API rejects them). Declarations
send their JSON schema as `parametersJsonSchema`: forkq's declarations are JSON Schema, while
Gemini's `parameters` is an OpenAPI subset that the SDK would rewrite or reject (`oneOf`). For the
same reason an output schema goes as `responseJsonSchema` (with `responseMimeType`
`application/json`); a model that refuses it (e.g. one that does not combine function calling with a
JSON response) gets the schema as text in the system instruction (`workers/providers/output_schema.py`).
Gemini caches prompt prefixes implicitly (no key to send); the answer's `cachedContentTokenCount` is
reported as `cached_input_tokens`.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, get_args

from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from pydantic import BaseModel, ValidationError
from pydantic.alias_generators import to_camel, to_snake

from workers.errors import ConfigurationError, ProviderError
from workers.history.messages import Content
from workers.providers import ModelRequest, ModelResponse, TokenUsage, require_model
from workers.providers.declarations import function_declarations, parameters_schema
from workers.providers.output_schema import SchemaModes, generate_with_schema, schema_note
from workers.providers.retry import Failure, RetryPolicy, call_with_retries, is_retryable_status, parse_retry_after

log = logging.getLogger("forkq.provider")

# GenerateContentConfig fields a fork's generation settings may not set: the adapter owns them
RESERVED_CONFIG = frozenset(
    {"http_options", "system_instruction", "tools", "automatic_function_calling", "should_return_http_response"}
)
GENERATION_ALIASES = {"max_tokens": "max_output_tokens", "stop": "stop_sequences"}
FILTERED = frozenset(
    {"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "IMAGE_SAFETY", "IMAGE_PROHIBITED_CONTENT"}
)
FINISH_REASONS = {"STOP": "stop", "MAX_TOKENS": "length"} | dict.fromkeys(FILTERED, "content_filter")
_RETRY_DELAY = re.compile(r"^(\d+(?:\.\d+)?)s$")


class GeminiProvider:
    """A `ModelProvider` over the Gemini Developer API (`models/{model}:generateContent`); thread-safe."""

    name = "gemini"

    def __init__(
        self, *, api_key: str, base_url: str, timeout_s: float, retry: RetryPolicy, api_version: str = "v1beta"
    ) -> None:
        # explicit vertexai, key, base URL and API version: the SDK reads no environment variable of its own
        # (v1beta: thought signatures, call ids and parametersJsonSchema); attempts=1: ours are the only retries
        options = types.HttpOptions(
            base_url=base_url,
            api_version=api_version,
            timeout=max(1, round(timeout_s * 1000)),  # milliseconds
            retry_options=types.HttpRetryOptions(attempts=1),
        )
        self._client = genai.Client(vertexai=False, api_key=api_key, http_options=options)
        self._secret = api_key
        self._timeout_s = timeout_s
        self._base_url = self.endpoint = base_url  # the endpoint: the scope of a shared cooldown (with the model)
        self.retry = retry
        self.schemas = SchemaModes()  # the models that refused `responseJsonSchema`

    def __repr__(self) -> str:
        return f"GeminiProvider(base_url={self._base_url!r})"

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def generate(self, request: ModelRequest) -> ModelResponse:
        """One `generateContent` call, retried on transient failures.

        Raises:
            ConfigurationError: the request names no model, or its generation settings do not fit Gemini.
            ProviderError: the API failed for good, or answered without a candidate (e.g. a blocked prompt).
        """
        model = require_model(request, self.name)
        contents = to_contents(request.messages)
        send = functools.partial(self._generate, request, model, contents)
        return generate_with_schema(request, self.schemas, send, provider=self.name, model=model)

    def _generate(
        self, request: ModelRequest, model: str, contents: list[types.Content], native: bool
    ) -> ModelResponse:
        config = generation_config(request, native=native)
        response = call_with_retries(
            lambda: self._client.models.generate_content(model=model, contents=contents, config=config),
            provider=self.name,
            model=model,
            policy=self.retry,
            classify=self._classify,
            secrets=(self._secret,),
            fork_id=request.fork_id,
            endpoint=self.endpoint,
        )
        return from_response(response, model=model, fork_id=request.fork_id)

    def _classify(self, exc: Exception) -> Failure | None:
        if isinstance(exc, genai_errors.APIError):
            detail = exc.message or exc.status or "no detail"
            headers = getattr(exc.response, "headers", None)
            retry_after = parse_retry_after(headers) or _retry_info_delay(exc.details)
            return Failure(is_retryable_status(exc.code), exc.code, str(detail), retry_after)
        if isinstance(exc, ValidationError):
            # the SDK could not parse the answer (e.g. a proxy's functionCall.args that is not an object):
            # the server broke the API's schema, and asking again would get the same
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"]))
            return Failure(False, None, f"the answer does not fit the SDK's {exc.title} ({where}: {first['msg']})")
        kind = transport_failure(exc)
        if kind == "timeout":
            return Failure(True, None, f"no answer within {self._timeout_s:g}s (FORKQ_PROVIDER_TIMEOUT_S)")
        if kind == "connection":
            return Failure(True, None, f"connection failed: {type(exc).__name__}: {exc}")
        return None


def transport_failure(exc: Exception) -> str | None:
    """`timeout` or `connection` for a transport exception, else None.

    google-genai lets its HTTP transport's exceptions through unwrapped, and the transport is `httpx`
    or `httpx2` depending on the SDK release; matching by class name keeps this adapter working with
    either without importing one.
    """
    names = {cls.__name__ for cls in type(exc).__mro__}
    if type(exc).__module__.split(".")[0] in ("httpx", "httpx2"):
        if "TimeoutException" in names:
            return "timeout"
        if "TransportError" in names:
            return "connection"
    return "connection" if isinstance(exc, ConnectionError) else None


def _retry_info_delay(details: Any) -> float | None:
    """The `retryDelay` of a `google.rpc.RetryInfo` error detail (Gemini's 429s carry one), in seconds."""
    error = details.get("error", details) if isinstance(details, dict) else {}
    for item in error.get("details") or [] if isinstance(error, dict) else []:
        delay = item.get("retryDelay") if isinstance(item, dict) else None
        match = _RETRY_DELAY.match(delay) if isinstance(delay, str) else None
        if match:
            return float(match.group(1))
    return None


# --- request conversion ------------------------------------------------------------------------------


def to_contents(messages: list[Content]) -> list[types.Content]:
    """genai Contents for our Contents, keys the Gemini API does not know dropped."""
    return [types.Content.model_validate(fit(c.to_wire(), types.Content)) for c in messages]


def fit(value: Any, model: type[BaseModel]) -> Any:
    """`value` (a wire dict) with only the keys `model` knows, recursively; data inside fields kept as is."""
    if not isinstance(value, dict):
        return value
    names = {to_camel(name): name for name in model.model_fields} | {name: name for name in model.model_fields}
    kept: dict[str, Any] = {}
    for key, item in value.items():
        name = names.get(key)
        if name is None:
            continue
        nested = _model_in(model.model_fields[name].annotation)
        if nested is None:
            kept[key] = item
        else:
            kept[key] = [fit(i, nested) for i in item] if isinstance(item, list) else fit(item, nested)
    return kept


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation like `Optional[list[Part]]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def to_tools(tools: list[dict[str, Any]]) -> list[types.Tool]:
    """One genai Tool holding every function declaration (JSON schema as `parametersJsonSchema`)."""
    declarations = [
        types.FunctionDeclaration(
            name=d["name"], description=d.get("description"), parameters_json_schema=parameters_schema(d)
        )
        for d in function_declarations(tools)
    ]
    return [types.Tool(function_declarations=declarations)] if declarations else []


def system_instruction(value: str | dict[str, Any] | None) -> str | types.Content | None:
    """The system instruction: a string as is, a Content-like object as a genai Content."""
    if value is None or isinstance(value, str):
        return value or None
    if "parts" not in value and isinstance(value.get("text"), str):
        return str(value["text"])
    return types.Content.model_validate(fit(value, types.Content))


def with_note(instruction: str | types.Content | None, note: str) -> str | types.Content:
    """A system instruction with `note` after it: a string joined, a Content given one more text part."""
    if isinstance(instruction, types.Content):
        return instruction.model_copy(update={"parts": [*(instruction.parts or []), types.Part(text=note)]})
    return f"{instruction}\n\n{note}" if instruction else note


def generation_config(request: ModelRequest, *, native: bool = True) -> types.GenerateContentConfig:
    """The request's GenerateContentConfig: system instruction, tools, the fork's generation settings,
    and its output schema as `responseJsonSchema` or (not `native`) stated in the system instruction.

    Raises:
        ConfigurationError: a generation setting has a value Gemini does not accept.
    """
    settings: dict[str, Any] = {}
    for key, value in request.generation.items():
        name = GENERATION_ALIASES.get(to_snake(key), to_snake(key))
        if name in types.GenerateContentConfig.model_fields and name not in RESERVED_CONFIG:
            settings[name] = value
        else:
            log.debug("gemini: generation setting %r has no GenerateContentConfig equivalent; ignored", key)
    instruction = system_instruction(request.system_instruction)
    schema = request.output_schema
    if schema is not None and native:  # the launch's schema wins over one in the parent's generation settings
        settings.pop("response_schema", None)
        settings |= {"response_mime_type": "application/json", "response_json_schema": schema}
    elif schema is not None:
        instruction = with_note(instruction, schema_note(schema))
    try:
        return types.GenerateContentConfig(
            system_instruction=instruction,
            tools=to_tools(request.tools) or None,
            # the fork's loop runs the tools; the SDK must never call anything itself
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
            **settings,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigurationError(
            f"fork {request.fork_id}: generation setting {'.'.join(map(str, first['loc']))} does not fit Gemini's "
            f"GenerateContentConfig ({first['msg']}); fix the parent's generation settings",
            fork_id=request.fork_id,
            field="generation",
            cause=exc,
        ) from exc


# --- response conversion -----------------------------------------------------------------------------


def from_response(response: types.GenerateContentResponse, *, model: str, fork_id: str | None = None) -> ModelResponse:
    """Our response for the first candidate.

    Raises:
        ProviderError: there is no candidate (the prompt was blocked, or the answer is empty).
    """
    if not response.candidates:
        feedback = response.prompt_feedback
        reason = feedback.block_reason.value if feedback and feedback.block_reason else "none given"
        raise ProviderError(
            f"gemini model {model!r}: the response has no candidates (prompt block reason: {reason}); "
            "expected one candidate — the prompt was refused, rephrase the directive or check safety settings",
            provider="gemini",
            model=model,
            fork_id=fork_id,
        )
    candidate = response.candidates[0]
    wire = candidate.content.model_dump(mode="json", by_alias=True, exclude_none=True) if candidate.content else {}
    content = Content.model_validate({"role": "model", "parts": wire.get("parts") or []})
    calls = any(p.function_call is not None for p in content.parts)
    raw = candidate.finish_reason.value if candidate.finish_reason else "STOP"
    finish = FINISH_REASONS.get(raw, raw.lower())
    return ModelResponse(
        content=content,
        usage=token_usage(response.usage_metadata),
        finish_reason="tool_calls" if calls and finish == "stop" else finish,
    )


def token_usage(usage: types.GenerateContentResponseUsageMetadata | None) -> TokenUsage:
    """Our token usage for a response's usage metadata; thinking tokens count as output (they are billed so)."""
    if usage is None:
        return TokenUsage()
    return TokenUsage(
        input_tokens=usage.prompt_token_count or 0,
        output_tokens=(usage.candidates_token_count or 0) + (usage.thoughts_token_count or 0),
        # implicit (or explicit) context caching: the part of the prompt read from the cache
        cached_input_tokens=usage.cached_content_token_count or 0,
    )

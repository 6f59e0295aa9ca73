"""OpenAI-compatible Chat Completions (OpenAI, DashScope/Qwen, vLLM, Ollama, OpenRouter) through `openai`.

Contents become messages: the system instruction a `system` message; user text and media a `user`
message; model text an `assistant` message whose `tool_calls` carry the model's function calls, their
arguments as JSON strings; function responses `tool` messages whose `tool_call_id` answers the call
just before them. Deliberate choices (docs/capabilities.md, "Model providers"; the orphans of
docs/fork-history.md, "Decisions where the contract leaves a choice"):

- Calls without an id get `call_h<message index>_<i>`; a response without an id answers the first
  unanswered call of the same name. A response that answers no call of the preceding assistant
  message (an orphan) is dropped: these APIs pair strictly. A call left unanswered gets a synthetic
  error `tool` message, for the same reason.
- Thoughts are dropped (their signatures mean nothing to another provider); consecutive user
  messages are merged, since several chat templates (vLLM, Ollama) require alternating roles.
- Answers: tool calls whose arguments are not a JSON object stay function calls (args `{}`) and are
  listed in `ModelResponse.invalid_calls`, so the loop answers them with an error, not a crash.
- An output schema goes as `response_format` `json_schema`, `strict` only when the schema meets
  strict mode's rules (else the server would refuse it); a server that refuses `response_format`
  gets the schema as text in the system message (`workers/providers/output_schema.py`).
- Prompt caching: every request of a fork carries `prompt_cache_key`, the parent session's id (a
  digest of it when it is longer than the 64 characters the API takes), so the sibling forks of one
  parent are routed to one cache (`FORKQ_PROMPT_CACHE_KEY=false` leaves it out, for a server that
  refuses the parameter); the answer's `prompt_tokens_details.cached_tokens` is reported as
  `cached_input_tokens`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import openai
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageFunctionToolCall

from workers.errors import ProviderError
from workers.history.messages import Content, FunctionCall, Part
from workers.providers import ModelRequest, ModelResponse, TokenUsage, require_model
from workers.providers.declarations import function_declarations, parameters_schema
from workers.providers.output_schema import SchemaModes, generate_with_schema, schema_note
from workers.providers.retry import Failure, RetryPolicy, call_with_retries, is_retryable_status, parse_retry_after

log = logging.getLogger("forkq.provider")

NO_RESPONSE_ERROR = "no response was recorded for this call"
# our generation keys (snake or camel case) → Chat Completions parameters
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "topP": "top_p",
    "max_output_tokens": "max_tokens",
    "maxOutputTokens": "max_tokens",
    "max_tokens": "max_tokens",
    "stop_sequences": "stop",
    "stopSequences": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "presencePenalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "frequencyPenalty": "frequency_penalty",
}
AUDIO_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/mpeg": "mp3", "audio/mp3": "mp3"}
FINISH_REASONS = {"stop": "stop", "tool_calls": "tool_calls", "function_call": "tool_calls", "length": "length"}
# the keywords strict structured outputs accept (a subset of JSON Schema); a schema using others goes non-strict
STRICT_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "anyOf", "enum", "const",
        "description", "title", "$defs", "definitions", "$ref", "pattern", "format", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
    }
)  # fmt: skip
STRICT_MAX_DEPTH = 64
CACHE_KEY_MAX_CHARS = 64  # OpenAI refuses a longer prompt_cache_key (HTTP 400, string_above_max_length)
_FORMAT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Our body goes out as built, through the client's own `post` (so the same headers, auth, timeout and error
# types): `chat.completions.create` would first walk every message against its TypedDicts (`maybe_transform`),
# about 85% of a worker's CPU per call with a long history, to change nothing in the plain JSON we build.
# The options are what `create` passes; tests/providers/test_openai_wire.py holds the bodies equal.
CHAT_PATH = "/chat/completions"
CHAT_OPTIONS: openai.RequestOptions = {"security": {"bearer_auth": True}}
# the order `create` writes its parameters in, so that the bytes on the wire are the same too
BODY_ORDER = (
    "model", "messages", "frequency_penalty", "max_tokens", "presence_penalty", "prompt_cache_key",
    "response_format", "seed", "stop", "temperature", "tools", "top_p",
)  # fmt: skip


class OpenAICompatProvider:
    """A `ModelProvider` over any OpenAI-compatible `/chat/completions` endpoint; thread-safe."""

    name = "openai"

    def __init__(
        self,
        *,
        api_key: str,
        base_url: str,
        timeout_s: float,
        retry: RetryPolicy,
        merge_user_turns: bool = True,
        prompt_cache_key: bool = True,
    ) -> None:
        # max_retries=0: our retry loop is the only one, so attempts and delays are what settings say
        self._client = openai.OpenAI(api_key=api_key, base_url=base_url, timeout=timeout_s, max_retries=0)
        self.endpoint = base_url  # the scope of a shared cooldown (with the model)
        self._secret = api_key
        self._timeout_s = timeout_s
        self.retry = retry
        self.merge_user_turns = merge_user_turns
        self.prompt_cache_key = prompt_cache_key  # send the request's cache key (the parent session)
        self.schemas = SchemaModes()  # the models whose server refused `response_format`

    def __repr__(self) -> str:
        return f"OpenAICompatProvider(base_url={str(self._client.base_url)!r})"

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def generate(self, request: ModelRequest) -> ModelResponse:
        """One Chat Completions call, retried on transient failures.

        Raises:
            ConfigurationError: the request names no model.
            ProviderError: the endpoint failed for good, or answered without a choice.
        """
        model = require_model(request, self.name)
        send = functools.partial(self._generate, request, model)
        return generate_with_schema(request, self.schemas, send, provider=self.name, model=model)

    def _generate(self, request: ModelRequest, model: str, native: bool) -> ModelResponse:
        body = self.params(request, native=native)
        completion = call_with_retries(
            lambda: self._client.post(CHAT_PATH, cast_to=ChatCompletion, body=body, options=CHAT_OPTIONS),
            provider=self.name,
            model=model,
            policy=self.retry,
            classify=self._classify,
            secrets=(self._secret,),
            fork_id=request.fork_id,
            endpoint=self.endpoint,
        )
        if not isinstance(completion, ChatCompletion) or not completion.choices:
            raise ProviderError(
                f"{self.name} model {model!r}: the response has no choices; expected one chat.completion choice "
                "(check that the base URL points at a Chat Completions endpoint)",
                provider=self.name,
                model=model,
                fork_id=request.fork_id,
            )
        return from_completion(completion, step=request.step)

    def params(self, request: ModelRequest, *, native: bool = True) -> dict[str, Any]:
        """The JSON body of the Chat Completions request for `request` (also the keyword arguments of
        `chat.completions.create`); its output schema as `response_format`, or (not `native`) stated in the
        system message."""
        schema, system = request.output_schema, request.system_instruction
        if schema is not None and not native:
            system = "\n\n".join(t for t in (system_text(system), schema_note(schema)) if t)
        params: dict[str, Any] = {
            "model": request.model,
            "messages": to_messages(system, request.messages, merge_user_turns=self.merge_user_turns),
        }
        tools = to_tools(request.tools)
        if tools:
            params["tools"] = tools
        key = cache_key(request.cache_key) if self.prompt_cache_key else None
        if key is not None:  # the same at every step of a fork, and for its siblings
            params["prompt_cache_key"] = key
        if schema is not None and native:
            params["response_format"] = response_format(schema)
        for key, value in request.generation.items():
            if key in GENERATION_KEYS and value is not None:
                params[GENERATION_KEYS[key]] = value
            else:
                log.debug("openai: generation setting %r has no Chat Completions equivalent; ignored", key)
        return {name: params[name] for name in BODY_ORDER if name in params}

    def _classify(self, exc: Exception) -> Failure | None:
        if isinstance(exc, openai.APITimeoutError):
            return Failure(True, None, f"no answer within {self._timeout_s:g}s (FORKQ_PROVIDER_TIMEOUT_S)")
        if isinstance(exc, openai.APIConnectionError):
            return Failure(True, None, f"connection failed: {exc.__cause__ or exc}")
        if isinstance(exc, openai.APIStatusError):
            # a 429 for an exhausted quota will not clear by waiting
            retryable = is_retryable_status(exc.status_code) and exc.code != "insufficient_quota"
            retry_after = parse_retry_after(exc.response.headers)
            return Failure(retryable, exc.status_code, _error_detail(exc), retry_after)
        if isinstance(exc, openai.OpenAIError):
            return Failure(False, None, f"{type(exc).__name__}: {exc}")
        return None


def _error_detail(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return exc.response.reason_phrase or exc.message


# --- request conversion ------------------------------------------------------------------------------


def cache_key(session: str | None) -> str | None:
    """The `prompt_cache_key` for a parent session: its id, or a digest of an id too long for the API."""
    if not session:
        return None
    if len(session) <= CACHE_KEY_MAX_CHARS:
        return session
    return "forkq-" + hashlib.blake2b(session.encode(), digest_size=24).hexdigest()


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    """`response_format` for an output schema: `json_schema`, named by its title if that fits the API's rule."""
    title = schema.get("title")
    name = title if isinstance(title, str) and _FORMAT_NAME.match(title) else "output"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict_compatible(schema)}}


def strict_compatible(schema: dict[str, Any]) -> bool:
    """Whether strict structured outputs accept `schema`: an object at the root; in every object,
    `additionalProperties: false` and every property required; only the keywords strict mode knows."""
    return schema.get("type") == "object" and _strict(schema, 0)


def _strict(node: Any, depth: int) -> bool:
    if depth > STRICT_MAX_DEPTH or not isinstance(node, dict) or not set(node) <= STRICT_KEYWORDS:
        return False
    kinds = node.get("type")
    properties, any_of = node.get("properties", {}), node.get("anyOf", [])
    maps = [properties, node.get("$defs", {}), node.get("definitions", {})]  # name → subschema
    if not all(isinstance(m, dict) for m in maps) or not isinstance(any_of, list):
        return False
    if kinds == "object" or (isinstance(kinds, list) and "object" in kinds) or "properties" in node:
        required = node.get("required", [])
        if node.get("additionalProperties") is not False or not isinstance(required, list):
            return False
        if set(map(str, required)) != set(properties):
            return False
    children = [*(v for m in maps for v in m.values()), *any_of, *([node["items"]] if "items" in node else [])]
    return all(_strict(child, depth + 1) for child in children)


def to_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat Completions `tools`: one `{"type": "function", "function": {...}}` per declaration."""
    converted = [t for t in tools if t.get("type") == "function" and isinstance(t.get("function"), dict)]
    for declaration in function_declarations(tools):
        function: dict[str, Any] = {"name": declaration["name"]}
        if declaration.get("description"):
            function["description"] = declaration["description"]
        schema = parameters_schema(declaration)
        if schema is not None:
            function["parameters"] = schema
        converted.append({"type": "function", "function": function})
    return converted


def system_text(system_instruction: str | dict[str, Any] | None) -> str | None:
    """The system instruction as text: a string, or the texts of a Content-like object's parts."""
    if system_instruction is None or isinstance(system_instruction, str):
        return system_instruction or None
    if isinstance(system_instruction.get("text"), str):
        return str(system_instruction["text"])
    parts = system_instruction.get("parts") or []
    texts = [
        p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str) and not p.get("thought")
    ]
    return "\n".join(texts) or None


def to_messages(
    system_instruction: str | dict[str, Any] | None, contents: Sequence[Content], *, merge_user_turns: bool = True
) -> list[dict[str, Any]]:
    """Chat Completions messages for a system instruction and a history of Contents."""
    messages: list[dict[str, Any]] = []
    system = system_text(system_instruction)
    if system:
        messages.append({"role": "system", "content": system})
    pending: dict[str, str] = {}  # id → name of the last assistant message's calls not yet answered
    for index, content in enumerate(contents):
        if content.role == "model":
            messages.extend(_unanswered(pending))
            assistant, pending = _assistant_message(content, index)
            if assistant is not None:
                messages.append(assistant)
        else:
            messages.extend(_user_messages(content, pending))
            pending = {}
    messages.extend(_unanswered(pending))
    return _merge_user_turns(messages) if merge_user_turns else messages


def call_ids(content: Content, index: int) -> list[str]:
    """The ids of a model Content's calls: their own (if unique), else `call_h<index>_<i>` (deterministic)."""
    calls = [p.function_call for p in content.parts if p.function_call is not None]
    ids: list[str] = []
    for i, call in enumerate(calls):
        ids.append(call.id if call.id and call.id not in ids else f"call_h{index}_{i}")
    return ids


def _assistant_message(content: Content, index: int) -> tuple[dict[str, Any] | None, dict[str, str]]:
    texts = [p.text for p in content.parts if p.text and not p.thought]
    calls = [p.function_call for p in content.parts if p.function_call is not None]
    named = {call_id: call.name or "" for call_id, call in zip(call_ids(content, index), calls, strict=True)}
    tool_calls = [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": named[call_id], "arguments": json.dumps(call.args or {}, ensure_ascii=False)},
        }
        for call_id, call in zip(named, calls, strict=True)
    ]
    if not texts and not tool_calls:
        return None, {}
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message, named


def _user_messages(content: Content, pending: dict[str, str]) -> list[dict[str, Any]]:
    """`tool` messages answering `pending` (orphans dropped, gaps filled), then the user message, if any."""
    unanswered = dict(pending)
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for part in content.parts:
        response = part.function_response
        if response is None:
            converted = _user_part(part)
            if converted is not None:
                parts.append(converted)
            continue
        call_id = _answered_call(response.id, response.name, unanswered)
        if call_id is None:
            log.debug("openai: dropped a functionResponse (id %r) that answers no preceding call", response.id)
            continue
        del unanswered[call_id]
        tools.append({"role": "tool", "tool_call_id": call_id, "content": _tool_output(response.response)})
        parts.extend(p for p in (_user_part(m) for m in response.parts or []) if p is not None)
    messages = tools + _unanswered(unanswered)
    if parts:
        plain = all(p["type"] == "text" for p in parts)
        messages.append({"role": "user", "content": "\n".join(p["text"] for p in parts) if plain else parts})
    return messages


def _answered_call(response_id: str | None, name: str | None, unanswered: dict[str, str]) -> str | None:
    if response_id is not None:
        return response_id if response_id in unanswered else None
    return next((cid for cid, cname in unanswered.items() if cname == name), None)


def _unanswered(pending: dict[str, str]) -> list[dict[str, Any]]:
    error = json.dumps({"error": NO_RESPONSE_ERROR})
    return [{"role": "tool", "tool_call_id": call_id, "content": error} for call_id in pending]


def _tool_output(response: dict[str, Any] | None) -> str:
    """A tool message's text: a plain `{"output": "..."}` as its text, anything else as JSON."""
    if response is not None and set(response) == {"output"} and isinstance(response["output"], str):
        return response["output"]
    return json.dumps(response or {}, ensure_ascii=False)


def _user_part(part: Part) -> dict[str, Any] | None:
    if part.thought:
        return None
    if part.text is not None:
        return {"type": "text", "text": part.text}
    blob = part.inline_data
    if blob is not None and blob.data:
        return _inline_media(blob.mime_type or "application/octet-stream", blob.data)
    ref = part.file_data
    if ref is not None and ref.file_uri:
        if (ref.mime_type or "").startswith("image/"):
            return {"type": "image_url", "image_url": {"url": ref.file_uri}}
        return {"type": "text", "text": f"[file {ref.file_uri} ({ref.mime_type or 'unknown type'})]"}
    return None


def _inline_media(mime: str, data: str) -> dict[str, Any]:
    url = f"data:{mime};base64,{data}"
    if mime.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": url}}
    if mime in AUDIO_FORMATS:
        return {"type": "input_audio", "input_audio": {"data": data, "format": AUDIO_FORMATS[mime]}}
    return {"type": "file", "file": {"file_data": url}}


def _merge_user_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: list[dict[str, Any]] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if previous is None or not (previous["role"] == message["role"] == "user"):
            merged.append(message)
            continue
        before, after = previous["content"], message["content"]
        if isinstance(before, str) and isinstance(after, str):
            previous["content"] = f"{before}\n\n{after}"
        else:
            previous["content"] = _as_parts(before) + _as_parts(after)
    return merged


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


# --- response conversion -----------------------------------------------------------------------------


def from_completion(completion: ChatCompletion, *, step: int) -> ModelResponse:
    """Our response for the first choice of a completion; calls without a (unique) id get `call_<step>_<i>`."""
    choice = completion.choices[0]
    parts, invalid = _answer_parts(choice.message, step)
    calls = any(p.function_call is not None for p in parts)
    reason = str(choice.finish_reason or "stop")
    finish = "tool_calls" if calls and reason == "stop" else FINISH_REASONS.get(reason, reason.lower())
    return ModelResponse(
        content=Content(role="model", parts=parts),
        usage=token_usage(completion.usage),
        finish_reason=finish,
        invalid_calls=invalid,
    )


def token_usage(usage: CompletionUsage | None) -> TokenUsage:
    """Our token usage for a completion's: prompt, completion, and cached prompt tokens (when reported)."""
    if usage is None:
        return TokenUsage()
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return TokenUsage(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, cached_input_tokens=cached
    )


def _answer_parts(message: ChatCompletionMessage, step: int) -> tuple[list[Part], dict[str, str]]:
    parts: list[Part] = []
    reasoning = (message.model_extra or {}).get("reasoning_content")  # DeepSeek, Qwen, vLLM reasoning parsers
    if isinstance(reasoning, str) and reasoning:
        parts.append(Part(text=reasoning, thought=True))
    if message.content:
        parts.append(Part(text=message.content))
    invalid: dict[str, str] = {}
    seen: set[str] = set()
    for i, tool_call in enumerate(message.tool_calls or []):
        call_id = tool_call.id if tool_call.id and tool_call.id not in seen else f"call_{step}_{i}"
        seen.add(call_id)
        if isinstance(tool_call, ChatCompletionMessageFunctionToolCall):
            name, raw = tool_call.function.name, tool_call.function.arguments
            args, error = parse_arguments(name, raw)
        else:
            name, args = getattr(getattr(tool_call, "custom", None), "name", "") or "", {}
            error = f"Your call to {name!r} is a custom tool call; only function calls with JSON arguments work here."
        if error is not None:
            invalid[call_id] = error
        parts.append(Part(function_call=FunctionCall(id=call_id, name=name, args=args)))
    return parts, invalid


def parse_arguments(name: str, raw: str | None) -> tuple[dict[str, Any], str | None]:
    """A call's arguments as an object, or `{}` and the error text the model should read."""
    if raw is None or not raw.strip():  # several servers send "" for a call without arguments
        return {}, None
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as exc:
        return {}, (
            f"The arguments of your call to {name!r} are not valid JSON ({exc.msg} at position {exc.pos}): "
            f"{_clip(raw)}. Nothing was run; call the tool again with a JSON object matching its parameters."
        )
    if not isinstance(args, dict):
        return {}, (
            f"The arguments of your call to {name!r} are JSON {type(args).__name__}, not an object: {_clip(raw)}. "
            "Nothing was run; call the tool again with a JSON object matching its parameters."
        )
    return args, None


def _clip(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")

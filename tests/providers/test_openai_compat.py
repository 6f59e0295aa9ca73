"""The OpenAI-compatible adapter, through the official `openai` client, against a local Chat Completions server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from tests.fakeapi import FakeAPI
from workers.errors import ConfigurationError, ProviderError
from workers.history.messages import Content, load_contents
from workers.providers import ModelRequest
from workers.providers.openai_compat import (
    CACHE_KEY_MAX_CHARS,
    OpenAICompatProvider,
    cache_key,
    response_format,
    strict_compatible,
    to_messages,
    to_tools,
)
from workers.providers.output_schema import schema_note
from workers.providers.retry import RetryPolicy

KEY = "sk-test-0123456789abcdef"
MODEL = "gpt-4.1-mini"
TOOLS = [
    {
        "name": "read_file",
        "description": "Reads a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {"functionDeclarations": [{"name": "list_directory", "parametersJsonSchema": {"type": "object"}}]},
]


def completion(
    message: dict[str, Any], finish_reason: str = "stop", usage: tuple[int, int] = (19, 10), cached: int = 0
) -> dict:
    """A chat.completion object as the API reference records it (validated by the SDK's own type); `cached`
    of the prompt tokens read from the prompt cache."""
    body = {
        "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "object": "chat.completion",
        "created": 1741569952,
        "model": "gpt-4.1-mini-2025-04-14",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "refusal": None, "annotations": [], **message},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": sum(usage),
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "service_tier": "default",
    }
    ChatCompletion.model_validate(body)
    return body


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def error_body(message: str, code: str = "rate_limit_exceeded") -> dict[str, Any]:
    return {"error": {"message": message, "type": "requests", "param": None, "code": code}}


@pytest.fixture
def api() -> Iterator[FakeAPI]:
    with FakeAPI() as server:
        yield server


class Sleeps(list[float]):
    """A fake `sleep` that records the delays instead of waiting."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def provider(api: FakeAPI, sleeps: Sleeps) -> Iterator[OpenAICompatProvider]:
    policy = RetryPolicy(max_attempts=3, base_delay_s=0.001, max_delay_s=0.01, sleep=sleeps, uniform=lambda: 0.0)
    adapter = OpenAICompatProvider(api_key=KEY, base_url=f"{api.url}/v1", timeout_s=5.0, retry=policy)
    yield adapter
    adapter.close()


def request(messages: list[dict[str, Any]], step: int = 0, **extra: Any) -> ModelRequest:
    fields: dict[str, Any] = {
        "fork_id": "f-1",
        "step": step,
        "model": MODEL,
        "system_instruction": "You are a coding agent.",
        "tools": TOOLS,
        "messages": load_contents(messages),
    }
    return ModelRequest(**(fields | extra))


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "parts": [{"text": text}]}


def test_plain_text_answer_round_trips_through_the_official_client(api: FakeAPI, provider: OpenAICompatProvider):
    api.reply(completion({"content": "Hello! How can I help?"}))

    response = provider.generate(request([user("hi")], generation={"temperature": 0.2, "maxOutputTokens": 64}))

    assert response.content.to_wire() == {"role": "model", "parts": [{"text": "Hello! How can I help?"}]}
    assert (response.usage.input_tokens, response.usage.output_tokens) == (19, 10)
    assert response.finish_reason == "stop"
    assert response.invalid_calls == {}
    sent = api.received[0]
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert sent.json["model"] == MODEL
    assert sent.json["messages"] == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "hi"},
    ]
    assert sent.json["temperature"] == 0.2
    assert sent.json["max_tokens"] == 64
    assert sent.json["tools"] == [
        {
            "type": "function",
            "function": {"name": "read_file", "description": "Reads a file.", "parameters": TOOLS[0]["parameters"]},
        },
        {"type": "function", "function": {"name": "list_directory", "parameters": {"type": "object"}}},
    ]


def test_multi_step_tool_calling_pairs_call_ids_across_turns(api: FakeAPI, provider: OpenAICompatProvider):
    # Given a model that calls two tools (one call without an id), then answers
    api.reply(
        completion(
            {
                "content": None,
                "tool_calls": [
                    tool_call("call_abc", "read_file", '{"path": "a.py"}'),
                    tool_call("", "list_directory", ""),
                ],
            },
            finish_reason="tool_calls",
        )
    )
    api.reply(completion({"content": "a.py defines main()."}, usage=(40, 6)))
    history = [user("what is in a.py?")]

    # When the loop runs step 0, answers both calls, and runs step 1
    first = provider.generate(request(history))
    calls = [p.function_call for p in first.content.parts if p.function_call]
    assert [(c.id, c.name, c.args) for c in calls] == [
        ("call_abc", "read_file", {"path": "a.py"}),
        ("call_0_1", "list_directory", {}),
    ]
    assert first.finish_reason == "tool_calls"
    answers = {
        "role": "user",
        "parts": [
            {"functionResponse": {"id": "call_0_1", "name": "list_directory", "response": {"output": "a.py"}}},
            {"functionResponse": {"id": "call_abc", "name": "read_file", "response": {"output": "def main(): ..."}}},
        ],
    }
    history += [first.content.to_wire(), answers]
    second = provider.generate(request(history, step=1))

    # Then step 1 sent the calls as tool_calls and the answers as tool messages with the same ids
    assert second.content.parts[0].text == "a.py defines main()."
    assert api.received[1].json["messages"][1:] == [
        {"role": "user", "content": "what is in a.py?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                tool_call("call_abc", "read_file", '{"path": "a.py"}'),
                tool_call("call_0_1", "list_directory", "{}"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_0_1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "call_abc", "content": "def main(): ..."},
    ]


def test_history_conversion_drops_thoughts_and_orphans_and_fills_ids_and_gaps():
    history = load_contents(
        [
            # an orphan: answers a call made before the window
            {"role": "user", "parts": [{"functionResponse": {"id": "old", "name": "x", "response": {"output": 1}}}]},
            {"role": "user", "parts": [{"text": "<system-reminder>cwd</system-reminder>"}, {"text": "go"}]},
            {
                "role": "model",
                "parts": [
                    {"text": "thinking...", "thought": True, "thoughtSignature": "c2ln"},
                    {"text": "Looking."},
                    {"functionCall": {"name": "read_file", "args": {"path": "a"}}},
                    {"functionCall": {"name": "read_file", "args": {"path": "b"}}},
                    {"functionCall": {"id": "k", "name": "grep_search", "args": {}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"name": "read_file", "response": {"output": "A"}}},
                    {"functionResponse": {"id": "zzz", "name": "read_file", "response": {"output": "orphan"}}},
                    {"functionResponse": {"name": "read_file", "response": {"error": "no such file"}}},
                    {"text": "also this", "xTrace": 1},
                    {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
                ],
            },
            {"role": "model", "parts": [{"text": "Done.", "futureKey": True}]},
        ]
    )

    messages = to_messages({"parts": [{"text": "sys"}]}, history)

    assert messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "<system-reminder>cwd</system-reminder>\ngo"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                tool_call("call_h2_0", "read_file", '{"path": "a"}'),
                tool_call("call_h2_1", "read_file", '{"path": "b"}'),
                tool_call("k", "grep_search", "{}"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_h2_0", "content": "A"},
        {"role": "tool", "tool_call_id": "call_h2_1", "content": '{"error": "no such file"}'},
        {"role": "tool", "tool_call_id": "k", "content": '{"error": "no response was recorded for this call"}'},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "also this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            ],
        },
        {"role": "assistant", "content": "Done."},
    ]


def test_consecutive_user_contents_are_merged_unless_disabled():
    history = load_contents([user("<system-reminder>startup</system-reminder>"), user("first prompt")])

    assert to_messages(None, history) == [
        {"role": "user", "content": "<system-reminder>startup</system-reminder>\n\nfirst prompt"}
    ]
    assert len(to_messages(None, history, merge_user_turns=False)) == 2


def test_openai_shaped_and_grouped_declarations_become_function_tools():
    native = {"type": "function", "function": {"name": "n", "parameters": {"type": "object"}}}

    assert to_tools([native, {"name": "bare"}]) == [native, {"type": "function", "function": {"name": "bare"}}]


def test_malformed_tool_arguments_become_invalid_calls_not_a_crash(api: FakeAPI, provider: OpenAICompatProvider):
    api.reply(
        completion(
            {
                "content": "Let me look.",
                "tool_calls": [
                    tool_call("call_1", "read_file", '{"path": "a.py"'),
                    tool_call("call_2", "read_file", '["a.py"]'),
                    tool_call("call_3", "read_file", '{"path": "b.py"}'),
                    tool_call("call_3", "read_file", '{"path": "c.py"}'),  # a duplicate id from a sloppy server
                ],
            },
            finish_reason="tool_calls",
        )
    )

    response = provider.generate(request([user("read")], step=4))

    calls = [p.function_call for p in response.content.parts if p.function_call]
    assert [(c.id, c.args) for c in calls] == [
        ("call_1", {}),
        ("call_2", {}),
        ("call_3", {"path": "b.py"}),
        ("call_4_3", {"path": "c.py"}),
    ]
    assert set(response.invalid_calls) == {"call_1", "call_2"}
    assert "not valid JSON" in response.invalid_calls["call_1"]
    assert "'read_file'" in response.invalid_calls["call_1"]
    assert "not an object" in response.invalid_calls["call_2"]


def test_reasoning_content_of_compatible_servers_becomes_a_thought_part(api: FakeAPI, provider):
    api.reply(completion({"content": "42", "reasoning_content": "6 times 7"}))

    response = provider.generate(request([user("6*7?")]))

    assert response.content.to_wire()["parts"] == [{"text": "6 times 7", "thought": True}, {"text": "42"}]


def test_429_with_retry_after_is_retried_after_the_requested_delay(api, provider, sleeps):
    api.reply(error_body("Rate limit reached"), status=429, headers={"Retry-After": "2"})
    api.reply(completion({"content": "ok"}))

    response = provider.generate(request([user("hi")]))

    assert response.content.parts[0].text == "ok"
    assert len(api.received) == 2
    assert sleeps == [2.0]


def test_500_is_retried_with_a_short_backoff(api, provider, sleeps):
    api.reply({"error": {"message": "The server had an error", "type": "server_error"}}, status=500)
    api.reply(completion({"content": "ok"}))

    assert provider.generate(request([user("hi")])).content.parts[0].text == "ok"
    assert len(sleeps) == 1
    assert sleeps[0] < 0.01


def test_a_slow_response_hits_the_per_call_timeout_and_is_retried(api: FakeAPI, sleeps: Sleeps):
    api.reply(completion({"content": "too late"}), delay_s=1.0)
    api.reply(completion({"content": "in time"}))
    policy = RetryPolicy(max_attempts=2, base_delay_s=0.001, sleep=sleeps)
    adapter = OpenAICompatProvider(api_key=KEY, base_url=f"{api.url}/v1", timeout_s=0.3, retry=policy)
    try:
        response = adapter.generate(request([user("hi")]))
    finally:
        adapter.close()

    assert response.content.parts[0].text == "in time"
    assert len(api.received) == 2


def test_the_last_failed_attempt_raises_a_provider_error_without_the_key(api, provider, sleeps):
    for _ in range(3):
        api.reply(error_body(f"overloaded (key {KEY})", code="server_error"), status=503)

    with pytest.raises(ProviderError) as caught:
        provider.generate(request([user("hi")]))

    error = caught.value
    assert (error.provider, error.model, error.status, error.attempts) == ("openai", MODEL, 503, 3)
    assert "openai" in str(error) and MODEL in str(error) and "503" in str(error) and "3 attempts" in str(error)
    assert KEY not in str(error)
    assert error.__cause__ is None  # the SDK's error echoed the key, so it is not chained
    assert len(sleeps) == 2


def test_a_rejected_key_fails_at_once_and_names_the_setting(api, provider, sleeps):
    api.reply(error_body("Incorrect API key provided", code="invalid_api_key"), status=401)

    with pytest.raises(ProviderError, match="FORKQ_OPENAI_API_KEY") as caught:
        provider.generate(request([user("hi")]))

    assert caught.value.attempts == 1
    assert sleeps == []


def test_an_exhausted_quota_is_not_retried(api, provider):
    api.reply(error_body("You exceeded your current quota", code="insufficient_quota"), status=429)

    with pytest.raises(ProviderError, match="quota"):
        provider.generate(request([user("hi")]))
    assert len(api.received) == 1


def test_an_unreachable_server_is_retried_then_reported(sleeps: Sleeps):
    with FakeAPI() as gone:
        url = f"{gone.url}/v1"
    adapter = OpenAICompatProvider(
        api_key=KEY, base_url=url, timeout_s=2.0, retry=RetryPolicy(max_attempts=2, base_delay_s=0, sleep=sleeps)
    )
    try:
        with pytest.raises(ProviderError, match="connection failed") as caught:
            adapter.generate(request([user("hi")]))
    finally:
        adapter.close()
    assert caught.value.attempts == 2
    assert caught.value.status is None


def test_a_response_without_choices_is_a_provider_error(api, provider):
    body = completion({"content": "x"}) | {"choices": []}
    api.reply(body)

    with pytest.raises(ProviderError, match="no choices"):
        provider.generate(request([user("hi")]))


def test_a_request_without_a_model_is_a_configuration_error(provider):
    with pytest.raises(ConfigurationError, match="needs a model name"):
        provider.generate(request([user("hi")], model=None))


def test_repr_shows_the_endpoint_not_the_key(provider):
    assert KEY not in repr(provider)
    assert "/v1" in repr(provider)


def test_tool_message_content_is_json_for_structured_output():
    history: list[Content] = load_contents(
        [
            {"role": "model", "parts": [{"functionCall": {"id": "c", "name": "t", "args": {"a": [1]}}}]},
            {"role": "user", "parts": [{"functionResponse": {"id": "c", "name": "t", "response": {"output": [1, 2]}}}]},
        ]
    )

    messages = to_messages(None, history)

    assert json.loads(messages[0]["tool_calls"][0]["function"]["arguments"]) == {"a": [1]}
    assert messages[1] == {"role": "tool", "tool_call_id": "c", "content": '{"output": [1, 2]}'}


# ── the output schema on the wire ─────────────────────────────────────────────────────────────

STRICT_SCHEMA = {
    "title": "audit_report",
    "type": "object",
    "properties": {
        "summary": {"type": "string"},
        "findings": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"line": {"type": "integer"}, "note": {"type": ["string", "null"]}},
                "required": ["line", "note"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["summary", "findings"],
    "additionalProperties": False,
}
LOOSE_SCHEMA = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
NATIVE_REFUSED = "response_format of type json_schema is not supported by this model"


def test_an_output_schema_goes_as_response_format_json_schema(api: FakeAPI, provider: OpenAICompatProvider):
    api.reply(completion({"content": '{"summary": "ok", "findings": []}'}))
    api.reply(completion({"content": '{"summary": "ok"}'}))

    provider.generate(request([user("audit")], output_schema=STRICT_SCHEMA))
    provider.generate(request([user("audit")], output_schema=LOOSE_SCHEMA))

    # strict where strict mode takes the schema (every object closed, every property required), named by its title
    strict, loose = (r.json for r in api.received)
    assert strict["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "audit_report", "schema": STRICT_SCHEMA, "strict": True},
    }
    # else best effort: strict mode would refuse a schema with an open object
    assert loose["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": LOOSE_SCHEMA, "strict": False},
    }
    assert strict["messages"][0] == {"role": "system", "content": "You are a coding agent."}
    assert "response_format" not in provider.params(request([user("no schema")]))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": {"type": "string"}},  # not an object at the root
        {**STRICT_SCHEMA, "required": ["summary"]},  # a property not required
        {**STRICT_SCHEMA, "additionalProperties": {"type": "string"}},
        {**STRICT_SCHEMA, "$schema": "https://json-schema.org/draft/2020-12/schema"},  # a keyword strict mode lacks
        {**STRICT_SCHEMA, "properties": {**STRICT_SCHEMA["properties"], "summary": {"oneOf": [{"type": "string"}]}}},
        {"type": "object", "properties": {"a": {"type": "object"}}, "required": ["a"], "additionalProperties": False},
    ],
)
def test_a_schema_strict_mode_would_refuse_is_sent_non_strict(schema: dict[str, Any]):
    assert strict_compatible(schema) is False
    assert response_format(schema)["json_schema"]["strict"] is False


def test_strict_mode_takes_definitions_refs_and_any_of():
    item = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "$defs": {"item": item},
        "properties": {"value": {"anyOf": [{"$ref": "#/$defs/item"}, {"type": "null"}]}},
        "required": ["value"],
        "additionalProperties": False,
    }
    assert strict_compatible(schema) is True


def test_a_server_that_refuses_response_format_gets_the_schema_in_the_system_message_from_then_on(
    api: FakeAPI, provider: OpenAICompatProvider, caplog: pytest.LogCaptureFixture
):
    # Given a server that answers 400 to response_format (e.g. an OpenAI-compatible server without json_schema)
    api.reply(
        {"error": {"message": NATIVE_REFUSED, "type": "invalid_request_error", "param": "response_format"}}, status=400
    )
    api.reply(completion({"content": '{"summary": "ok"}'}))
    api.reply(completion({"content": '{"summary": "again"}'}))

    # When two steps of a fork with an output schema call it
    first = provider.generate(request([user("audit")], output_schema=LOOSE_SCHEMA))
    second = provider.generate(request([user("audit")], step=1, output_schema=LOOSE_SCHEMA))

    # Then the refused call was sent again at once with the schema stated in the system message, and the
    # next step went straight to that form: three requests, one refusal
    assert (first.content.parts[0].text, second.content.parts[0].text) == ('{"summary": "ok"}', '{"summary": "again"}')
    native, *text = (r.json for r in api.received)
    assert native["response_format"]["type"] == "json_schema"
    assert len(text) == 2
    for sent in text:
        assert "response_format" not in sent
        system = sent["messages"][0]
        assert system["role"] == "system" and system["content"].startswith("You are a coding agent.\n\n")
        assert schema_note(LOOSE_SCHEMA) in system["content"]
        assert json.dumps(LOOSE_SCHEMA, sort_keys=True) in system["content"]
    refusals = [r.getMessage() for r in caplog.records if "refused the output schema" in r.getMessage()]
    assert len(refusals) == 1 and NATIVE_REFUSED in refusals[0], refusals


def test_a_400_the_text_form_does_not_cure_fails_the_call_and_keeps_native_mode(
    api: FakeAPI, provider: OpenAICompatProvider
):
    # Given a request the server refuses for another reason, with or without response_format
    for _ in range(2):
        api.reply(error_body("messages: too many tokens", code="context_length_exceeded"), status=400)
    api.reply(completion({"content": '{"summary": "ok"}'}))

    with pytest.raises(ProviderError, match="too many tokens") as caught:
        provider.generate(request([user("audit")], output_schema=LOOSE_SCHEMA))

    # Then the call failed with the server's reason, and the model keeps native mode for the next call
    assert caught.value.status == 400
    provider.generate(request([user("audit")], output_schema=LOOSE_SCHEMA))
    assert ["response_format" in r.json for r in api.received] == [True, False, True]


# ── prompt caching ────────────────────────────────────────────────────────────────────────────


def test_the_cache_key_goes_as_prompt_cache_key_and_cached_tokens_come_back(api: FakeAPI, provider):
    api.reply(completion({"content": "ok"}, usage=(2048, 5), cached=1920))

    response = provider.generate(request([user("hi")], cache_key="5d0e8c2a-7f31-4b6e-9a0c-2f4b8e1d6c93"))

    assert api.received[0].json["prompt_cache_key"] == "5d0e8c2a-7f31-4b6e-9a0c-2f4b8e1d6c93"
    assert response.usage.model_dump() == {"input_tokens": 2048, "output_tokens": 5, "cached_input_tokens": 1920}


def test_a_request_without_a_cache_key_or_with_the_setting_off_sends_none(api: FakeAPI, sleeps: Sleeps):
    policy = RetryPolicy(max_attempts=1, base_delay_s=0.001, max_delay_s=0.01, sleep=sleeps)
    off = OpenAICompatProvider(
        api_key=KEY, base_url=f"{api.url}/v1", timeout_s=5.0, retry=policy, prompt_cache_key=False
    )
    on = OpenAICompatProvider(api_key=KEY, base_url=f"{api.url}/v1", timeout_s=5.0, retry=policy)
    api.reply(completion({"content": "a"})).reply(completion({"content": "b"}))

    off.generate(request([user("hi")], cache_key="s-1"))
    on.generate(request([user("hi")]))

    assert ["prompt_cache_key" in r.json for r in api.received] == [False, False]
    off.close()
    on.close()


def test_a_session_id_too_long_for_the_api_becomes_a_stable_digest_of_64_characters_at_most():
    long_id = "paperclip:company:" + "7" * 100

    key = cache_key(long_id)

    assert key is not None and len(key) <= CACHE_KEY_MAX_CHARS and key.startswith("forkq-")
    assert key == cache_key(long_id) != cache_key(long_id + "8")
    assert cache_key("x" * CACHE_KEY_MAX_CHARS) == "x" * CACHE_KEY_MAX_CHARS
    assert cache_key(None) is None and cache_key("") is None


def test_a_usage_without_prompt_token_details_reports_no_cached_tokens(api: FakeAPI, provider):
    body = completion({"content": "ok"}, usage=(30, 2))
    del body["usage"]["prompt_tokens_details"]  # vLLM, Ollama and older servers leave the details out
    api.reply(body)

    response = provider.generate(request([user("hi")]))

    assert (response.usage.input_tokens, response.usage.cached_input_tokens) == (30, 0)

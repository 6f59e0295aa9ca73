"""The Gemini adapter, through the official `google-genai` client, against a local generateContent server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from google.genai import types

from tests.fakeapi import FakeAPI
from workers.errors import ConfigurationError, ProviderError
from workers.history.messages import load_contents
from workers.providers import ModelRequest
from workers.providers.gemini import GeminiProvider, fit, generation_config, to_contents, transport_failure
from workers.providers.output_schema import schema_note
from workers.providers.retry import RetryPolicy

KEY = "AIzaSy-test-0123456789"
MODEL = "gemini-2.5-flash"
PATH = f"/v1beta/models/{MODEL}:generateContent"
TOOLS = [
    {
        "name": "read_file",
        "description": "Reads a file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "mode": {"oneOf": [{"type": "string"}, {"type": "integer"}]}},
            "required": ["path"],
        },
    }
]


def generated(
    parts: list[dict[str, Any]], finish_reason: str = "STOP", usage: tuple[int, int, int] = (8, 12, 5), cached: int = 0
):
    """A GenerateContentResponse as the API reference records it (validated by the SDK's own type); `cached` of
    the prompt tokens read from the cache (`cachedContentTokenCount`, absent when 0 as the API leaves it out)."""
    body = {
        "candidates": [
            {
                "content": {"parts": parts, "role": "model"},
                "finishReason": finish_reason,
                "index": 0,
                "avgLogprobs": -0.1,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": usage[0],
            "candidatesTokenCount": usage[1],
            "thoughtsTokenCount": usage[2],
            "totalTokenCount": sum(usage),
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": usage[0]}],
        },
        "modelVersion": MODEL,
        "responseId": "mCkjaNnHEZ2cz7IP5aHUsQ4",
    }
    if cached:
        body["usageMetadata"]["cachedContentTokenCount"] = cached
        body["usageMetadata"]["cacheTokensDetails"] = [{"modality": "TEXT", "tokenCount": cached}]
    types.GenerateContentResponse.model_validate(body)
    return body


def api_error(code: int, status: str, message: str, retry_delay: str | None = None) -> dict[str, Any]:
    details = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay}] if retry_delay else []
    return {"error": {"code": code, "message": message, "status": status, "details": details}}


class Sleeps(list[float]):
    """A fake `sleep` that records the delays instead of waiting."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def api() -> Iterator[FakeAPI]:
    with FakeAPI() as server:
        yield server


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


def make(api: FakeAPI, sleeps: Sleeps, *, attempts: int = 3, timeout_s: float = 5.0) -> GeminiProvider:
    policy = RetryPolicy(max_attempts=attempts, base_delay_s=0.001, max_delay_s=0.01, sleep=sleeps, uniform=lambda: 0.0)
    return GeminiProvider(api_key=KEY, base_url=f"{api.url}/", timeout_s=timeout_s, retry=policy)


@pytest.fixture
def provider(api: FakeAPI, sleeps: Sleeps) -> Iterator[GeminiProvider]:
    adapter = make(api, sleeps)
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


def test_plain_text_answer_round_trips_through_the_official_client(api: FakeAPI, provider: GeminiProvider):
    api.reply(generated([{"text": "Hello!"}]))

    response = provider.generate(request([user("hi")], generation={"temperature": 0.2, "maxOutputTokens": 64}))

    assert response.content.to_wire() == {"role": "model", "parts": [{"text": "Hello!"}]}
    assert (response.usage.input_tokens, response.usage.output_tokens) == (8, 17)  # thoughts count as output
    assert response.finish_reason == "stop"
    sent = api.received[0]
    assert sent.path == PATH
    assert sent.headers["x-goog-api-key"] == KEY
    assert KEY not in sent.path
    assert sent.json["contents"] == [{"role": "user", "parts": [{"text": "hi"}]}]
    assert sent.json["systemInstruction"] == {"parts": [{"text": "You are a coding agent."}], "role": "user"}
    assert sent.json["generationConfig"] == {"temperature": 0.2, "maxOutputTokens": 64}
    # the JSON schema goes as it is, oneOf included, as parametersJsonSchema (the SDK spells it in snake case,
    # which the API's JSON mapping accepts too)
    [declaration] = sent.json["tools"][0]["functionDeclarations"]
    assert declaration.get("parametersJsonSchema", declaration.get("parameters_json_schema")) == TOOLS[0]["parameters"]
    assert (declaration["name"], declaration["description"]) == ("read_file", "Reads a file.")


def test_multi_step_tool_calling_sends_native_contents_back(api: FakeAPI, provider: GeminiProvider):
    # Given a model that calls a tool (with a thought signature), then answers
    call_part = {
        "functionCall": {"id": "fc-1", "name": "read_file", "args": {"path": "a.py"}},
        "thoughtSignature": "CiIBc2ln",
    }
    api.reply(generated([{"text": "planning", "thought": True}, call_part], usage=(10, 4, 0)))
    api.reply(generated([{"text": "a.py defines main()."}]))
    history = [user("what is in a.py?")]

    # When the loop runs step 0, answers the call, and runs step 1
    first = provider.generate(request(history))
    assert first.finish_reason == "tool_calls"
    assert first.content.to_wire()["parts"][1] == call_part
    answer = {
        "role": "user",
        "parts": [
            {"functionResponse": {"id": "fc-1", "name": "read_file", "response": {"output": "def main(): ..."}}},
            {"text": "note", "xTrace": "kept by forkq, unknown to Gemini"},
        ],
    }
    history += [first.content.to_wire(), answer]
    second = provider.generate(request(history, step=1))

    # Then step 1 sent the whole history natively, signatures kept, unknown keys dropped
    assert second.content.parts[0].text == "a.py defines main()."
    assert api.received[1].json["contents"] == [
        user("what is in a.py?"),
        {"role": "model", "parts": [{"text": "planning", "thought": True}, call_part]},
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"id": "fc-1", "name": "read_file", "response": {"output": "def main(): ..."}}},
                {"text": "note"},
            ],
        },
    ]


def test_a_malformed_function_call_is_a_finish_reason_not_a_crash(api: FakeAPI, provider: GeminiProvider):
    body = generated([], finish_reason="MALFORMED_FUNCTION_CALL")
    body["candidates"][0]["content"] = {}
    body["candidates"][0]["finishMessage"] = "Malformed function call: print(default_api.read_file(path=)"
    api.reply(body)

    response = provider.generate(request([user("read")]))

    assert response.content.to_wire() == {"role": "model", "parts": []}
    assert response.finish_reason == "malformed_function_call"


def test_safety_stops_are_normalised_to_content_filter(api, provider):
    api.reply(generated([{"text": "partial"}], finish_reason="SAFETY"))

    assert provider.generate(request([user("x")])).finish_reason == "content_filter"


def test_a_blocked_prompt_is_a_provider_error_naming_the_reason(api, provider):
    api.reply({"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {"promptTokenCount": 3}})

    with pytest.raises(ProviderError, match="SAFETY"):
        provider.generate(request([user("x")]))


def test_429_is_retried_after_the_retry_after_header(api, provider, sleeps):
    api.reply(api_error(429, "RESOURCE_EXHAUSTED", "Quota exceeded"), status=429, headers={"Retry-After": "2"})
    api.reply(generated([{"text": "ok"}]))

    assert provider.generate(request([user("hi")])).content.parts[0].text == "ok"
    assert sleeps == [2.0]


def test_429_is_retried_after_the_retry_info_delay(api, provider, sleeps):
    api.reply(api_error(429, "RESOURCE_EXHAUSTED", "Quota exceeded", retry_delay="3s"), status=429)
    api.reply(generated([{"text": "ok"}]))

    assert provider.generate(request([user("hi")])).content.parts[0].text == "ok"
    assert sleeps == [3.0]


def test_500_is_retried_with_a_short_backoff(api, provider, sleeps):
    api.reply(api_error(500, "INTERNAL", "An internal error has occurred."), status=500)
    api.reply(generated([{"text": "ok"}]))

    assert provider.generate(request([user("hi")])).content.parts[0].text == "ok"
    assert len(sleeps) == 1
    assert sleeps[0] < 0.01


def test_a_slow_response_hits_the_per_call_timeout_and_is_retried(api: FakeAPI, sleeps: Sleeps):
    api.reply(generated([{"text": "too late"}]), delay_s=1.5)
    api.reply(generated([{"text": "in time"}]))
    adapter = make(api, sleeps, attempts=2, timeout_s=0.3)
    try:
        response = adapter.generate(request([user("hi")]))
    finally:
        adapter.close()

    assert response.content.parts[0].text == "in time"
    assert len(api.received) == 2


def test_the_last_failed_attempt_raises_a_provider_error_without_the_key(api, provider, sleeps):
    for _ in range(3):
        api.reply(api_error(503, "UNAVAILABLE", f"The model is overloaded ({KEY})"), status=503)

    with pytest.raises(ProviderError) as caught:
        provider.generate(request([user("hi")]))

    error = caught.value
    assert (error.provider, error.model, error.status, error.attempts) == ("gemini", MODEL, 503, 3)
    assert "3 attempts" in str(error)
    assert KEY not in str(error)
    assert len(sleeps) == 2


def test_a_rejected_key_fails_at_once_and_names_the_setting(api, provider, sleeps):
    api.reply(api_error(400, "INVALID_ARGUMENT", "API key not valid. Please pass a valid API key."), status=400)

    with pytest.raises(ProviderError, match="non-retryable") as caught:
        provider.generate(request([user("hi")]))
    assert caught.value.attempts == 1
    assert sleeps == []


def test_an_unreachable_server_is_retried_then_reported(sleeps: Sleeps):
    with FakeAPI() as gone:
        pass
    adapter = make(gone, sleeps, attempts=2)
    try:
        with pytest.raises(ProviderError, match="connection failed") as caught:
            adapter.generate(request([user("hi")]))
    finally:
        adapter.close()
    assert caught.value.attempts == 2


def test_unknown_keys_are_fitted_away_recursively_but_data_is_kept():
    wire = {
        "role": "model",
        "xTrace": 1,
        "parts": [{"functionCall": {"name": "t", "args": {"xTrace": None}, "extra": 1}, "cacheHint": True}],
    }

    assert fit(wire, types.Content) == {
        "role": "model",
        "parts": [{"functionCall": {"name": "t", "args": {"xTrace": None}}}],
    }
    assert to_contents(load_contents([wire]))[0].parts[0].function_call.args == {"xTrace": None}


def test_generation_settings_map_natively_and_reject_bad_values():
    config = generation_config(
        request([], generation={"topK": 5, "max_tokens": 9, "thinkingConfig": {"thinkingBudget": 0}, "x": 1})
    )

    assert (config.top_k, config.max_output_tokens, config.thinking_config.thinking_budget) == (5, 9, 0)
    with pytest.raises(ConfigurationError, match="generation setting"):
        generation_config(request([], generation={"temperature": "hot"}))


def test_a_content_system_instruction_is_sent_as_a_content(api, provider):
    api.reply(generated([{"text": "ok"}]))

    provider.generate(request([user("hi")], system_instruction={"parts": [{"text": "a"}, {"text": "b"}]}, tools=[]))

    assert api.received[0].json["systemInstruction"] == {"parts": [{"text": "a"}, {"text": "b"}]}
    assert "tools" not in api.received[0].json


def test_transport_failures_are_recognised_for_either_httpx_flavour():
    timeout = type("ReadTimeout", (type("TimeoutException", (Exception,), {}),), {"__module__": "httpx._exceptions"})
    refused = type("ConnectError", (type("TransportError", (Exception,), {}),), {"__module__": "httpx2._exceptions"})

    assert transport_failure(timeout("slow")) == "timeout"
    assert transport_failure(refused("refused")) == "connection"
    assert transport_failure(ConnectionResetError()) == "connection"
    assert transport_failure(ValueError("a bug")) is None


# ── the output schema on the wire ─────────────────────────────────────────────────────────────

SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string"}, "risk": {"oneOf": [{"type": "integer"}, {"type": "null"}]}},
    "required": ["summary"],
}
NATIVE_REFUSED = "Function calling with a response mime type: 'application/json' is unsupported"


def test_an_output_schema_goes_as_response_json_schema_with_a_json_mime_type(api: FakeAPI, provider: GeminiProvider):
    api.reply(generated([{"text": '{"summary": "ok"}'}]))

    # a responseSchema in the parent's generation settings gives way to the launch's schema
    stale = {"responseSchema": {"type": "STRING"}, "temperature": 0.1}
    provider.generate(request([user("audit")], output_schema=SCHEMA, generation=stale))

    config = api.received[0].json["generationConfig"]
    assert config == {"temperature": 0.1, "responseMimeType": "application/json", "responseJsonSchema": SCHEMA}
    assert api.received[0].json["systemInstruction"] == {"parts": [{"text": "You are a coding agent."}], "role": "user"}
    assert generation_config(request([user("no schema")])).response_json_schema is None


def test_a_model_that_refuses_json_mode_gets_the_schema_in_the_system_instruction_from_then_on(
    api: FakeAPI, provider: GeminiProvider, caplog: pytest.LogCaptureFixture
):
    # Given a model that does not combine function calling with a JSON response (an INVALID_ARGUMENT 400)
    api.reply(api_error(400, "INVALID_ARGUMENT", NATIVE_REFUSED), status=400)
    api.reply(generated([{"text": '{"summary": "ok"}'}]))
    api.reply(generated([{"text": '{"summary": "again"}'}]))

    # When two steps of a fork with an output schema call it
    first = provider.generate(request([user("audit")], output_schema=SCHEMA))
    second = provider.generate(request([user("audit")], step=1, output_schema=SCHEMA))

    # Then the refused call was sent again at once with the schema stated in the system instruction, and
    # the next step went straight to that form
    assert (first.content.parts[0].text, second.content.parts[0].text) == ('{"summary": "ok"}', '{"summary": "again"}')
    native, *text = (r.json for r in api.received)
    assert native["generationConfig"]["responseJsonSchema"] == SCHEMA
    assert len(text) == 2
    for sent in text:
        assert "responseJsonSchema" not in sent.get("generationConfig", {})
        assert "responseMimeType" not in sent.get("generationConfig", {})
        assert sent["systemInstruction"] == {
            "parts": [{"text": f"You are a coding agent.\n\n{schema_note(SCHEMA)}"}],
            "role": "user",
        }
    refusals = [r.getMessage() for r in caplog.records if "refused the output schema" in r.getMessage()]
    assert len(refusals) == 1 and NATIVE_REFUSED in refusals[0], refusals


def test_a_content_system_instruction_gets_the_schema_as_one_more_part():
    config = generation_config(
        request([], system_instruction={"parts": [{"text": "a"}]}, output_schema=SCHEMA), native=False
    )

    assert [p.text for p in config.system_instruction.parts] == ["a", schema_note(SCHEMA)]
    assert config.response_json_schema is None
    none = generation_config(request([], system_instruction=None, output_schema=SCHEMA), native=False)
    assert none.system_instruction == schema_note(SCHEMA)


def test_cached_content_tokens_are_reported_as_cached_input_tokens(api: FakeAPI, provider: GeminiProvider):
    api.reply(generated([{"text": "ok"}], usage=(4096, 3, 0), cached=3900)).reply(generated([{"text": "ok"}]))

    cached = provider.generate(request([user("hi")], cache_key="s-1"))
    uncached = provider.generate(request([user("hi")]))

    assert cached.usage.model_dump() == {"input_tokens": 4096, "output_tokens": 3, "cached_input_tokens": 3900}
    assert uncached.usage.cached_input_tokens == 0
    # implicit caching: no key on this wire, so a request with one is byte for byte a request without
    assert api.received[0].raw == api.received[1].raw

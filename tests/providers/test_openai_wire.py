"""The adapter posts its own JSON body (no SDK transform walk): the wire must be what `create()` sends."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.fakeapi import FakeAPI, Received
from tests.providers.test_openai_compat import KEY, MODEL, TOOLS, completion, tool_call
from workers.history.messages import load_contents
from workers.providers import ModelRequest
from workers.providers.openai_compat import GENERATION_KEYS, OpenAICompatProvider, from_completion
from workers.providers.retry import RetryPolicy

SCHEMA = {
    "title": "Verdict",
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "why": {"type": "string"}},
    "required": ["ok", "why"],
    "additionalProperties": False,
}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake").decode()
WAV = base64.b64encode(b"RIFF fake wav").decode()
ANSWER = completion(
    {"content": "Reading it.", "tool_calls": [tool_call("call_9", "read_file", '{"path": "b.py"}')]},
    finish_reason="tool_calls",
    cached=7,
)
# headers that differ between any two requests of one client, whichever way they are sent
PER_REQUEST_HEADERS = frozenset({"content-length"})


@pytest.fixture
def api() -> Iterator[FakeAPI]:
    with FakeAPI() as server:
        yield server


@pytest.fixture
def adapter(api: FakeAPI) -> Iterator[OpenAICompatProvider]:
    provider = OpenAICompatProvider(
        api_key=KEY, base_url=f"{api.url}/v1", timeout_s=5.0, retry=RetryPolicy(max_attempts=1)
    )
    yield provider
    provider.close()


def rich_request(**extra: Any) -> ModelRequest:
    """A request with every kind of thing the adapter sends: tools, schema, settings, cache key, media, calls."""
    history = [
        {"role": "user", "parts": [{"text": "Look at this screenshot and recording."}]},
        {"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": PNG}}]},
        {"role": "user", "parts": [{"inlineData": {"mimeType": "audio/wav", "data": WAV}}]},
        {"role": "user", "parts": [{"fileData": {"mimeType": "image/jpeg", "fileUri": "https://example.com/a.jpg"}}]},
        {
            "role": "model",
            "parts": [
                {"text": "Let me read it. ✓"},
                {"functionCall": {"id": "call_1", "name": "read_file", "args": {"path": "a.py", "n": [1, 2.5]}}},
                {"functionCall": {"name": "list_directory", "args": {}}},
            ],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"id": "call_1", "name": "read_file", "response": {"output": "x = 1\n"}}},
                {"functionResponse": {"name": "list_directory", "response": {"entries": ["a.py"], "more": None}}},
            ],
        },
    ]
    fields: dict[str, Any] = {
        "fork_id": "f-wire",
        "step": 3,
        "model": MODEL,
        "system_instruction": {"parts": [{"text": "You are a coding agent."}]},
        "tools": TOOLS,
        "messages": load_contents(history),
        "output_schema": SCHEMA,
        "cache_key": "session-" + "s" * 80,  # longer than the API takes: sent as its digest
        "generation": {
            "temperature": 0.2,
            "topP": 0.9,
            "maxOutputTokens": 512,
            "stopSequences": ["END"],
            "seed": 7,
            "presencePenalty": 0.1,
            "frequencyPenalty": 0.3,
        },
    }
    return ModelRequest(**(fields | extra))


def sent_by_create(api: FakeAPI, params: dict[str, Any]) -> tuple[Received, ChatCompletion]:
    """What the SDK's `chat.completions.create` sends for `params`, and what it parses from ANSWER."""
    client = openai.OpenAI(api_key=KEY, base_url=f"{api.url}/v1", timeout=5.0, max_retries=0)
    try:
        api.reply(ANSWER)
        parsed = client.chat.completions.create(**params)
    finally:
        client.close()
    return api.received[-1], parsed


def headers_of(received: Received) -> dict[str, str]:
    return {k: v for k, v in received.headers.items() if k not in PER_REQUEST_HEADERS}


@pytest.mark.parametrize("native", [True, False], ids=["response_format", "schema_in_system_message"])
def test_the_adapter_sends_the_same_body_and_headers_as_the_sdks_create(
    api: FakeAPI, adapter: OpenAICompatProvider, native: bool
):
    request = rich_request()
    params = adapter.params(request, native=native)
    expected, parsed = sent_by_create(api, params)
    if not native:
        adapter.schemas.refuse(MODEL)
    api.reply(ANSWER)
    response = adapter.generate(request)
    sent = api.received[-1]
    # every setting the adapter maps is in the body (BODY_ORDER drops a name it does not list)
    assert set(params) >= {"tools", "prompt_cache_key", *GENERATION_KEYS.values()}
    assert ("response_format" in params) is native
    assert sent.path == expected.path == "/v1/chat/completions"
    assert sent.json == expected.json
    assert sent.raw == expected.raw  # key order and encoding too
    assert headers_of(sent) == headers_of(expected)
    assert response == from_completion(parsed, step=request.step)


def test_a_request_without_tools_schema_settings_or_cache_key_is_sent_as_create_sends_it(
    api: FakeAPI, adapter: OpenAICompatProvider
):
    request = rich_request(tools=[], output_schema=None, generation={}, cache_key=None, system_instruction=None)
    expected, _ = sent_by_create(api, adapter.params(request))
    api.reply(ANSWER)
    adapter.generate(request)
    assert api.received[-1].raw == expected.raw
    assert set(expected.json) == {"model", "messages"}


def test_the_body_is_plain_json_so_create_would_not_change_it():
    """The premise of skipping `maybe_transform`: for our bodies it is the identity."""
    from openai._utils import maybe_transform
    from openai.types.chat import completion_create_params

    body = OpenAICompatProvider(api_key=KEY, base_url="http://127.0.0.1:9/v1", timeout_s=1.0, retry=RetryPolicy())
    try:
        params = body.params(rich_request())
    finally:
        body.close()
    assert maybe_transform(params, completion_create_params.CompletionCreateParamsNonStreaming) == params

"""Each model adapter end to end through a live worker, against a local server speaking its wire format.

The worker is a real Celery worker running forkq's app, its provider pointed (by settings or by
`FORKQ_*` variables) at a `FakeAPI` that answers like the OpenAI Chat Completions or the Gemini
`generateContent` API. The fake model answers from what it was sent (it reads the directory listing
to choose the file it asks for, and quotes the file it was given), so the fork's output proves the
round trip: seed → worker → SDK → wire → tool → wire → final answer.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from broker_config.settings import Settings
from tests.e2e.conftest import APP_PY, MARKER
from tests.fakeapi import FakeAPI, Received, Reply
from tests.live import event_types, queue_drained, wait_until
from tests.providers.test_gemini import api_error, generated
from tests.providers.test_openai_compat import completion, error_body, tool_call
from workers.app import make_app, runtime_of
from workers.client import ForkClient, ForkHandle
from workers.history.messages import load_contents
from workers.providers.openai_compat import to_messages
from workers.records.fork import ForkResult, Status

OPENAI_MODEL = "gpt-4.1-mini"
GEMINI_MODEL = "gemini-2.5-flash"
OPENAI_KEY = "sk-e2e-openai-7f3a9c1d5e"
GEMINI_KEY = "AIzaSy-e2e-gemini-4b8d2f6a0c"
GEMINI_PATH = f"/v1beta/models/{GEMINI_MODEL}:generateContent"
FORK = {"description": "summarise the notes", "prompt": "Summarise notes.txt for me.", "subagent_type": "fork"}
SIG_1, SIG_2 = "CiIBc2lnLW9uZQ==", "CiIBc2lnLXR3bw=="  # Gemini thought signatures (base64 bytes)


def openai_settings(api: FakeAPI, **extra: Any) -> dict[str, Any]:
    return {"provider": "openai", "openai_base_url": f"{api.url}/v1", "openai_api_key": OPENAI_KEY, **extra}


def gemini_settings(api: FakeAPI, **extra: Any) -> dict[str, Any]:
    return {"provider": "gemini", "gemini_base_url": f"{api.url}/", "gemini_api_key": GEMINI_KEY, **extra}


def provider_settings(kind: str, api: FakeAPI) -> dict[str, Any]:
    return openai_settings(api) if kind == "openai" else gemini_settings(api)


def model_of(kind: str) -> str:
    return OPENAI_MODEL if kind == "openai" else GEMINI_MODEL


# ── reading what the server received ──────────────────────────────────────────────────────────


def raw_value(received: Received, key: str) -> str:
    """The exact text of the first `"key": <value>` in the request body (byte-for-byte, not re-serialised)."""
    text = received.raw.decode("utf-8")
    found = re.search(rf'"{re.escape(key)}"\s*:\s*', text)
    assert found is not None, f"{key!r} not in the request body"
    _, end = json.JSONDecoder().raw_decode(text, found.end())
    return text[found.end() : end]


def raw_first_item(array_text: str) -> str:
    """The exact text of the first element of a JSON array given as text."""
    assert array_text.startswith("[")
    start = len(array_text) - len(array_text[1:].lstrip())  # past the [ and any whitespace
    _, end = json.JSONDecoder().raw_decode(array_text, start)
    return array_text[start:end]


def assert_prompt_cache_parity(received: list[Received], history_key: str, fixed: dict[str, Callable[[Received], str]]):
    """Every step resends the fixed parts byte-identically, and the previous step's history as a byte prefix."""
    for name, extract in fixed.items():
        first = extract(received[0])
        for index, later in enumerate(received[1:], start=1):
            assert extract(later) == first, f"{name} of request {index} differs from request 0"
    for index in range(1, len(received)):
        before = raw_value(received[index - 1], history_key).rstrip()[:-1]  # without the closing ]
        assert raw_value(received[index], history_key).startswith(before), f"request {index} rewrote the history"


def openai_tool_messages(received: Received) -> dict[str, str]:
    """tool_call_id → content of every `tool` message a Chat Completions request carries."""
    return {m["tool_call_id"]: m["content"] for m in received.json["messages"] if m["role"] == "tool"}


def gemini_function_responses(received: Received) -> list[dict[str, Any]]:
    """Every functionResponse a generateContent request carries, in order."""
    return [p["functionResponse"] for c in received.json["contents"] for p in c["parts"] if "functionResponse" in p]


def normalised_signatures(value: Any) -> Any:
    """`value` with each thoughtSignature decoded to bytes: the SDK re-encodes them URL-safe, the bytes stay."""
    if isinstance(value, list):
        return [normalised_signatures(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: normalised_signatures(v) for k, v in value.items()}
    if isinstance(out.get("thoughtSignature"), str):
        out["thoughtSignature"] = base64.urlsafe_b64decode(out["thoughtSignature"].replace("+", "-").replace("/", "_"))
    return out


def seed_of(client: ForkClient, handle: ForkHandle) -> list[dict[str, Any]]:
    """The fork's seed as its first model call must see it: initial messages, then the task prompt."""
    record = client.inspect(handle.fork_id)
    return [*record["initial_messages"], {"role": "user", "parts": [{"text": record["task_prompt"]}]}]


def wait_result(handle: ForkHandle, timeout: float = 20) -> ForkResult:
    return handle.wait(timeout=timeout)


# ── the fake models: list the directory, read what it found, quote it ─────────────────────────


def listed_text_file(listing: str) -> str:
    """The first `.txt` name of a directory listing (what a model would pick to read)."""
    return next((name for name in listing.splitlines() if name.endswith(".txt")), "no-text-file-listed")


def script_openai_tool_run(api: FakeAPI) -> None:
    api.reply(
        completion(
            {"content": None, "tool_calls": [tool_call("call_ls", "list_directory", '{"path": "."}')]},
            finish_reason="tool_calls",
            usage=(1000, 11),
        )
    )

    def read_what_was_listed(received: Received) -> dict[str, Any]:
        name = listed_text_file(openai_tool_messages(received).get("call_ls", ""))
        calls = [
            tool_call("call_rd_notes", "read_file", json.dumps({"path": name})),
            tool_call("call_rd_app", "read_file", '{"path": "src/app.py"}'),
        ]
        return completion(
            {"content": "Reading both.", "tool_calls": calls}, finish_reason="tool_calls", usage=(1100, 22)
        )

    def quote_what_was_read(received: Received) -> dict[str, Any]:
        notes = openai_tool_messages(received).get("call_rd_notes", "<nothing>")
        return completion({"content": f"notes.txt says: {notes.strip()}"}, usage=(1300, 33))

    api.reply(read_what_was_listed)
    api.reply(quote_what_was_read)


def script_gemini_tool_run(api: FakeAPI) -> None:
    list_call = {"functionCall": {"id": "fc-ls", "name": "list_directory", "args": {"path": "."}}}
    api.reply(generated([{**list_call, "thoughtSignature": SIG_1}], usage=(1000, 11, 5)))

    def read_what_was_listed(received: Received) -> dict[str, Any]:
        answers = {r.get("id"): r["response"] for r in gemini_function_responses(received)}
        listing = answers.get("fc-ls", {}).get("output", "")
        parts = [
            {"text": "Reading both."},
            {
                "functionCall": {"id": "fc-rd-notes", "name": "read_file", "args": {"path": listed_text_file(listing)}},
                "thoughtSignature": SIG_2,
            },
            {"functionCall": {"id": "fc-rd-app", "name": "read_file", "args": {"path": "src/app.py"}}},
        ]
        return generated(parts, usage=(1100, 22, 7))

    def quote_what_was_read(received: Received) -> dict[str, Any]:
        answers = {r.get("id"): r["response"] for r in gemini_function_responses(received)}
        notes = answers.get("fc-rd-notes", {}).get("output", "<nothing>")
        return generated([{"text": f"notes.txt says: {notes.strip()}"}], usage=(1300, 33, 0))

    api.reply(read_what_was_listed)
    api.reply(quote_what_was_read)


# ── a multi-step tool-calling run per adapter ─────────────────────────────────────────────────


def test_an_openai_fork_lists_reads_and_answers_through_a_live_worker(
    forkq: Callable[..., ForkClient], openai_api: FakeAPI, make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given a worker whose provider is the local Chat Completions server, and a model that lists the
    # fork's cwd, reads the text file it found (and src/app.py in parallel), then quotes it
    client = forkq(**openai_settings(openai_api))
    script_openai_tool_run(openai_api)
    parent = make_parent(OPENAI_MODEL)

    # When the parent forks
    handle = client.launch(parent, FORK)
    result = wait_result(handle)

    # Then the fork succeeded with the quote, and its usage sums the three steps
    assert result.status is Status.SUCCEEDED, result.error
    assert result.output == f"notes.txt says: {MARKER}"
    usage = result.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (3400, 66, 3466)
    assert (usage.tool_uses, usage.model_calls) == (3, 3)
    steps = openai_api.received
    assert len(steps) == 3
    for sent in steps:
        assert sent.path == "/v1/chat/completions"
        assert sent.headers["authorization"] == f"Bearer {OPENAI_KEY}"
        assert sent.json["model"] == OPENAI_MODEL

    # and each tool result went back as a `tool` message answering its call id, right after the call
    assert steps[1].json["messages"][-2:] == [
        {"role": "assistant", "content": None, "tool_calls": [tool_call("call_ls", "list_directory", '{"path": "."}')]},
        {"role": "tool", "tool_call_id": "call_ls", "content": "notes.txt\nsrc/"},
    ]
    assert steps[2].json["messages"][-3:] == [
        {
            "role": "assistant",
            "content": "Reading both.",
            "tool_calls": [
                tool_call("call_rd_notes", "read_file", '{"path": "notes.txt"}'),
                tool_call("call_rd_app", "read_file", '{"path": "src/app.py"}'),
            ],
        },
        {"role": "tool", "tool_call_id": "call_rd_notes", "content": MARKER + "\n"},
        {"role": "tool", "tool_call_id": "call_rd_app", "content": APP_PY},
    ]

    # and the system instruction and the parent's declarations went out byte-identical at every step,
    # each step's history extending the previous one's (prompt-cache parity)
    assert steps[0].json["messages"][0] == {"role": "system", "content": parent["system_instruction"]}
    assert steps[0].json["tools"] == [
        {
            "type": "function",
            "function": {"name": d["name"], "description": d["description"], "parameters": d["parameters"]},
        }
        for d in parent["tools"]
    ]
    assert_prompt_cache_parity(
        steps,
        "messages",
        {
            "system message": lambda r: raw_first_item(raw_value(r, "messages")),
            "tools": lambda r: raw_value(r, "tools"),
        },
    )

    # and the first call carried the forked history: the seed, then the task prompt
    seed = seed_of(client, handle)
    first = steps[0].json["messages"]
    assert first == to_messages(parent["system_instruction"], load_contents(seed))
    assert first[-1] == {"role": "user", "content": seed[-1]["parts"][0]["text"]}
    assert any(FORK["prompt"] in (m.get("content") or "") for m in first if m["role"] == "user")
    assert len([m for m in first if m["role"] == "assistant"]) == len([c for c in seed if c["role"] == "model"])
    milestones = ["queued", "started", "step", "tool", "step", "tool", "tool", "step", "finished"]
    assert event_types(client, handle.fork_id) == milestones


def test_a_gemini_fork_lists_reads_and_answers_through_a_live_worker(
    forkq: Callable[..., ForkClient], gemini_api: FakeAPI, make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given a worker whose provider is the local generateContent server, and a model that lists the
    # fork's cwd, reads the text file it found (and src/app.py in parallel), then quotes it
    client = forkq(**gemini_settings(gemini_api))
    script_gemini_tool_run(gemini_api)
    parent = make_parent(GEMINI_MODEL)

    # When the parent forks
    handle = client.launch(parent, FORK)
    result = wait_result(handle)

    # Then the fork succeeded with the quote; thinking tokens count as output
    assert result.status is Status.SUCCEEDED, result.error
    assert result.output == f"notes.txt says: {MARKER}"
    usage = result.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (3400, 78, 3478)
    assert (usage.tool_uses, usage.model_calls) == (3, 3)
    steps = gemini_api.received
    assert len(steps) == 3
    for sent in steps:
        assert sent.path == GEMINI_PATH
        assert sent.headers["x-goog-api-key"] == GEMINI_KEY
        assert GEMINI_KEY not in sent.path

    # and the calls went back with their thought signatures, answered by functionResponses of the same id and name
    assert steps[1].json["contents"][-2:] == [
        {
            "role": "model",
            "parts": [
                {
                    "functionCall": {"id": "fc-ls", "name": "list_directory", "args": {"path": "."}},
                    "thoughtSignature": SIG_1,
                }
            ],
        },
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "id": "fc-ls",
                        "name": "list_directory",
                        "response": {"output": "notes.txt\nsrc/"},
                    }
                }
            ],
        },
    ]
    model_turn, answers = steps[2].json["contents"][-2:]
    assert model_turn["parts"][1]["thoughtSignature"] == SIG_2
    assert answers == {
        "role": "user",
        "parts": [
            {"functionResponse": {"id": "fc-rd-notes", "name": "read_file", "response": {"output": MARKER + "\n"}}},
            {"functionResponse": {"id": "fc-rd-app", "name": "read_file", "response": {"output": APP_PY}}},
        ],
    }

    # and the system instruction and the parent's declarations went out byte-identical at every step,
    # each step's contents extending the previous one's (prompt-cache parity)
    first = steps[0].json
    assert first["systemInstruction"] == {"parts": [{"text": parent["system_instruction"]}], "role": "user"}
    [tool] = first["tools"]
    assert [
        (d["name"], d["description"], d.get("parametersJsonSchema", d.get("parameters_json_schema")))
        for d in tool["functionDeclarations"]
    ] == [(d["name"], d["description"], d["parameters"]) for d in parent["tools"]]
    assert_prompt_cache_parity(
        steps,
        "contents",
        {"systemInstruction": lambda r: raw_value(r, "systemInstruction"), "tools": lambda r: raw_value(r, "tools")},
    )

    # and the first call carried the forked history as native Contents: the seed, then the task prompt
    assert normalised_signatures(first["contents"]) == normalised_signatures(seed_of(client, handle))


# ── retries and failures through the worker ───────────────────────────────────────────────────


def text_answer(kind: str, text: str) -> dict[str, Any]:
    return completion({"content": text}) if kind == "openai" else generated([{"text": text}])


def rate_limited(kind: str) -> dict[str, Any]:
    if kind == "openai":
        return error_body("Rate limit reached for requests")
    return api_error(429, "RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota).")


@pytest.mark.parametrize("kind", ["openai", "gemini"])
def test_a_429_with_retry_after_is_waited_out_and_the_fork_succeeds(
    kind: str,
    forkq: Callable[..., ForkClient],
    apis: dict[str, FakeAPI],
    make_parent: Callable[[str], dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a server that rate-limits the first call for one second
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    api.reply(rate_limited(kind), status=429, headers={"Retry-After": "1"})
    api.reply(text_answer(kind, "done after the wait"))

    # When a fork runs
    result = wait_result(client.launch(make_parent(model_of(kind)), FORK))

    # Then the worker waited as asked, resent the same request, and the retry is not another model call
    assert result.status is Status.SUCCEEDED, result.error
    assert result.output == "done after the wait"
    assert result.usage.model_calls == 1
    first, second = api.received
    assert second.at - first.at >= 0.95
    assert second.raw == first.raw
    retries = [r.getMessage() for r in caplog.records if r.name == "forkq.provider"]
    assert len(retries) == 1 and "attempt 1/3 failed" in retries[0] and "retrying in 1.00s" in retries[0], retries


FAILURES = {
    # kind, status: attempts made, the fix the message names
    ("openai", 503): (3, "FORKQ_OPENAI_BASE_URL"),
    ("gemini", 503): (3, "FORKQ_GEMINI_BASE_URL"),
    ("openai", 401): (1, "FORKQ_OPENAI_API_KEY"),
    ("gemini", 403): (1, "FORKQ_GEMINI_API_KEY"),
}


def failure_body(kind: str, status: int) -> dict[str, Any]:
    if kind == "openai":
        return error_body("Service unavailable" if status == 503 else "Incorrect API key provided", code=str(status))
    return api_error(status, "UNAVAILABLE" if status == 503 else "PERMISSION_DENIED", "The model is unavailable")


@pytest.mark.parametrize(("kind", "status"), sorted(FAILURES), ids=[f"{k}-{s}" for k, s in sorted(FAILURES)])
def test_a_provider_that_keeps_failing_ends_the_fork_failed_with_a_terminal_error(
    kind: str,
    status: int,
    forkq: Callable[..., ForkClient],
    apis: dict[str, FakeAPI],
    make_parent: Callable[[str], dict[str, Any]],
) -> None:
    # Given a model that makes one tool call, then a server that answers every further call with `status`
    attempts, fix = FAILURES[kind, status]
    api, model = apis[kind], model_of(kind)
    client = forkq(**provider_settings(kind, api))
    if kind == "openai":
        api.reply(completion({"content": None, "tool_calls": [tool_call("c1", "list_directory", "{}")]}, "tool_calls"))
    else:
        api.reply(generated([{"functionCall": {"id": "c1", "name": "list_directory", "args": {}}}]))
    for _ in range(5):
        api.reply(failure_body(kind, status), status=status)

    # When a fork runs
    handle = client.launch(make_parent(model), FORK)
    result = wait_result(handle)

    # Then it failed after the bounded attempts, with an error naming provider, model, status, attempts and fix
    assert result.status is Status.FAILED
    assert result.output is None
    error = result.error or ""
    assert error.startswith("ProviderError: "), error
    for part in (f"{kind} model {model!r}", f"HTTP {status}", f"after {attempts} attempt", fix):
        assert part in error, f"{part!r} not in {error!r}"
    state = client.status(handle.fork_id)
    assert (state.status, state.error) == (Status.FAILED, error)
    assert event_types(client, handle.fork_id)[-1] == "finished"
    # nothing runs it again: no redelivery, no loop (once the job is acknowledged, none can come)
    wait_until(queue_drained(client.redis, client.settings.queue), 15, "the job to be acknowledged")
    assert len(api.received) == 1 + attempts


# ── malformed tool calls ──────────────────────────────────────────────────────────────────────


def test_malformed_openai_tool_arguments_get_an_error_response_and_the_fork_continues(
    forkq: Callable[..., ForkClient], openai_api: FakeAPI, make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given a model whose first call has truncated JSON arguments, and which retries once it reads why
    client = forkq(**openai_settings(openai_api))
    truncated = '{"path": "notes.txt"'
    openai_api.reply(
        completion({"content": None, "tool_calls": [tool_call("call_bad", "read_file", truncated)]}, "tool_calls")
    )

    def retry_after_reading_the_error(received: Received) -> dict[str, Any]:
        error = json.loads(openai_tool_messages(received).get("call_bad", "{}")).get("error", "")
        path = "notes.txt" if "not valid JSON" in error else "wrong.txt"
        return completion(
            {"content": None, "tool_calls": [tool_call("call_ok", "read_file", json.dumps({"path": path}))]},
            "tool_calls",
        )

    openai_api.reply(retry_after_reading_the_error)
    openai_api.reply(lambda received: completion({"content": openai_tool_messages(received).get("call_ok", "")}))

    # When a fork runs
    handle = client.launch(make_parent(OPENAI_MODEL), FORK)
    result = wait_result(handle)

    # Then the garbled call was answered with an error (paired with its id, nothing run) and the fork went on
    assert result.status is Status.SUCCEEDED, result.error
    assert result.output == MARKER + "\n"
    assert (result.usage.model_calls, result.usage.tool_uses) == (3, 2)
    second = openai_api.received[1].json["messages"]
    assert second[-2]["tool_calls"] == [tool_call("call_bad", "read_file", "{}")]
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_bad"
    error = json.loads(second[-1]["content"])["error"]
    assert "'read_file'" in error and "not valid JSON" in error and "Nothing was run" in error
    tools = [e.wire_data() for e in client.events(handle.fork_id) if e.type == "tool"]
    assert [(t["tool"], t["ok"]) for t in tools] == [("read_file", False), ("read_file", True)]


def test_a_malformed_gemini_function_call_is_reported_to_the_model_and_the_fork_continues(
    forkq: Callable[..., ForkClient], gemini_api: FakeAPI, make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given a model whose first answer is a function call Gemini could not parse (the API's own signal)
    client = forkq(**gemini_settings(gemini_api))
    malformed = generated([], finish_reason="MALFORMED_FUNCTION_CALL")
    malformed["candidates"][0]["content"] = {}
    malformed["candidates"][0]["finishMessage"] = "Malformed function call: print(default_api.read_file(path=)"
    gemini_api.reply(malformed)
    gemini_api.reply(generated([{"text": "recovered"}]))

    # When a fork runs
    result = wait_result(client.launch(make_parent(GEMINI_MODEL), FORK))

    # Then the model was told (a second call that mentions the malformed call), and the fork went on
    assert len(gemini_api.received) == 2, (
        f"one model call only; the fork ended {result.status.value}: {result.output!r}"
    )
    assert "malformed" in json.dumps(gemini_api.received[1].json["contents"][-1]).lower()
    assert result.status is Status.SUCCEEDED, result.error
    assert result.output == "recovered"


def test_a_gemini_answer_the_sdk_cannot_parse_fails_the_fork_with_a_provider_error(
    forkq: Callable[..., ForkClient], gemini_api: FakeAPI, make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given a Gemini-compatible server whose function call carries arguments that are not an object
    # (the real API cannot send this: args is a protobuf Struct; a translating proxy can)
    client = forkq(**gemini_settings(gemini_api))
    body = generated([{"text": "x"}])
    body["candidates"][0]["content"]["parts"] = [
        {"functionCall": {"id": "c1", "name": "read_file", "args": "notes.txt"}}
    ]
    gemini_api.reply(body)

    # When a fork runs
    result = wait_result(client.launch(make_parent(GEMINI_MODEL), FORK))

    # Then the fork failed at once with forkq's error naming provider, model and the offending field
    assert result.status is Status.FAILED
    error = result.error or ""
    assert error.startswith("ProviderError: gemini model 'gemini-2.5-flash': failed with a non-retryable error"), error
    assert "functionCall.args" in error and "FORKQ_GEMINI_BASE_URL" in error
    assert len(gemini_api.received) == 1


# ── the output schema reaches the model ───────────────────────────────────────────────────────

LISTING_SCHEMA = {
    "title": "listing",
    "type": "object",
    "properties": {"files": {"type": "array", "items": {"type": "string"}}},
    "required": ["files"],
    "additionalProperties": False,
}
LISTING_ANSWER = '{"files": ["notes.txt", "src/"]}'
NATIVE_REFUSALS = {
    "openai": {
        "error": {
            "message": "'response_format.type' json_schema is not supported by this server",
            "type": "invalid_request_error",
            "param": "response_format",
            "code": None,
        }
    },
    "gemini": api_error(
        400, "INVALID_ARGUMENT", "Function calling with a response mime type: 'application/json' is unsupported"
    ),
}


def list_call(kind: str) -> dict[str, Any]:
    if kind == "openai":
        call = tool_call("c-ls", "list_directory", '{"path": "."}')
        return completion({"content": None, "tool_calls": [call]}, finish_reason="tool_calls")
    return generated([{"functionCall": {"id": "c-ls", "name": "list_directory", "args": {"path": "."}}}])


def native_schema(kind: str, received: Received) -> Any:
    """The output schema a request carries in its API's native form, if any."""
    if kind == "openai":
        return received.json.get("response_format", {}).get("json_schema", {}).get("schema")
    config = received.json.get("generationConfig", {})
    assert ("responseJsonSchema" in config) == (config.get("responseMimeType") == "application/json"), config
    return config.get("responseJsonSchema")


def system_text_of(kind: str, received: Received) -> str:
    if kind == "openai":
        first = received.json["messages"][0]
        assert first["role"] == "system"
        return str(first["content"])
    return "".join(p["text"] for p in received.json["systemInstruction"]["parts"])


@pytest.mark.parametrize("kind", ["openai", "gemini"])
def test_the_output_schema_goes_to_the_model_natively_at_every_step(
    kind: str, forkq: Callable[..., ForkClient], apis: dict[str, FakeAPI], make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given a worker on a server that takes native structured output, and a model that lists, then answers
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    api.reply(list_call(kind))
    api.reply(text_answer(kind, LISTING_ANSWER))
    parent = make_parent(model_of(kind))

    # When a fork is launched with an output schema
    handle = client.launch(parent, FORK, output_schema=LISTING_SCHEMA)
    result = wait_result(handle)

    # Then every request carried the launch's schema in the API's own form, before any answer was checked,
    # and the system instruction is the parent's alone
    assert result.status is Status.SUCCEEDED, result.error
    assert json.loads(result.output or "") == {"files": ["notes.txt", "src/"]}
    assert len(api.received) == 2
    for sent in api.received:
        assert native_schema(kind, sent) == LISTING_SCHEMA
        assert system_text_of(kind, sent) == parent["system_instruction"]
    if kind == "openai":
        assert api.received[0].json["response_format"]["json_schema"]["strict"] is True

    # and the request digests cover the schema alike where they are computed: before the claim (the first
    # model_call event, published by the claim) and by the loop (the journal), one model_call per step
    journal = runtime_of(client.app).leases.journal(handle.fork_id)
    announced = [e.data.request_digest for e in client.events(handle.fork_id) if e.type == "model_call"]
    assert announced == [e.request_digest for e in journal if e.kind == "model"]


@pytest.mark.parametrize("kind", ["openai", "gemini"])
def test_a_server_that_refuses_native_mode_gets_the_schema_as_text_and_the_fork_succeeds(
    kind: str, forkq: Callable[..., ForkClient], apis: dict[str, FakeAPI], make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given a server that refuses native structured output with a 400, then answers the same request without it
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    api.reply(NATIVE_REFUSALS[kind], status=400)
    api.reply(list_call(kind))
    api.reply(text_answer(kind, LISTING_ANSWER))
    parent = make_parent(model_of(kind))

    # When a fork with an output schema runs two steps
    result = wait_result(client.launch(parent, FORK, output_schema=LISTING_SCHEMA))

    # Then the refused request was sent again with the schema stated in the system instruction, the next
    # step went straight to that form, and the fork succeeded; the refusal was not a model call
    assert result.status is Status.SUCCEEDED, result.error
    assert json.loads(result.output or "") == {"files": ["notes.txt", "src/"]}
    assert result.usage.model_calls == 2
    refused, *text = api.received
    assert native_schema(kind, refused) == LISTING_SCHEMA
    assert len(text) == 2
    for sent in text:
        assert native_schema(kind, sent) is None
        system = system_text_of(kind, sent)
        assert system.startswith(parent["system_instruction"])
        assert json.dumps(LISTING_SCHEMA, sort_keys=True) in system and "only a JSON value" in system
    # and the resent request is the refused one otherwise: the same conversation and tools
    conversation = (lambda r: r.json["messages"][1:]) if kind == "openai" else (lambda r: r.json["contents"])
    assert conversation(text[0]) == conversation(refused)
    assert text[0].json["tools"] == refused.json["tools"]


# ── routing ───────────────────────────────────────────────────────────────────────────────────


def test_provider_routes_send_each_model_to_the_server_its_glob_names(
    forkq: Callable[..., ForkClient], apis: dict[str, FakeAPI], make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given one worker routing gpt-* to the Chat Completions server, gemini-* to the Gemini server,
    # and any other model to the default (scripted) provider
    openai_api, gemini_api = apis["openai"], apis["gemini"]
    routes = {"gpt-*": "openai", "gemini-*": "gemini"}
    settings = {**openai_settings(openai_api), **gemini_settings(gemini_api), "provider": "scripted"}
    client = forkq(**settings, provider_routes=routes)
    openai_api.reply(text_answer("openai", "answered by the chat completions server"))
    gemini_api.reply(text_answer("gemini", "answered by the gemini server"))

    # When three forks of parents on three models run at once
    handles = {model: client.launch(make_parent(model), FORK) for model in (OPENAI_MODEL, GEMINI_MODEL, "local-7b")}
    results = {model: wait_result(handle) for model, handle in handles.items()}

    # Then each model's calls reached the server its route names, and only that one
    assert results[OPENAI_MODEL].output == "answered by the chat completions server"
    assert results[GEMINI_MODEL].output == "answered by the gemini server"
    assert (results["local-7b"].output or "").startswith("[scripted provider]")
    assert [r.json["model"] for r in openai_api.received] == [OPENAI_MODEL]
    assert [r.path for r in gemini_api.received] == [GEMINI_PATH]


def test_a_model_no_setting_routes_fails_its_fork_instead_of_meeting_the_scripted_provider(
    forkq: Callable[..., ForkClient], openai_api: FakeAPI, make_parent: Callable[[str], dict[str, Any]]
) -> None:
    # Given a worker that routes gpt-* to the Chat Completions server and names no default provider
    client = forkq(**openai_settings(openai_api, provider=None), provider_routes={"gpt-*": "openai"})

    # When a parent on a model no route names forks
    result = wait_result(client.launch(make_parent("local-7b"), FORK))

    # Then the fork failed with the fix, rather than "succeeding" with the scripted provider's fake answer
    assert result.status is Status.FAILED, result.output
    error = result.error or ""
    assert "model 'local-7b' matches no FORKQ_PROVIDER_ROUTES glob and FORKQ_PROVIDER is unset" in error, error
    assert "set FORKQ_PROVIDER to one of scripted, openai, gemini" in error
    assert openai_api.received == []


# ── no API key ever reaches Redis ─────────────────────────────────────────────────────────────


class Monitor:
    """`with Monitor(url) as m:` every command Redis executes meanwhile (MONITOR on a raw socket), as escaped text."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
        self._sock.sendall(b"MONITOR\r\n")
        self._url = url
        self._data = bytearray()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while chunk := self._sock.recv(65536):
                self._data += chunk

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> bytes:
        """Stop monitoring (idempotent); what was seen."""
        if self._thread.is_alive():
            # a marker after the last command: once MONITOR shows it, every command executed before it has arrived
            marker = f"forkq-monitor-end-{uuid.uuid4().hex}"
            with redis.Redis.from_url(self._url) as probe:
                probe.echo(marker)
            wait_until(lambda: marker.encode() in self._data, 10, "MONITOR to show the last commands")
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._thread.join(timeout=5)
        return bytes(self._data)


def secret_forms(secret: str) -> list[bytes]:
    """The secret as bytes, and every way it reads inside standard or URL-safe base64 (three alignments)."""
    raw = secret.encode()
    forms = [raw]
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw)
        start, end = -(-shift * 8 // 6), (shift + len(raw)) * 8 // 6  # the characters made of secret bits only
        forms += [encoded[start:end], encoded[start:end].replace(b"+", b"-").replace(b"/", b"_")]
    return forms


def leaks(data: bytes, secrets: list[str]) -> list[str]:
    """The secrets found in `data`, raw or base64-wrapped (kombu wraps job bodies in base64)."""
    return [s for s in secrets if any(form in data for form in secret_forms(s))]


def test_the_leak_detector_finds_a_secret_raw_or_inside_base64():
    for prefix in (b"", b"x", b"xy"):
        wrapped = base64.b64encode(prefix + b'{"key": "' + OPENAI_KEY.encode() + b'"}')
        assert leaks(b"body=" + wrapped, [OPENAI_KEY, GEMINI_KEY]) == [OPENAI_KEY]
    assert leaks(f"x {GEMINI_KEY} y".encode(), [OPENAI_KEY, GEMINI_KEY]) == [GEMINI_KEY]
    assert leaks(json.dumps({"k": "sk-e2e-openai-7f3a9c1d5"}).encode(), [OPENAI_KEY]) == []


READERS: dict[str, Callable[[redis.Redis, bytes], Any]] = {
    "string": lambda r, key: r.get(key),
    "hash": lambda r, key: r.hgetall(key),
    "list": lambda r, key: r.lrange(key, 0, -1),
    "set": lambda r, key: sorted(r.smembers(key)),
    "zset": lambda r, key: r.zrange(key, 0, -1, withscores=True),
    "stream": lambda r, key: r.xrange(key),
}


def dump_everything(url: str) -> dict[bytes, bytes]:
    """Every key of every database, with its whole value read by type (DUMP would LZF-compress strings)."""
    dumped: dict[bytes, bytes] = {}
    with redis.Redis.from_url(url) as server:
        databases = [int(name.removeprefix("db")) for name in server.info("keyspace")]
    for db in databases:
        with redis.Redis.from_url(url, db=db) as client:
            for key in client.scan_iter(count=1000):
                kind = client.type(key).decode()
                assert kind in READERS, f"key {key!r} has a type this scan does not read: {kind}"
                dumped[b"%d:%s" % (db, key)] = repr(READERS[kind](client, key)).encode()
    return dumped


def key_responder(kind: str) -> Callable[[Received], Reply]:
    """A fake model for concurrent forks: `fail` in the directive → an error echoing the key it was sent;
    else one directory listing, then an answer."""

    def respond(received: Received) -> Reply:
        if kind == "openai":
            sent_key = received.headers.get("authorization", "").removeprefix("Bearer ")
            if b"fail-this-fork" in received.raw:
                return Reply(503, error_body(f"Overloaded; key {sent_key} is throttled", code="server_error"))
            if openai_tool_messages(received):
                return Reply(body=completion({"content": "listed the project"}))
            return Reply(body=completion({"content": None, "tool_calls": [tool_call("c1", "list_directory", "{}")]}))
        sent_key = received.headers.get("x-goog-api-key", "")
        if b"fail-this-fork" in received.raw:
            return Reply(403, api_error(403, "PERMISSION_DENIED", f"API key {sent_key} lacks access to the model"))
        if gemini_function_responses(received):
            return Reply(body=generated([{"text": "listed the project"}]))
        return Reply(body=generated([{"functionCall": {"id": "c1", "name": "list_directory", "args": {}}}]))

    return respond


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_no_api_key_reaches_redis_or_the_worker_log(
    make_settings: Callable[..., Settings],
    worker_process: Callable[..., Any],
    redis_client: redis.Redis,
    make_parent: Callable[[str], dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given two worker processes: one keyed by FORKQ_*_API_KEY (with decoy fallback keys set, which must
    # lose), one by the fallback OPENAI_API_KEY / GEMINI_API_KEY; each on its own queue
    keys = {
        "forkq": {
            "FORKQ_OPENAI_API_KEY": "sk-forkq-openai-Q1w2E3r4",
            "FORKQ_GEMINI_API_KEY": "AIza-forkq-gem-T5y6U7i8",
        },
        "fallback": {"OPENAI_API_KEY": "sk-plain-openai-A9s8D7f6", "GEMINI_API_KEY": "AIza-plain-gem-G5h4J3k2"},
    }
    decoys = {"OPENAI_API_KEY": "sk-decoy-openai-Z0x9C8v7", "GEMINI_API_KEY": "AIza-decoy-gem-B6n5M4l3"}
    secrets = [*keys["forkq"].values(), *keys["fallback"].values(), *decoys.values()]
    for name in ("OPENAI_API_KEY", "GEMINI_API_KEY"):  # nothing from the shell that runs the tests
        monkeypatch.delenv(name, raising=False)
    with (
        Monitor(make_settings().redis_url) as monitor,
        FakeAPI(key_responder("openai")) as openai_api,
        FakeAPI(key_responder("gemini")) as gemini_api,
    ):
        common = {
            "FORKQ_PROVIDER_ROUTES": json.dumps({"gpt-*": "openai", "gemini-*": "gemini"}),
            "FORKQ_OPENAI_BASE_URL": f"{openai_api.url}/v1",
            "FORKQ_GEMINI_BASE_URL": f"{gemini_api.url}/",
            "FORKQ_PROVIDER_MAX_ATTEMPTS": "2",
            "FORKQ_PROVIDER_RETRY_BASE_S": "0.01",
        }
        workers = {
            "forkq": worker_process(concurrency=4, FORKQ_QUEUE="forks-a", **common, **keys["forkq"], **decoys),
            "fallback": worker_process(concurrency=4, FORKQ_QUEUE="forks-b", **common, **keys["fallback"]),
        }

        # When each worker runs a succeeding and a failing fork per provider
        handles: dict[tuple[str, str, str], ForkHandle] = {}
        with contextlib.ExitStack() as stack:
            for who, queue in (("forkq", "forks-a"), ("fallback", "forks-b")):
                settings = make_settings(queue=queue)
                app = make_app(settings)
                stack.callback(app.close)
                client = stack.enter_context(ForkClient(settings, app=app))
                for model in (OPENAI_MODEL, GEMINI_MODEL):
                    for outcome, prompt in (("ok", "List the project."), ("fail", "fail-this-fork: list the project.")):
                        handles[who, model, outcome] = client.launch(make_parent(model), {**FORK, "prompt": prompt})
            results = {name: wait_result(handle, timeout=45) for name, handle in handles.items()}
        for queue in ("forks-a", "forks-b"):
            wait_until(queue_drained(redis_client, queue), what=f"{queue} to drain")
        seen_by_redis = monitor.stop()

        # Then the forks ran as scripted, each worker sending the key its variables name
        for (who, model, outcome), result in results.items():
            expected = Status.SUCCEEDED if outcome == "ok" else Status.FAILED
            assert result.status is expected, (who, model, result.error, workers[who].log()[-2000:])
        failed = [r.error or "" for (_, _, outcome), r in results.items() if outcome == "fail"]
        assert all("***" in error for error in failed), failed  # the echoed key was recorded, scrubbed
        sent_openai = {r.headers["authorization"] for r in openai_api.received}
        sent_gemini = {r.headers["x-goog-api-key"] for r in gemini_api.received}
        assert sent_openai == {
            f"Bearer {keys[w]['FORKQ_OPENAI_API_KEY' if w == 'forkq' else 'OPENAI_API_KEY']}" for w in keys
        }
        assert sent_gemini == {keys["forkq"]["FORKQ_GEMINI_API_KEY"], keys["fallback"]["GEMINI_API_KEY"]}

    # and no key is in any Redis key or value (records, journals, events, state, kombu queues and bindings),
    # nor in any command Redis executed during the run
    stored = dump_everything(make_settings().redis_url)
    fork_keys = [k for k in stored if b":{f-" in k]
    assert len(fork_keys) >= 8 * 4, sorted(stored)  # bootstrap, state, result, events, journal... per fork
    assert any(b"_kombu.binding.forks-a" in k for k in stored), sorted(stored)  # the broker's keys are scanned too
    for key, value in stored.items():
        assert leaks(key + b"=" + value, secrets) == [], f"a key leaked into Redis key {key!r}"
    assert b"LPUSH" in seen_by_redis.upper() and b"EVALSHA" in seen_by_redis.upper()
    assert leaks(seen_by_redis, secrets) == [], "a key was sent to Redis in a command"

    # and no key is in either worker's log, which did record the failures
    for who, worker in workers.items():
        log = worker.log()
        assert leaks(log.encode(), secrets) == [], f"the {who} worker logged a key"
        assert "***" in log, f"the {who} worker's log lacks the (scrubbed) failure:\n{log[-2000:]}"

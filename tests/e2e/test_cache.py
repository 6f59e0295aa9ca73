"""Prompt-cache parity end to end, read off both adapters' wire through a live worker.

Every request of a fork starts with exactly the bytes of its previous request up to the new messages,
and its fixed parts (system instruction, declarations, output schema, cache key) go out byte-identical
at every step: forks whose steps hold thoughts with signatures and parallel calls, an output-schema
retry, a regular subagent, a completed-turn fork, and continuations sent to a fork that ended.
Sibling forks of one parent send one `prompt_cache_key` (the parent session) and first requests that
are byte-identical up to their directives. Cached tokens the provider reports reach the result, the
events, `forkq result --json`, the notification and the worker's metric.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.conftest import MARKER
from tests.e2e.test_providers import (
    FORK,
    SIG_1,
    SIG_2,
    assert_prompt_cache_parity,
    gemini_function_responses,
    model_of,
    openai_tool_messages,
    provider_settings,
    raw_first_item,
    raw_value,
    script_gemini_tool_run,
    script_openai_tool_run,
    text_answer,
    wait_result,
)
from tests.fakeapi import FakeAPI, Received
from tests.providers.test_gemini import generated
from tests.providers.test_openai_compat import completion, tool_call
from workers.app import runtime_of
from workers.client import ForkClient
from workers.records.fork import Status

KINDS = ["openai", "gemini"]
HISTORY = {"openai": "messages", "gemini": "contents"}
# the parts of a request that must be byte-identical at every step, where the first request has them
FIXED = {"openai": ("tools", "prompt_cache_key", "response_format", "model"), "gemini": ("systemInstruction", "tools")}
SCHEMA = {
    "type": "object",
    "properties": {"files": {"type": "array", "items": {"type": "string"}}},
    "required": ["files"],
    "additionalProperties": False,
}
CACHED = (0, 896, 1024)  # cached prompt tokens the fake model reports at each step


@pytest.fixture
def parent_of(make_parent: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """The example parent for a provider kind's model."""
    return lambda kind: make_parent(model_of(kind))


@pytest.fixture(autouse=True)
def _every_reply_is_consumed(apis: dict[str, FakeAPI]) -> Iterator[None]:
    """Every test queues exactly the replies its forks consume."""
    yield
    for kind, api in apis.items():
        assert not api.replies, f"the {kind} server has {len(api.replies)} unused replies"


# ── reading the wire ─────────────────────────────────────────────────────────────────────────


def fixed_parts(kind: str, first: Received) -> dict[str, Callable[[Received], str]]:
    """Extractors of the raw text of each fixed part the first request carries."""
    parts: dict[str, Callable[[Received], str]] = {}
    if kind == "openai":
        parts["system message"] = lambda r: raw_first_item(raw_value(r, "messages"))
    for key in FIXED[kind]:
        if key in first.json:
            parts[key] = functools.partial(raw_value, key=key)
    if kind == "gemini" and "generationConfig" in first.json:
        parts["generationConfig"] = functools.partial(raw_value, key="generationConfig")
    return parts


def assert_stable_prefix(kind: str, received: list[Received]) -> None:
    """Each request resends the fixed parts byte-identically and the previous request's history as a byte prefix."""
    assert len(received) >= 2
    assert_prompt_cache_parity(received, HISTORY[kind], fixed_parts(kind, received[0]))


def raw_items(array_text: str) -> list[str]:
    """The exact text of each element of a JSON array given as text."""
    decoder, items, at = json.JSONDecoder(), [], 1
    while True:
        at += len(array_text[at:]) - len(array_text[at:].lstrip(" \n,"))
        if array_text[at] == "]":
            return items
        _, end = decoder.raw_decode(array_text, at)
        items.append(array_text[at:end])
        at = end


def first_requests(api: FakeAPI, prompts: list[str]) -> dict[str, Received]:
    """The first request of each sibling, by the prompt its directive carries."""
    return {prompt: next(r for r in api.received if prompt.encode() in r.raw) for prompt in prompts}


# ── the fake models ──────────────────────────────────────────────────────────────────────────


def script_thinking_run(kind: str, api: FakeAPI) -> None:
    """Think and list; think, say something and read two files at once; think and quote (cached tokens rising)."""
    if kind == "openai":
        reason = "reasoning_content"
        ls = tool_call("call_ls", "list_directory", '{"path": "."}')
        api.reply(completion({"content": None, reason: "List first.", "tool_calls": [ls]}, "tool_calls", cached=0))
        reads = [tool_call("c_n", "read_file", '{"path": "notes.txt"}'), tool_call("c_a", "read_file", '{"path": "x"}')]
        api.reply(
            completion({"content": "Both.", reason: "Read both.", "tool_calls": reads}, "tool_calls", cached=CACHED[1])
        )
        api.reply(lambda r: completion({"content": openai_tool_messages(r)["c_n"], reason: "Quote."}, cached=CACHED[2]))
        return
    thought = {"text": "List first.", "thought": True, "thoughtSignature": SIG_1}
    ls = {"functionCall": {"id": "fc-ls", "name": "list_directory", "args": {"path": "."}}}
    api.reply(generated([thought, ls], usage=(1000, 11, 5)))
    reads = [
        {"text": "Read both.", "thought": True},
        {"text": "Both."},
        {"functionCall": {"id": "fc-n", "name": "read_file", "args": {"path": "notes.txt"}}, "thoughtSignature": SIG_2},
        {"functionCall": {"id": "fc-a", "name": "read_file", "args": {"path": "x"}}},
    ]
    api.reply(generated(reads, usage=(1100, 22, 7), cached=CACHED[1]))

    def quote(received: Received) -> dict[str, Any]:
        notes = next(f["response"]["output"] for f in gemini_function_responses(received) if f["id"] == "fc-n")
        return generated([{"text": "Quote.", "thought": True}, {"text": notes}], usage=(1300, 33, 0), cached=CACHED[2])

    api.reply(quote)


def list_call(kind: str) -> dict[str, Any]:
    if kind == "openai":
        return completion({"content": None, "tool_calls": [tool_call("c-ls", "list_directory", "{}")]}, "tool_calls")
    return generated([{"functionCall": {"id": "c-ls", "name": "list_directory", "args": {}}}])


def script_schema_retry(kind: str, api: FakeAPI) -> None:
    """List, answer in prose (sent back for failing the schema), then answer in JSON."""
    api.reply(list_call(kind))
    api.reply(text_answer(kind, "notes.txt and src/"))
    api.reply(text_answer(kind, '{"files": ["notes.txt", "src/"]}'))


def script_tool_run(kind: str, api: FakeAPI) -> None:
    (script_openai_tool_run if kind == "openai" else script_gemini_tool_run)(api)


# ── one fork's requests extend each other ───────────────────────────────────────────────────


@pytest.mark.parametrize("kind", KINDS)
def test_a_fork_with_thoughts_signatures_and_parallel_calls_resends_every_byte_it_sent_before(
    kind: str,
    forkq: Callable[..., ForkClient],
    apis: dict[str, FakeAPI],
    parent_of: Callable[[str], dict[str, Any]],
    forkq_cli: Callable[..., tuple[int, str, str]],
) -> None:
    # Given a model that thinks at every step (Gemini: with thought signatures), calls two tools at once,
    # and reports more cached prompt tokens at each step
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    script_thinking_run(kind, api)
    parent = parent_of(kind)

    # When the parent forks
    handle = client.launch(parent, FORK)
    result = wait_result(handle)

    # Then each of the three requests starts with every byte of the one before it
    assert result.status is Status.SUCCEEDED, result.error
    assert result.output == MARKER + "\n"
    assert len(api.received) == 3
    assert_stable_prefix(kind, api.received)
    if kind == "openai":  # the cache key is the parent session, sent alike at every step
        assert {r.json["prompt_cache_key"] for r in api.received} == {parent["session_id"]}
    else:  # the thoughts went back with their signatures, the next step's bytes extending them
        assert '"thoughtSignature"' in raw_value(api.received[2], "contents")

    # and the cached tokens reached the result, each step's event, `forkq result --json`, the notification
    # and the worker's counter
    assert result.usage.cached_input_tokens == sum(CACHED)
    steps = [e.wire_data() for e in client.events(handle.fork_id) if e.type == "step"]
    assert [s["cached_input_tokens"] for s in steps] == list(CACHED)
    code, out, _ = forkq_cli("result", handle.fork_id, "--json")
    assert code == 0 and json.loads(out)["usage"]["cached_input_tokens"] == sum(CACHED)
    notification = client.notification(handle.fork_id)
    assert notification is not None and f"<cached_input_tokens>{sum(CACHED)}</cached_input_tokens>" in notification
    registry = runtime_of(client.app).metrics.registry
    assert registry.get_sample_value("forkq_cached_input_tokens_total") == sum(CACHED)


CASES: dict[str, tuple[Callable[[str, FakeAPI], None], dict[str, Any], dict[str, Any]]] = {
    # name: (the fake model, the Agent call's parameters, launch options)
    "output-schema retry": (script_schema_retry, FORK, {"output_schema": SCHEMA}),
    "regular subagent": (script_tool_run, {**FORK, "subagent_type": "general-purpose"}, {}),
    "completed-turn fork": (script_tool_run, FORK, {"seed_mode": "completed_turns"}),
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_child_resends_every_byte_it_sent_before(
    kind: str,
    forkq: Callable[..., ForkClient],
    apis: dict[str, FakeAPI],
    parent_of: Callable[[str], dict[str, Any]],
) -> None:
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    parent = parent_of(kind)
    for case, (script, params, options) in CASES.items():
        # Given a three-step model run for this kind of child
        script(kind, api)
        before = len(api.received)

        # When the child runs
        handle = client.launch(parent, params, **options)
        result = wait_result(handle)

        # Then every request starts with the bytes of the one before, fixed parts included
        assert result.status is Status.SUCCEEDED, (case, result.error)
        sent = api.received[before:]
        assert len(sent) == 3, case
        assert_stable_prefix(kind, sent)
        assert handle.kind == ("spawn" if case == "regular subagent" else "fork"), case
        if kind == "openai":
            assert {r.json["prompt_cache_key"] for r in sent} == {parent["session_id"]}, case


def answer(kind: str, text: str, cached: int) -> dict[str, Any]:
    if kind == "openai":
        return completion({"content": text}, cached=cached)
    return generated([{"text": text}], cached=cached)


def read_app(kind: str) -> dict[str, Any]:
    if kind == "openai":
        call = tool_call("c-app", "read_file", '{"path": "src/app.py"}')
        return completion({"content": None, "tool_calls": [call]}, "tool_calls", cached=CACHED[1])
    call = {"functionCall": {"id": "c-app", "name": "read_file", "args": {"path": "src/app.py"}}}
    return generated([call], cached=CACHED[1])


@pytest.mark.parametrize("kind", KINDS)
def test_continuations_sent_to_a_fork_extend_its_last_request_byte_for_byte(
    kind: str,
    forkq: Callable[..., ForkClient],
    apis: dict[str, FakeAPI],
    parent_of: Callable[[str], dict[str, Any]],
) -> None:
    # Given a fork that listed, read and answered
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    script_tool_run(kind, api)
    handle = client.launch(parent_of(kind), FORK)
    assert wait_result(handle).status is Status.SUCCEEDED

    # When it is continued twice through `send`: once with a tool round, once with a plain answer
    api.reply(read_app(kind)).reply(answer(kind, "src/app.py defines main().", CACHED[2]))
    client.send(handle.fork_id, "Now read src/app.py and say what it defines.")
    first = wait_result(handle)
    api.reply(answer(kind, "It returns 42.", CACHED[2]))
    client.send(handle.fork_id, "What does main() return?")
    second = wait_result(handle)

    # Then each continuation's requests start with every byte of the fork's requests before them:
    # its final answer, then the new turn
    assert (first.output, second.output) == ("src/app.py defines main().", "It returns 42.")
    assert len(api.received) == 6
    assert_stable_prefix(kind, api.received)
    last = api.received[-1].json[HISTORY[kind]][-2:]
    if kind == "openai":
        assert last == [
            {"role": "assistant", "content": "src/app.py defines main()."},
            {"role": "user", "content": "What does main() return?"},
        ]
    else:
        assert [c["role"] for c in last] == ["model", "user"]
    # and cached tokens count per exchange and for the whole conversation
    assert first.run_usage is not None and first.run_usage.cached_input_tokens == CACHED[1] + CACHED[2]
    assert second.run_usage is not None and second.run_usage.cached_input_tokens == CACHED[2]
    assert second.usage.cached_input_tokens == sum(CACHED[1:]) + CACHED[2]


# ── siblings share the parent's cache ────────────────────────────────────────────────────────


@pytest.mark.parametrize("kind", KINDS)
def test_sibling_forks_send_one_cache_key_and_first_requests_identical_up_to_their_directives(
    kind: str,
    forkq: Callable[..., ForkClient],
    apis: dict[str, FakeAPI],
    parent_of: Callable[[str], dict[str, Any]],
) -> None:
    # Given a worker and a parent
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    api.reply(text_answer(kind, "done")).reply(text_answer(kind, "done"))
    parent = parent_of(kind)
    prompts = ["Audit the limiter for races.", "Write the expiry tests."]

    # When it launches two sibling forks
    handles = [client.launch(parent, {**FORK, "prompt": prompt}) for prompt in prompts]
    assert [wait_result(h).status for h in handles] == [Status.SUCCEEDED] * 2

    # Then their first requests are byte-identical up to the Content that holds each one's directive
    first = first_requests(api, prompts)
    a, b = (raw_items(raw_value(first[p], HISTORY[kind])) for p in prompts)
    differ = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    assert prompts[0] in json.dumps(json.loads(a[differ]), ensure_ascii=False)
    assert differ >= len(a) - 3  # the directive's Content, the ack, "Begin."
    for key in fixed_parts(kind, first[prompts[0]]):
        extract = fixed_parts(kind, first[prompts[0]])[key]
        assert extract(first[prompts[0]]) == extract(first[prompts[1]]), key
    if kind == "openai":  # and one cache key: the parent's session
        assert [first[p].json["prompt_cache_key"] for p in prompts] == [parent["session_id"]] * 2


def test_with_forkq_prompt_cache_key_off_no_request_carries_a_key(
    forkq: Callable[..., ForkClient],
    openai_api: FakeAPI,
    parent_of: Callable[[str], dict[str, Any]],
) -> None:
    # Given a worker told not to send the key (a server that refuses unknown parameters)
    client = forkq(**provider_settings("openai", openai_api), prompt_cache_key=False)
    script_openai_tool_run(openai_api)

    # When a fork runs three steps
    result = wait_result(client.launch(parent_of("openai"), FORK))

    # Then no request carried one, and the requests still extend each other
    assert result.status is Status.SUCCEEDED, result.error
    assert ["prompt_cache_key" in r.json for r in openai_api.received] == [False] * 3
    assert_stable_prefix("openai", openai_api.received)


def test_raw_items_reads_each_element_of_an_array_exactly() -> None:
    assert raw_items('[ {"a": [1, 2]},\n "x" ,3]') == ['{"a": [1, 2]}', '"x"', "3"]
    assert raw_items("[]") == []

"""Subagents end to end through a live worker and both model adapters, read off the wire.

A defined subagent's first request carries its persona and exactly its tools; a completed-turn fork's
carries the parent's completed turns and nothing of the in-flight one; a tool filter is refused at
execution; a first-turn completed-turn fork sends only the directive. The local servers speak the
OpenAI Chat Completions and Gemini `generateContent` wire formats (tests/fakeapi.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import MARKER
from tests.e2e.test_providers import (
    model_of,
    provider_settings,
    script_gemini_tool_run,
    script_openai_tool_run,
)
from tests.fakeapi import FakeAPI, Received
from tests.providers.test_gemini import generated
from tests.providers.test_openai_compat import completion, tool_call
from workers.client import ForkClient
from workers.history.messages import Content, load_contents
from workers.history.selection import is_real_user_turn
from workers.records.fork import Status

KINDS = ["openai", "gemini"]
READER = """---
name: note-reader
description: Reads notes.
tools: [list_directory, read_file]
---
You read notes and quote them exactly.
"""
FORK = {"description": "go on", "prompt": "Summarise what we found so far.", "subagent_type": "fork"}


@pytest.fixture
def agents_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "agents"
    folder.mkdir()
    (folder / "note-reader.md").write_text(READER, encoding="utf-8")
    return folder


def system_prompt(kind: str, received: Received) -> str:
    if kind == "openai":
        [system] = [m for m in received.json["messages"] if m["role"] == "system"]
        return str(system["content"])
    return "".join(p["text"] for p in received.json["systemInstruction"]["parts"])


def tool_names(kind: str, received: Received) -> list[str]:
    if kind == "openai":
        return [t["function"]["name"] for t in received.json.get("tools", [])]
    return [d["name"] for t in received.json.get("tools", []) for d in t.get("functionDeclarations", [])]


def strings_in(value: Any) -> list[str]:
    """Every string inside a JSON value (the texts a request carries, however the SDK escaped them)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return []


def calls_of(content: Content) -> list[Any]:
    return [p.function_call for p in content.parts if p.function_call is not None]


def answer(kind: str, api: FakeAPI, text: str) -> None:
    api.reply(completion({"content": text}) if kind == "openai" else generated([{"text": text}]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_defined_subagents_requests_carry_its_persona_and_exactly_its_tools(
    kind: str,
    apis: dict[str, FakeAPI],
    forkq: Callable[..., ForkClient],
    make_parent: Callable[[str], dict[str, Any]],
    agents_dir: Path,
) -> None:
    # Given a definition in FORKQ_AGENTS_DIR with two tools, and a model that lists, reads and quotes
    api = apis[kind]
    client = forkq(**provider_settings(kind, api), agents_dir=agents_dir)
    (script_openai_tool_run if kind == "openai" else script_gemini_tool_run)(api)
    parent = make_parent(model_of(kind))

    # When the parent launches that subagent type
    handle = client.launch(
        parent, {"description": "read notes", "prompt": "Quote notes.txt.", "subagent_type": "note-reader"}
    )
    result = handle.wait(timeout=20)

    # Then it ran the tools it has, and every request carried the persona and exactly those tools
    assert result.status is Status.SUCCEEDED and MARKER in (result.output or "")
    assert len(api.received) == 3
    for received in api.received:
        assert system_prompt(kind, received) == "You read notes and quote them exactly."
        assert tool_names(kind, received) == ["read_file", "list_directory"]  # in the parent's order
    assert parent["system_instruction"] not in received.raw.decode("utf-8")


@pytest.mark.parametrize("kind", KINDS)
def test_a_completed_turn_forks_request_carries_the_completed_turns_and_not_the_in_flight_one(
    kind: str,
    apis: dict[str, FakeAPI],
    forkq: Callable[..., ForkClient],
    make_parent: Callable[[str], dict[str, Any]],
) -> None:
    # Given a parent whose current turn (a prompt, a tool call, then two Agent calls) is still open
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    answer(kind, api, "Summary: rate limiting, the redirect fix and the migration review are done.")
    parent = make_parent(model_of(kind))
    history = load_contents(parent["history"])
    in_flight = max(i for i, c in enumerate(history) if is_real_user_turn(c))
    last_done = max(i for i, c in enumerate(history[:in_flight]) if c.role == "model" and not calls_of(c))
    in_flight_prompt = next(p.text for p in history[in_flight].parts if p.text)
    completed_answer = next(p.text for p in history[last_done].parts if p.text and not p.thought)

    # When it launches a completed-turn fork
    handle = client.launch(parent, FORK, seed_mode="completed_turns")
    result = handle.wait(timeout=20)

    # Then the model saw every completed turn, the directive last, and nothing of the in-flight turn
    assert result.status is Status.SUCCEEDED
    [received] = api.received
    body = received.raw.decode("utf-8")
    texts = strings_in(received.json)
    assert any(completed_answer in text for text in texts)
    assert not any(in_flight_prompt[:60] in text for text in texts)
    for call in calls_of(history[-1]):  # the launching Agent calls and their siblings
        assert f'"{call.id}"' not in body
    assert "Agent" not in tool_names(kind, received)  # a fork cannot spawn
    assert system_prompt(kind, received) == parent["system_instruction"]  # general-purpose's: the parent's
    assert any(FORK["prompt"] in text for text in texts)


def test_a_first_turn_completed_turn_fork_sends_only_the_directive(
    openai_api: FakeAPI,
    forkq: Callable[..., ForkClient],
    make_parent: Callable[[str], dict[str, Any]],
) -> None:
    # Given a parent in its first turn: its prompt, then the Agent call
    client = forkq(**provider_settings("openai", openai_api))
    answer("openai", openai_api, "done")
    parent = make_parent(model_of("openai"))
    call = {"functionCall": {"id": "call_a", "name": "Agent", "args": FORK}}
    parent["history"] = [{"role": "user", "parts": [{"text": "Please fork."}]}, {"role": "model", "parts": [call]}]

    # When it launches a completed-turn fork
    client.launch(parent, FORK, seed_mode="completed_turns").wait(timeout=20)

    # Then the request is a fresh spawn's: the system prompt and the directive alone, no fork boilerplate
    [received] = openai_api.received
    messages = [m for m in received.json["messages"] if m["role"] != "system"]
    assert messages == [{"role": "user", "content": FORK["prompt"]}]


def test_a_tool_outside_the_launch_tool_filter_is_refused_at_execution(
    openai_api: FakeAPI,
    forkq: Callable[..., ForkClient],
    make_parent: Callable[[str], dict[str, Any]],
) -> None:
    # Given a subagent launched with tool_filter [read_file], and a model that calls list_directory anyway
    client = forkq(**provider_settings("openai", openai_api))
    listing = tool_call("call_ls", "list_directory", '{"path": "."}')
    openai_api.reply(completion({"content": None, "tool_calls": [listing]}, finish_reason="tool_calls"))
    answer("openai", openai_api, "I could not list it.")
    params = {"description": "d", "prompt": "List the directory.", "subagent_type": "general-purpose"}

    # When it runs
    result = client.launch(make_parent(model_of("openai")), params, tool_filter=["read_file"]).wait(timeout=20)

    # Then only read_file was declared, and the call was answered with an error, not run
    assert result.status is Status.SUCCEEDED and result.usage.tool_uses <= 1
    first, second = openai_api.received
    assert tool_names("openai", first) == ["read_file"]
    [reply] = [m for m in second.json["messages"] if m["role"] == "tool"]
    assert "is not one of this fork's tools" in reply["content"] and "was not run" in reply["content"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_launch_persona_and_tool_filter_reach_the_wire_of_a_completed_turn_fork(
    kind: str,
    apis: dict[str, FakeAPI],
    forkq: Callable[..., ForkClient],
    make_parent: Callable[[str], dict[str, Any]],
) -> None:
    # Given a completed-turn fork launched with a persona and two tools
    api = apis[kind]
    client = forkq(**provider_settings(kind, api))
    answer(kind, api, "done")
    persona = "You are the release-notes writer. Answer in one paragraph."

    # When it runs
    handle = client.launch(
        make_parent(model_of(kind)),
        FORK,
        seed_mode="completed_turns",
        persona=persona,
        tool_filter=["glob", "read_file"],
    )
    assert handle.wait(timeout=20).status is Status.SUCCEEDED

    # Then its request carried the persona as the system prompt and exactly those tools, in the parent's order
    [received] = api.received
    assert system_prompt(kind, received) == persona
    assert tool_names(kind, received) == ["read_file", "glob"]

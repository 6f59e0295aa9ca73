"""Conversations with forks, end to end through a live worker and the OpenAI-compatible wire format.

`send` continues a succeeded fork (its next request is its whole conversation plus the message), reaches a
running fork before its next model call (never inside a tool round), waits in a parked fork's inbox until
it resumes, and is refused for a fork that failed or was cancelled. Named teammates are unique per parent
session while they live, and reachable by name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.e2e.test_providers import (
    model_of,
    provider_settings,
    raw_value,
)
from tests.fakeapi import FakeAPI, Received
from tests.live import wait_until
from tests.providers.test_openai_compat import completion, tool_call
from workers.base.limits import MAX_INBOX_MESSAGES, MAX_MESSAGE_BYTES
from workers.client import ForkClient
from workers.errors import ForkNotFound, InvalidAgentParams, MessageRefused
from workers.records.fork import Status

FORK = {"description": "summarise", "prompt": "Summarise notes.txt.", "subagent_type": "fork", "fork_turns": "1"}
Client = Callable[..., ForkClient]
Parent = Callable[[str], dict[str, Any]]


def answer(api: FakeAPI, text: str, *, delay_s: float = 0.0) -> None:
    api.reply(completion({"content": text}), delay_s=delay_s)


def chat(received: Received) -> list[tuple[str, str]]:
    """(role, text) of every message after the system prompt; a tool message's text is its content."""
    out = []
    for message in received.json["messages"][1:]:
        content = message.get("content")
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content or [])
        if message.get("tool_calls"):
            text = "calls " + ",".join(c["function"]["name"] for c in message["tool_calls"])
        out.append((message["role"], text))
    return out


def test_a_succeeded_fork_is_continued_with_its_whole_conversation_and_the_message(
    openai_api: FakeAPI,
    forkq: Client,
    make_parent: Parent,
) -> None:
    # Given a fork that answered once
    client = forkq(**provider_settings("openai", openai_api))
    answer(openai_api, "The notes name the codename.")
    handle = client.launch(make_parent(model_of("openai")), FORK)
    assert handle.wait(timeout=20).output == "The notes name the codename."

    # When the parent sends it a follow-up
    answer(openai_api, "It is PERIWINKLE-7731.")
    sent = client.send(handle.fork_id, "Which codename exactly?")
    result = handle.wait(timeout=20)

    # Then it was queued again and answered from its whole conversation, the message last
    assert sent.outcome == "continued"
    assert result.status is Status.SUCCEEDED and result.output == "It is PERIWINKLE-7731."
    first, second = openai_api.received
    assert chat(second)[-2:] == [("assistant", "The notes name the codename."), ("user", "Which codename exactly?")]
    # the continuation's request starts with the bytes of the previous one (prompt-cache parity)
    before = raw_value(first, "messages").rstrip()[:-1]
    assert raw_value(second, "messages").startswith(before)
    # usage accumulates; the last run's own is reported too; the notification and inspect give the newest
    assert result.usage.model_calls == 2 and result.run_usage is not None and result.run_usage.model_calls == 1
    assert "It is PERIWINKLE-7731." in client.notification(handle.fork_id)
    exchanges = client.inspect(handle.fork_id)["exchanges"]
    assert [(e["message"], e["answer"]) for e in exchanges] == [
        (FORK["prompt"], "The notes name the codename."),
        ("Which codename exactly?", "It is PERIWINKLE-7731."),
    ]


def test_a_message_to_a_running_fork_arrives_before_its_next_model_call_never_inside_a_tool_round(
    openai_api: FakeAPI,
    forkq: Client,
    make_parent: Parent,
) -> None:
    # Given a fork whose first model call (slow) asks for a tool
    client = forkq(**provider_settings("openai", openai_api))
    listing = tool_call("call_ls", "list_directory", '{"path": "."}')
    openai_api.reply(completion({"content": None, "tool_calls": [listing]}, finish_reason="tool_calls"), delay_s=1.5)
    answer(openai_api, "Listed it, and noted the message.")
    handle = client.launch(make_parent(model_of("openai")), FORK)

    # When a message is sent while that model call runs
    wait_until(lambda: len(openai_api.received) == 1, 10, "the first model call")
    sent = client.send(handle.fork_id, "Also check the tests folder.")
    result = handle.wait(timeout=20)

    # Then the tool round completed first, and the message came right before the next model call
    assert sent.outcome == "queued" and result.status is Status.SUCCEEDED
    _, second = openai_api.received
    assert [role for role, _ in chat(second)[-3:]] == ["assistant", "tool", "user"]
    assert chat(second)[-1] == ("user", "Also check the tests folder.")


def test_a_message_sent_during_the_final_model_call_continues_the_fork(
    openai_api: FakeAPI,
    forkq: Client,
    make_parent: Parent,
) -> None:
    # Given a fork whose only model call (slow) gives its final answer
    client = forkq(**provider_settings("openai", openai_api))
    answer(openai_api, "First answer.", delay_s=1.5)
    answer(openai_api, "Second answer.")
    handle = client.launch(make_parent(model_of("openai")), FORK)

    # When a message arrives while it answers
    wait_until(lambda: len(openai_api.received) == 1, 10, "the model call")
    client.send(handle.fork_id, "One more thing.")

    # Then the fork did not end on its first answer: it answered the message too
    result = handle.wait(timeout=20)
    assert result.output == "Second answer."
    assert chat(openai_api.received[1])[-2:] == [("assistant", "First answer."), ("user", "One more thing.")]


def test_a_parked_forks_message_waits_until_it_resumes(
    openai_api: FakeAPI,
    forkq: Client,
    make_parent: Parent,
) -> None:
    # Given a fork parked on a file write that needs approval
    client = forkq(**provider_settings("openai", openai_api))
    write = tool_call("call_w", "write_file", '{"path": "out.txt", "content": "x"}')
    openai_api.reply(completion({"content": None, "tool_calls": [write]}, finish_reason="tool_calls"))
    answer(openai_api, "Wrote it.")
    handle = client.launch(make_parent(model_of("openai")), FORK, approval_policy="park")
    wait_until(lambda: client.status(handle.fork_id).status is Status.AWAITING_APPROVAL, 20, "the park")

    # When a message is sent to it, and then the call is approved
    sent = client.send(handle.fork_id, "Use UTF-8.")
    assert sent.outcome == "queued" and len(openai_api.received) == 1
    client.approve(handle.fork_id, "call_w")
    result = handle.wait(timeout=20)

    # Then the message reached the model after the approved call's result
    assert result.status is Status.SUCCEEDED
    assert chat(openai_api.received[1])[-2:] == [("tool", chat(openai_api.received[1])[-2][1]), ("user", "Use UTF-8.")]


def test_a_cancelled_or_failed_fork_refuses_a_message_and_nothing_is_written(
    forkq: Client,
    openai_api: FakeAPI,
    make_parent: Parent,
) -> None:
    client = forkq(**provider_settings("openai", openai_api))
    openai_api.reply({"error": {"message": "bad request", "type": "invalid_request_error"}}, status=400)
    failed = client.launch(make_parent(model_of("openai")), FORK)
    assert failed.wait(timeout=20).status is Status.FAILED
    parked = client.launch(make_parent(model_of("openai")), FORK, approval_policy="park")
    client.cancel(parked.fork_id)
    for handle, status in ((failed, "failed"), (parked, "cancelled")):
        with pytest.raises(MessageRefused, match=f"fork {handle.fork_id} {status}, so it takes no more") as caught:
            client.send(handle.fork_id, "hello?")
        assert caught.value.status == status
        assert client.redis.llen(client.store.keys.inbox(handle.fork_id)) == 0
    with pytest.raises(ForkNotFound):
        client.send("f-missing", "hello?")


@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "the message is empty"), ("  \n", "the message is empty"), ("x" * (MAX_MESSAGE_BYTES + 1), "bytes, more")],
)
def test_an_empty_or_oversized_message_is_refused(client: ForkClient, parent: dict, text: str, problem: str) -> None:
    handle = client.launch(parent, FORK)
    with pytest.raises(MessageRefused, match=problem):
        client.send(handle.fork_id, text)
    assert client.redis.llen(client.store.keys.inbox(handle.fork_id)) == 0


def test_a_full_inbox_refuses_the_next_message(client: ForkClient, parent: dict) -> None:
    handle = client.launch(parent, FORK)  # queued: no worker takes it
    for i in range(MAX_INBOX_MESSAGES):
        assert client.send(handle.fork_id, f"message {i}").waiting == i + 1
    with pytest.raises(MessageRefused, match=f"already holds {MAX_INBOX_MESSAGES} messages"):
        client.send(handle.fork_id, "one too many")


def test_a_teammate_name_is_unique_in_its_session_while_it_lives_and_reachable_by_name(
    client: ForkClient, parent: dict
) -> None:
    teammate = {"description": "review", "prompt": "Review the diff.", "name": "ann"}
    first = client.launch(parent, teammate)
    with pytest.raises(InvalidAgentParams, match=f"taken in session {parent['session_id']} by fork {first.fork_id}"):
        client.launch(parent, teammate)
    other_session = client.launch({**parent, "session_id": "another-session"}, teammate)  # another session: free

    sent = client.send_to(parent["session_id"], "ann", "Look at the tests too.")
    assert sent.fork_id == first.fork_id and sent.outcome == "queued"
    with pytest.raises(ForkNotFound, match="has no teammate named 'bob'"):
        client.send_to(parent["session_id"], "bob", "hello")

    client.cancel(first.fork_id)  # ended: the name is free again
    second = client.launch(parent, teammate)
    assert client.send_to(parent["session_id"], "ann", "hi").fork_id == second.fork_id
    assert other_session.fork_id not in (first.fork_id, second.fork_id)


def test_racing_launches_of_one_teammate_name_give_it_to_exactly_one(client: ForkClient, parent: dict) -> None:
    teammate = {"description": "review", "prompt": "Review the diff.", "name": "racer"}
    outcomes: list[str] = []

    def launch() -> None:
        try:
            outcomes.append(client.launch(parent, teammate).fork_id)
        except InvalidAgentParams:
            outcomes.append("refused")

    threads = [threading.Thread(target=launch) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("refused") == 7
    [winner] = [o for o in outcomes if o != "refused"]
    assert client.store.teammate(parent["session_id"], "racer") == winner


def redis_ms(client: redis.Redis) -> int:
    """Redis's clock in ms, the one the store's scripts use."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_sessions_forks_are_listed_newest_first_with_kind_name_and_status(
    client: ForkClient, parent: dict, forkq_env: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers.cli import main

    fork = client.launch(parent, FORK)
    # the index orders by launch time in ms (Redis's clock): the next launch comes a millisecond later at least
    launched_ms = client.redis.zscore(client.store.keys.session_forks(parent["session_id"]), fork.fork_id)
    wait_until(lambda: redis_ms(client.redis) > launched_ms, 5, "the next millisecond of Redis time")
    teammate = client.launch(parent, {"description": "review the diff", "prompt": "Review.", "name": "ann"})
    client.cancel(fork.fork_id)
    listed = client.list(parent["session_id"])
    assert [(f["fork_id"], f["kind"], f["name"], f["status"]) for f in listed] == [
        (teammate.fork_id, "spawn", "ann", "queued"),
        (fork.fork_id, "fork", None, "cancelled"),
    ]
    assert listed[0]["description"] == "review the diff" and listed[0]["created_ms"] <= listed[0]["updated_ms"]
    assert client.list("no-such-session") == []

    capsys.readouterr()
    assert main(["list", "--session", parent["session_id"]]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"{teammate.fork_id} spawn ann queued: review the diff",
        f"{fork.fork_id} fork cancelled: {FORK['description']}",
    ]

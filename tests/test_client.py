"""ForkClient against a private Redis and live workers: launch, run, result, records, storage, cancel, events."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
import time
from typing import Any

import pytest
import redis
from celery.worker import WorkController

from tests.live import MILESTONES, wait_until
from workers.base import codec
from workers.client import ForkClient, ForkHandle
from workers.errors import (
    ForkNotEnded,
    ForkNotFound,
    ForkNotPaused,
    ForkParked,
    ForkTimeout,
    InvalidAgentParams,
    InvalidApproval,
    InvalidParentSnapshot,
    RecordExistsError,
    RecordIntegrityError,
)
from workers.history.params import (
    MSG_FORK_TURNS_NOT_FORK,
    MSG_FORK_TURNS_TEAMMATE,
    MSG_FORK_TURNS_VALUE,
    MSG_MODEL_FORK,
    AgentParams,
    validate_agent_params,
)
from workers.history.selection import build_fork_seed
from workers.history.snapshot import parse_parent_snapshot
from workers.records.fork import Status, split_seed
from workers.records.notification import render_task_notification
from workers.records.parked import ParkedCall
from workers.store.lease import Claim, Leases

FORK = {"description": "write expiry tests", "prompt": "Write the expiry tests.", "subagent_type": "fork"}


def stored_digest(redis_client: redis.Redis, client: ForkClient, fork_id: str) -> str:
    """BLAKE2b-256 of the bootstrap record's bytes as Redis holds them."""
    data = redis_client.get(client.store.keys.bootstrap(fork_id))
    assert isinstance(data, bytes)
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def nothing_reached_redis(redis_client: redis.Redis, queue: str) -> bool:
    return redis_client.dbsize() == 0 and redis_client.llen(queue) == 0


# ── launch → run → result ─────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("fork_turns", ["all", "1", "3", None])
def test_a_fork_runs_to_its_result_from_the_record_build_fork_seed_made(
    fork_turns: str | None,
    client: ForkClient,
    live_worker: WorkController,
    redis_client: redis.Redis,
    parent: dict[str, Any],
) -> None:
    params = FORK if fork_turns is None else {**FORK, "fork_turns": fork_turns}
    handle = client.launch(parent, params)
    result = handle.wait(timeout=15)

    seed = build_fork_seed(parse_parent_snapshot(parent).history, fork_turns=fork_turns, directive=FORK["prompt"])
    record = client.inspect(handle.fork_id)
    assert result.status is Status.SUCCEEDED, result.error
    output = result.output or ""
    assert f"received {len(seed.initial_messages) + 1} messages" in output
    assert f"{len(parent['tools'])} tools); directive: {FORK['prompt']}" in output
    assert record["initial_messages"] == seed.to_wire()["initial_messages"]
    assert record["task_prompt"] == seed.task_prompt
    assert (record["kind"], record["fork_turns"], record["directive"]) == ("fork", fork_turns, FORK["prompt"])
    assert (record["model"], record["cwd"], record["depth"]) == (parent["model"], parent["cwd"], parent["depth"] + 1)
    assert (record["system_instruction"], record["tools"]) == (parent["system_instruction"], parent["tools"])
    assert record["approval_mode"] == parent["approval_mode"]
    assert record["digest"] == handle.digest == stored_digest(redis_client, client, handle.fork_id)
    assert result.usage.model_calls == 1
    assert handle.status().status is Status.SUCCEEDED


@pytest.mark.parametrize(
    "params",
    [
        {"description": "review", "prompt": "Review the diff.", "subagent_type": "general-purpose", "model": "m-2"},
        {"description": "review", "prompt": "Review the diff.", "subagent_type": "fork", "name": "reviewer"},
        {"description": "review", "prompt": "Review the diff.", "name": "reviewer"},
        {"description": "review", "prompt": "Review the diff."},
    ],
    ids=["regular-subagent", "teammate-of-fork-type", "teammate", "no-type"],
)
def test_a_regular_subagent_or_named_teammate_runs_from_an_empty_seed(
    params: dict[str, Any],
    client: ForkClient,
    live_worker: WorkController,
    redis_client: redis.Redis,
    parent: dict[str, Any],
) -> None:
    handle = client.launch(parent, params)
    result = handle.wait(timeout=15)

    record = client.inspect(handle.fork_id)
    assert result.status is Status.SUCCEEDED, result.error
    assert "received 1 messages" in (result.output or "")
    assert (handle.kind, record["kind"]) == ("spawn", "spawn")
    assert record["initial_messages"] == []
    assert record["task_prompt"] == params["prompt"]
    assert record["model"] == params.get("model", parent["model"])
    assert record["digest"] == stored_digest(redis_client, client, handle.fork_id)
    # no history chunk: the one chunk is the parent's context (system instruction and tools), by digest
    (context_key,) = redis_client.keys("*:chunk:*")
    assert codec.decode(redis_client.get(context_key))["tools_json"] == json.dumps(
        parent["tools"], separators=(",", ":")
    )


# ── nothing reaches Redis for an invalid launch ──────────────────────────────────────────────


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({**FORK, "fork_turns": "0"}, MSG_FORK_TURNS_VALUE),
        ({**FORK, "fork_turns": 3}, MSG_FORK_TURNS_VALUE),
        ({**FORK, "fork_turns": None}, MSG_FORK_TURNS_VALUE),
        ({**FORK, "subagent_type": "general-purpose", "fork_turns": "3"}, MSG_FORK_TURNS_NOT_FORK),
        ({**FORK, "name": "reviewer", "fork_turns": "3"}, MSG_FORK_TURNS_TEAMMATE),
        ({**FORK, "model": "other-model"}, MSG_MODEL_FORK),
        ({**FORK, "prompt": "  "}, 'Parameter "prompt" is required'),
        ({"prompt": "x", "subagent_type": "fork"}, 'Parameter "description" is required'),
        ({**FORK, "colour": "blue"}, 'Unknown parameter "colour"'),
    ],
    ids=["zero", "int", "null", "not-fork", "teammate", "model", "blank-prompt", "no-description", "unknown"],
)
def test_invalid_parameters_are_rejected_before_anything_reaches_redis(
    params: dict[str, Any], message: str, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        client.launch(parent, params)

    assert message in str(caught.value)
    assert nothing_reached_redis(redis_client, client.settings.queue)


def _bad_history(parent: dict[str, Any]) -> dict[str, Any]:
    parent["history"][3] = {"role": "assistant", "parts": [{"text": "hi"}]}
    return parent


def _bad_approval_mode(parent: dict[str, Any]) -> dict[str, Any]:
    parent["approval_mode"] = "always"
    return parent


def _no_session_id(parent: dict[str, Any]) -> dict[str, Any]:
    del parent["session_id"]
    return parent


def _braced_session_id(parent: dict[str, Any]) -> dict[str, Any]:
    parent["session_id"] = "a{b}"
    return parent


@pytest.mark.parametrize(
    ("spoil", "field"),
    [
        (_bad_history, "history[3]"),
        (_bad_approval_mode, "approval_mode"),
        (_no_session_id, "session_id"),
        (_braced_session_id, "session_id"),
    ],
    ids=["history-entry", "approval-mode", "no-session-id", "braced-session-id"],
)
def test_an_invalid_parent_snapshot_is_rejected_before_anything_reaches_redis(
    spoil: Any, field: str, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    with pytest.raises(InvalidParentSnapshot) as caught:
        client.launch(spoil(copy.deepcopy(parent)), {**FORK, "fork_turns": "all"})

    assert caught.value.field == field
    assert field in str(caught.value)
    assert nothing_reached_redis(redis_client, client.settings.queue)


def test_relaunching_a_fork_id_with_a_different_record_is_refused(
    client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    client.launch(parent, {**FORK, "fork_turns": "3"}, fork_id="f-fixed")

    with pytest.raises(RecordExistsError) as caught:
        client.launch(parent, {**FORK, "fork_turns": "1"}, fork_id="f-fixed")

    assert caught.value.fork_id == "f-fixed"
    assert redis_client.llen(client.settings.queue) == 1
    assert client.inspect("f-fixed")["fork_turns"] == "3"


# ── shared storage ────────────────────────────────────────────────────────────────────────────


def test_fifty_forks_of_one_parent_store_the_shared_messages_once(
    client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    # Given 50 forks of the example parent, each inheriting the whole history with its own directive
    forks = 50
    handles = [
        client.launch(parent, {**FORK, "prompt": f"Task {i}: audit module {i}.", "fork_turns": "all"})
        for i in range(forks)
    ]
    history = parse_parent_snapshot(parent).history
    one_seed = split_seed(
        build_fork_seed(history, fork_turns="all", directive="Task 0: audit module 0.").initial_messages
    )
    one_seed_bytes = sum(map(len, one_seed))

    # When we measure every chunk in Redis
    chunk_keys = redis_client.keys("*:chunk:*")
    chunk_bytes = sum(redis_client.strlen(key) for key in chunk_keys)

    # Then the shared messages are stored once: only each fork's repaired end (its last chunk) differs
    tail_allowance = 2 * len(one_seed[-1])
    context = len(parent["system_instruction"]) + len(json.dumps(parent["tools"]))
    assert len(chunk_keys) <= len(one_seed) + forks - 1 + 1  # + the parent's context chunk, stored once
    assert chunk_bytes < 1.3 * one_seed_bytes + forks * tail_allowance + context
    assert chunk_bytes < 3.5 * one_seed_bytes  # 50 copies would be 50×
    # and no bootstrap record holds message bodies, the system instruction or the tools: only digests
    for handle in handles:
        assert redis_client.strlen(client.store.keys.bootstrap(handle.fork_id)) < 2048


# ── waiting, cancelling, events ──────────────────────────────────────────────────────────────


def test_wait_raises_fork_timeout_when_no_worker_runs(client: ForkClient, parent: dict[str, Any]) -> None:
    handle = client.launch(parent, {**FORK, "fork_turns": "1"})

    with pytest.raises(ForkTimeout) as caught:
        handle.wait(timeout=0.3)

    assert caught.value.fork_id == handle.fork_id
    assert "queued" in str(caught.value)
    assert handle.status().status is Status.QUEUED


def test_following_a_fork_that_does_not_exist_raises_fork_not_found(client: ForkClient) -> None:
    with pytest.raises(ForkNotFound):
        client.status("f-missing")
    with pytest.raises(ForkNotFound):
        client.wait("f-missing", timeout=0.1)
    with pytest.raises(ForkNotFound):
        client.cancel("f-missing")
    assert client.result("f-missing") is None


def test_a_cancelled_queued_fork_is_not_run_when_a_worker_takes_its_job(
    client: ForkClient, start_live_worker: Any, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    # Given a queued fork, cancelled before any worker runs
    handle = client.launch(parent, {**FORK, "fork_turns": "1"})
    assert handle.cancel() is Status.CANCELLED

    # When a worker takes its job
    start_live_worker(client.app)
    wait_until(lambda: redis_client.llen(client.settings.queue) == 0, what="the job to be consumed")
    wait_until(lambda: redis_client.hlen("unacked") == 0, what="the job to be acknowledged")

    # Then the fork stays cancelled and never started
    result = handle.wait(timeout=1)
    assert (result.status, result.error) == (Status.CANCELLED, "cancelled by request")
    assert handle.status().status is Status.CANCELLED
    assert handle.status().attempt == 0
    assert [e.type for e in handle.events() if e.type in MILESTONES] == ["queued", "finished"]


def test_cancelling_a_finished_fork_leaves_its_result(
    client: ForkClient, live_worker: WorkController, parent: dict[str, Any]
) -> None:
    handle = client.launch(parent, {**FORK, "fork_turns": "1"})
    before = handle.wait(timeout=15)

    assert handle.cancel() is Status.SUCCEEDED
    assert client.result(handle.fork_id) == before
    assert handle.status().status is Status.SUCCEEDED


def test_a_handle_gives_the_result_and_the_notification_of_its_fork_once_it_has_ended(
    client: ForkClient, start_live_worker: Any, parent: dict[str, Any]
) -> None:
    # Given a launched fork that no worker has run yet
    handle = client.launch(parent, {**FORK, "fork_turns": "1"})
    assert handle.result() is None
    with pytest.raises(ForkNotEnded, match=f"fork {handle.fork_id} is queued: it has no result to notify yet"):
        handle.notification()

    # When a worker runs it to its end
    start_live_worker(client.app)
    waited = handle.wait(timeout=15)

    # Then the handle's result and notification are the client's for its fork id
    assert waited.status is Status.SUCCEEDED, waited.error
    assert handle.result() == waited == client.result(handle.fork_id)
    notification = handle.notification()
    assert notification == client.notification(handle.fork_id)
    assert notification == render_task_notification(waited, description=FORK["description"])
    assert f"<task-id>{handle.fork_id}</task-id>" in notification and "<status>completed</status>" in notification


def test_the_event_stream_has_queued_started_step_finished_in_order(
    client: ForkClient, live_worker: WorkController, parent: dict[str, Any]
) -> None:
    handle = client.launch(parent, {**FORK, "fork_turns": "3"})

    followed = list(handle.events(follow=True))

    milestones = [e for e in followed if e.type in MILESTONES]
    assert [e.type for e in milestones] == ["queued", "started", "step", "finished"]
    assert followed[-1].type == "finished"
    assert milestones[0].data.digest == handle.digest
    assert milestones[2].data.step == 1
    assert milestones[3].data.status == "succeeded"
    assert [e.at_ms for e in followed] == sorted(e.at_ms for e in followed)
    assert [e.id for e in handle.events()] == [e.id for e in followed]


def test_launches_from_alternating_snapshot_objects_record_each_ones_own_tools_and_history(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given two snapshot objects of different parents (other tools, one message less), reused across launches
    first = parse_parent_snapshot(parent)
    other_raw = {**copy.deepcopy(parent), "tools": [{"name": "only_tool"}], "session_id": "other-session"}
    other_raw["history"] = other_raw["history"][1:]
    other = parse_parent_snapshot(other_raw)

    # When forks are launched from them in turn (the client reuses what it built for the same object)
    handles = [client.launch(snapshot, FORK) for snapshot in (first, other, first, other)]

    # Then each record holds its own parent's tools and seed, exactly as the history pipeline builds it
    for handle, snapshot in zip(handles, (first, other, first, other), strict=True):
        record = client.inspect(handle.fork_id)
        seed = build_fork_seed(snapshot.history, fork_turns=None, directive=FORK["prompt"])
        assert record["tools"] == snapshot.tools
        assert record["initial_messages"] == seed.to_wire()["initial_messages"]


def test_a_snapshot_whose_declarations_list_changed_records_the_new_declarations(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a snapshot launched from once, whose tools list then gets one more declaration
    snapshot = parse_parent_snapshot(parent)
    client.launch(snapshot, FORK)
    snapshot.tools.append({"name": "added_later"})

    # When it is launched from again
    handle = client.launch(snapshot, FORK)

    # Then the new record holds the declarations as they are now
    assert client.inspect(handle.fork_id)["tools"] == snapshot.tools
    assert snapshot.tools[-1] == {"name": "added_later"}


def test_put_launch_refuses_seed_chunks_the_record_does_not_name(client: ForkClient, parent: dict[str, Any]) -> None:
    handle = client.launch(parent, FORK)
    record = client.store.get_record(handle.fork_id, handle.digest)
    data, digest = record.model_copy(update={"fork_id": "f-other"}).encode()

    with pytest.raises(RecordIntegrityError, match="seed chunks given, the record names"):
        client.store.put_launch(record.model_copy(update={"fork_id": "f-other"}), data, digest, [b"one chunk"])


# ── bounds, and every launch path validates ───────────────────────────────────────────────────


def nested(levels: int, leaf: Any = "x") -> Any:
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def _deep_history(parent: dict[str, Any]) -> dict[str, Any]:
    parent["history"][5]["parts"].append({"functionCall": {"name": "read_file", "args": nested(600)}})
    return parent


def _deep_tool(parent: dict[str, Any]) -> dict[str, Any]:
    parent["tools"][1] = {"name": "deep", "parameters": nested(300, {"type": "object"})}
    return parent


def _deep_system_instruction(parent: dict[str, Any]) -> dict[str, Any]:
    parent["system_instruction"] = nested(300)
    return parent


def _depth_as_text(parent: dict[str, Any]) -> dict[str, Any]:
    parent["depth"] = "0"
    return parent


def _huge_depth(parent: dict[str, Any]) -> dict[str, Any]:
    parent["depth"] = 10**5000
    return parent


def _lone_surrogate_in_history(parent: dict[str, Any]) -> dict[str, Any]:
    parent["history"][5]["parts"].append({"text": "half a pair: \ud83d"})
    return parent


def _lone_surrogate_in_a_tool_key(parent: dict[str, Any]) -> dict[str, Any]:
    parent["tools"][1] = {"name": "t", "parameters": {"type": "object", "properties": {"caf\udce9": {}}}}
    return parent


@pytest.mark.parametrize(
    ("spoil", "field"),
    [
        (_deep_history, "history[5]"),
        (_deep_tool, "tools[1]"),
        (_deep_system_instruction, "system_instruction"),
        (_depth_as_text, "depth"),
        (_huge_depth, "depth"),
        (_lone_surrogate_in_history, "history[5]"),
        (_lone_surrogate_in_a_tool_key, "tools[1]"),
    ],
    ids=[
        "history-600-deep",
        "tool-300-deep",
        "system-instruction-300-deep",
        "depth-text",
        "depth-5000-digits",
        "history-lone-surrogate",
        "tool-key-lone-surrogate",
    ],
)
def test_a_parent_snapshot_past_its_bounds_is_refused_naming_the_field_and_writes_nothing(
    spoil: Any, field: str, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    with pytest.raises(InvalidParentSnapshot) as caught:
        client.launch(spoil(copy.deepcopy(parent)), FORK)

    assert caught.value.field == field
    assert field in str(caught.value)
    assert nothing_reached_redis(redis_client, client.settings.queue)


@pytest.mark.parametrize(
    ("launch", "field"),
    [
        ({"params": {**FORK, "fork_turns": "7" * 5000}}, "fork_turns"),
        ({"params": {**FORK, "prompt": "p" * 1_000_001}}, "prompt"),
        ({"params": FORK, "max_wall_s": float("nan")}, "max_wall_s"),
        ({"params": FORK, "max_wall_s": float("inf")}, "max_wall_s"),
        ({"params": FORK, "max_wall_s": 10**5000}, "max_wall_s"),
        ({"params": FORK, "max_turns": 2.5}, "max_turns"),
        ({"params": FORK, "max_turns": 10**5000}, "max_turns"),
        ({"params": FORK, "output_schema": nested(300, {"type": "object"})}, "output_schema"),
        ({"params": FORK, "fork_id": "../{evil}"}, "fork_id"),
        ({"params": {**FORK, "prompt": "bad \udcff byte"}}, "prompt"),
        ({"params": FORK, "output_schema": {"type": "object", "title": "\ud800"}}, "output_schema"),
    ],
    ids=[
        "fork-turns-5000-digits",
        "prompt-too-long",
        "wall-nan",
        "wall-inf",
        "wall-5000-digits",
        "turns-fraction",
        "turns-5000-digits",
        "schema-300-deep",
        "fork-id",
        "prompt-lone-surrogate",
        "schema-lone-surrogate",
    ],
)
def test_a_launch_past_its_bounds_raises_invalid_agent_params_naming_the_field_and_writes_nothing(
    launch: dict[str, Any], field: str, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        client.launch(parent, **launch)

    assert caught.value.field == field
    assert field in str(caught.value)
    assert nothing_reached_redis(redis_client, client.settings.queue)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"description": "d", "prompt": ""}, 'Parameter "prompt" is required'),
        ({"description": "d", "prompt": "p", "subagent_type": "general", "fork_turns": "3"}, MSG_FORK_TURNS_NOT_FORK),
        ({"description": "d", "prompt": "p", "subagent_type": "fork", "model": "m"}, MSG_MODEL_FORK),
        ({"description": "d", "prompt": "p", "subagent_type": "fork", "fork_turns": "0"}, MSG_FORK_TURNS_VALUE),
    ],
    ids=["empty-prompt", "fork-turns-not-fork", "model-fork", "fork-turns-zero"],
)
def test_an_agent_params_is_held_to_the_agent_calls_rules_before_it_can_be_launched(
    fields: dict[str, Any], message: str, client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    # building one checks the contract, once: a launch trusts the AgentParams it is given
    with pytest.raises(InvalidAgentParams, match=re.escape(message)):
        client.launch(parent, AgentParams(**fields))

    assert nothing_reached_redis(redis_client, client.settings.queue)


def test_a_valid_prebuilt_agent_params_launches_as_its_agent_call_would(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    params = validate_agent_params({**FORK, "fork_turns": "3", "fork_tools": ["read_file"]})

    record = client.inspect(client.launch(parent, params).fork_id)

    assert (record["fork_turns"], record["fork_tools"], record["subagent_type"]) == ("3", ["read_file"], "fork")


def test_wait_on_a_parked_fork_raises_fork_parked_at_once_with_the_pending_calls(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a fork parked on a call a person must decide (as a worker parks it)
    handle = client.launch(parent, FORK, approval_policy="park")
    leases = Leases(client.redis, client.store.keys, ttl_ms=10_000, retention_s=3600)
    claim = leases.claim(handle.fork_id, "worker-1", handle.digest)
    assert isinstance(claim, Claim)
    calls = [{"call_id": "w1", "index": 0, "step": 0, "name": "write_file", "args": {"path": "a"}}]
    leases.park(claim, [ParkedCall.model_validate(call) for call in calls])

    # When the parent waits for it, with a long timeout
    started = time.monotonic()
    with pytest.raises(ForkParked) as caught:
        handle.wait(timeout=60)

    # Then the wait returns at once, with the status, the calls and what to do
    assert time.monotonic() - started < 5
    assert (caught.value.status, caught.value.pending, caught.value.fork_id) == (
        "awaiting_approval",
        calls,
        handle.fork_id,
    )
    assert f"forkq approve {handle.fork_id} CALL_ID" in str(caught.value) and "w1 (write_file)" in str(caught.value)


def park(client: ForkClient, parent: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """A fork parked on one call a person must decide, as a worker parks it: (fork id, pending calls)."""
    handle = client.launch(parent, FORK, approval_policy="park")
    leases = Leases(client.redis, client.store.keys, ttl_ms=10_000, retention_s=3600)
    claim = leases.claim(handle.fork_id, "worker-1", handle.digest)
    assert isinstance(claim, Claim)
    calls = [{"call_id": "w1", "index": 0, "step": 0, "name": "write_file", "args": {"path": "a"}}]
    leases.park(claim, [ParkedCall.model_validate(call) for call in calls])
    return handle.fork_id, calls


def test_a_denial_whose_reason_is_not_valid_unicode_is_refused_and_the_call_still_waits(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    fork_id, calls = park(client, parent)

    with pytest.raises(InvalidApproval, match=r"the reason of a denial is not valid Unicode text: character 4"):
        client.deny(fork_id, "w1", "not \udcff now")

    state = client.status(fork_id)
    assert (state.status, [c.wire() for c in state.pending_approval]) == (Status.AWAITING_APPROVAL, calls)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1, "5", True], ids=repr)
def test_wait_refuses_a_timeout_that_is_not_a_finite_number_of_seconds(client: ForkClient, timeout: Any) -> None:
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds, 0 or more, or None"):
        client.wait("f-any", timeout=timeout)


def test_wait_with_a_huge_finite_timeout_follows_the_fork_until_it_ends(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a queued fork that is cancelled a moment after the wait begins
    handle = client.launch(parent, FORK)
    canceller = threading.Timer(0.3, client.cancel, args=[handle.fork_id])
    canceller.start()

    # When the parent waits with a timeout of 1e308 s (its milliseconds overflow a float)
    result = handle.wait(timeout=1e308)

    # Then the wait ends with the fork, not with an OverflowError
    canceller.join()
    assert result.status is Status.CANCELLED


# ── acting on a fork: every call returns the fork's status afterwards ────────────────────────


def parked_handle(client: ForkClient, parent: dict[str, Any], calls: list[dict[str, Any]]) -> ForkHandle:
    """A launched fork parked on `calls`, as a worker parks it."""
    handle = client.launch(parent, FORK, approval_policy="park")
    leases = Leases(client.redis, client.store.keys, ttl_ms=10_000, retention_s=3600)
    claim = leases.claim(handle.fork_id, "worker-1", handle.digest)
    assert isinstance(claim, Claim)
    leases.park(claim, [ParkedCall.model_validate(call) for call in calls])
    return handle


def test_approve_and_deny_return_awaiting_approval_while_a_call_waits_then_queued(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    calls = [
        {"call_id": "w1", "index": 0, "step": 0, "name": "write_file", "args": {"path": "a"}},
        {"call_id": "w2", "index": 1, "step": 0, "name": "write_file", "args": {"path": "b"}},
    ]
    handle = parked_handle(client, parent, calls)

    assert handle.approve("w1") is Status.AWAITING_APPROVAL
    assert [c.wire() for c in handle.status().pending_approval] == calls[1:]
    assert handle.deny("w2", "not b") is Status.QUEUED
    assert handle.status().status is Status.QUEUED
    assert client.redis.llen(client.settings.queue) == 2  # the launch's job, and the one the last decision sent


def test_resume_returns_queued_for_a_paused_fork_and_refuses_one_that_is_not_paused(
    client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a fork a worker paused (a tool it started with is missing)
    handle = client.launch(parent, FORK)
    leases = Leases(client.redis, client.store.keys, ttl_ms=10_000, retention_s=3600)
    claim = leases.claim(handle.fork_id, "worker-1", handle.digest)
    assert isinstance(claim, Claim)
    leases.pause(claim, "tool plugin_x is not installed on this worker")

    # When it is resumed, and then resumed again
    assert handle.resume() is Status.QUEUED
    with pytest.raises(ForkNotPaused) as again:
        handle.resume()

    # Then the second resume changes nothing and says why
    assert (again.value.status, again.value.fork_id) == ("queued", handle.fork_id)
    assert str(again.value).startswith(f"fork {handle.fork_id} is queued, not paused: nothing to resume")
    assert handle.status().status is Status.QUEUED
    assert handle.cancel() is Status.CANCELLED

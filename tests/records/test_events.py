"""A fork's events as typed models (workers/records/events.py): every type any writer, Python or Lua, puts in
the stream is a member of the `ForkEvent` union and reads back as its model, the stored bytes are those the
plain dicts made before, and an event this version does not know reads as an `UnknownEvent` without failing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from celery.worker import WorkController

from broker_config.settings import Settings
from tests.cli_support import call, step
from tests.conftest import TEST_NAMESPACE, put_queued_fork
from workers.base.keys import Keys
from workers.client import ForkClient
from workers.records.events import (
    EVENT_TYPES,
    AwaitingApprovalData,
    DecisionData,
    FeedbackData,
    FeedbackEvent,
    FinishedData,
    MessageData,
    MessageEvent,
    ModelCallData,
    ModelCallEvent,
    QueuedData,
    ReasonData,
    StepData,
    StepEvent,
    StreamEvent,
    ToolData,
    ToolEvent,
    UnknownEvent,
    decision_event,
    decode_event,
)
from workers.records.fork import ForkResult, Status, Usage
from workers.records.journal import JournalEntry
from workers.records.parked import AdmissionLimit, ModelWait, ParkedCall
from workers.store.admission import AdmissionStore, wait_over, wait_shown
from workers.store.claims import FirstWrite
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases
from workers.store.replies import Decision, SendReply, Written

ROOT = Path(__file__).resolve().parents[2]
KEYS = Keys(TEST_NAMESPACE)
FORK = {"description": "read a file", "prompt": "Read a.txt.", "subagent_type": "fork"}
# an XADD of a literal event type in a Lua script: `'type', 'started'`
LUA_EVENT_TYPE = re.compile(r"'type', '([a-z_]+)'")
PARKED = [
    ParkedCall(call_id="w1", index=0, step=1, name="write_file", args={"path": "a.txt", "content": "é"}),
    ParkedCall(call_id="w2", index=1, step=1, name="run_shell", args={"command": "ls"}),
]


def stored(client: redis.Redis, fork_id: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The fork's stream entries as Redis holds them."""
    return cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(KEYS.events(fork_id)))


def read_back(client: redis.Redis, *fork_ids: str) -> list[StreamEvent]:
    """Every event of the forks, each decoded, checked to be its type's model and to give back its stored JSON."""
    events = []
    for fid in fork_ids:
        for eid, fields in stored(client, fid):
            event = decode_event(eid, fields)
            assert not isinstance(event, UnknownEvent), f"{fid}: {fields!r} is not read as one of ForkEvent's types"
            assert event.wire_data() == json.loads(fields[b"data"]), fields
            events.append(event)
    return events


# ── the union against what the code writes ─────────────────────────────────────────────────────


def test_every_event_type_a_lua_script_writes_is_a_member_of_the_union() -> None:
    sources = [path.read_text(encoding="utf-8") for path in (ROOT / "workers").rglob("*.py")]
    written = {kind for text in sources for kind in LUA_EVENT_TYPE.findall(text)}

    assert written >= {"queued", "started", "model_call", "finished", "resumed", "message", "released", "revived"}
    assert written <= EVENT_TYPES


def test_events_written_by_every_script_and_writer_read_back_as_their_own_types(
    redis_client: redis.Redis, fork_store: ForkStore
) -> None:
    # Given a fork taken through every write that publishes an event: launch, a first claim that announces its
    # first model call, the loop's events, a park decided both ways, a pause and resume, a message, a release,
    # a finish that continues the fork for a message that came meanwhile, and a finish
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    digest = put_queued_fork(fork_store, "f-all")
    record = cast(bytes, redis_client.get(KEYS.bootstrap("f-all")))
    model_call = ModelCallEvent(data=ModelCallData(step=1, request_digest="d1"))
    surface = JournalEntry(seq=0, step=0, kind="surface", tools=["read_file"])
    claim = leases.claim("f-all", "worker-a", digest, first=FirstWrite(record, surface, model_call))
    assert isinstance(claim, Claim) and claim.primed
    leases.emit(
        claim,
        [
            StepEvent(data=StepData(step=1, tool_calls=["read_file"], input_tokens=3, output_tokens=2)),
            ToolEvent(data=ToolData(step=1, tool="read_file", ok=True)),
            FeedbackEvent(data=FeedbackData(step=1, error="missing field")),
            MessageEvent(data=MessageData(step=1, count=1)),
        ],
    )
    admission = AdmissionStore(redis_client, KEYS, token="host:1:ab", hold_ttl_ms=10_000, alive_ttl_ms=10_000)
    wait = ModelWait(model="gpt-4.1-mini", limit=AdmissionLimit.RPM, since_ms=1)
    admission.write_waits([wait_shown("f-all", claim.epoch, claim.owner, wait, 1)])
    assert fork_store.state("f-all").waiting_for == wait
    admission.write_waits([wait_over("f-all", claim.epoch, claim.owner, 5)])
    leases.park(claim, PARKED)
    assert fork_store.decide("f-all", "w1", "approve") is Decision.RECORDED
    assert fork_store.decide("f-all", "w2", "deny", "not now") is Decision.QUEUED
    claim = again(leases, "f-all")
    leases.pause(claim, "a declared tool is missing")
    assert fork_store.resume("f-all")
    claim = again(leases, "f-all")
    assert fork_store.send("f-all", "and the tests too", inbox_limit=10)[0] is SendReply.QUEUED
    leases.release(claim, "worker shutdown")
    claim = again(leases, "f-all")
    assert leases.finish(claim, ForkResult(fork_id="f-all", status=Status.SUCCEEDED, output="ok")) is Written.CONTINUED
    redis_client.delete(KEYS.inbox("f-all"))
    claim = again(leases, "f-all")
    leases.finish(claim, ForkResult(fork_id="f-all", status=Status.SUCCEEDED, output="ok"))
    # and a succeeded fork continued by a message, one failed by the sweeper, one cancelled
    assert fork_store.send("f-all", "one more thing", inbox_limit=10)[0] == "continued"
    put_queued_fork(fork_store, "f-lost")
    lost = again(leases, "f-lost")
    assert leases.revive("f-lost", max_attempts=2, dead_owner=lost.owner) == "revive"
    lost = again(leases, "f-lost")
    assert leases.revive("f-lost", max_attempts=2, dead_owner=lost.owner) == "failed"
    put_queued_fork(fork_store, "f-cancelled")
    assert fork_store.cancel("f-cancelled") is Status.CANCELLED

    # When their streams are read back
    events = read_back(redis_client, "f-all", "f-lost", "f-cancelled")

    # Then every event is its type's model, and every type of the union was written
    assert {e.type for e in events} == EVENT_TYPES
    messages = [e.wire_data() for e in events if e.type == "message"]
    assert messages == [
        {"step": 1, "count": 1},
        {"waiting": 1, "status": "running"},
        {"waiting": 1, "status": "succeeded", "continued": True},
    ]
    finished = [e.data for e in events if e.type == "finished"]
    assert [(f.status, f.usage is not None) for f in finished] == [  # type: ignore[union-attr]
        (Status.SUCCEEDED, True),
        (Status.FAILED, False),
        (Status.CANCELLED, True),
    ]


def again(leases: Leases, fork_id: str) -> Claim:
    """Claim a queued fork (again)."""
    claim = leases.claim(fork_id, f"worker-{fork_id}")
    assert isinstance(claim, Claim), claim
    return claim


def test_a_real_worker_run_writes_only_events_of_the_union_each_stored_as_its_model_writes_it(
    client: ForkClient,
    scripted_worker: Callable[[list[dict[str, Any]]], WorkController],
    parent: dict[str, Any],
    redis_client: redis.Redis,
) -> None:
    # Given a worker whose model reads a file, then answers
    scripted_worker([step(call("r1", "read_file", path="a.txt")), step("all done")])

    # When a fork runs to its end
    handle = client.launch(parent, {**FORK, "fork_turns": "1"})
    assert handle.wait(timeout=30).status is Status.SUCCEEDED

    # Then its stream holds only events of the union, and each Python-written one is the bytes its model writes
    events = read_back(redis_client, handle.fork_id)
    run = ["queued", "started", "model_call", "step", "tool", "model_call", "step", "finished"]
    assert [e.type for e in events] == run
    for (_, fields), event in zip(stored(redis_client, handle.fork_id), events, strict=True):
        if event.type != "started":  # the claim's own (cjson: its key order is Lua's)
            assert not isinstance(event, UnknownEvent)
            assert event.data.to_json().encode() == fields[b"data"]


# ── the stored bytes ───────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("data", "stored_json"),
    [
        (QueuedData(kind="fork", digest="ab12", messages=4), '{"kind": "fork", "digest": "ab12", "messages": 4}'),
        (ModelCallData(step=2, request_digest="cd34"), '{"step": 2, "request_digest": "cd34"}'),
        (
            StepData(step=2, tool_calls=["grep_search"], input_tokens=10, output_tokens=3, cached_input_tokens=0),
            '{"step": 2, "tool_calls": ["grep_search"], "input_tokens": 10, "output_tokens": 3, '
            '"cached_input_tokens": 0}',
        ),
        (ToolData(step=2, tool="grep_search", ok=False), '{"step": 2, "tool": "grep_search", "ok": false}'),
        (FeedbackData(step=3, error="missing 'title'"), '{"step": 3, "error": "missing \'title\'"}'),
        (MessageData(step=3, count=2), '{"step": 3, "count": 2}'),
        (
            DecisionData(call_id="w1", name="write_file", reason=None),
            '{"call_id": "w1", "name": "write_file", "reason": null}',
        ),
        (ReasonData(reason="a tool is missing"), '{"reason": "a tool is missing"}'),
        (
            FinishedData(status=Status.FAILED, error="boom", usage=Usage(input_tokens=5, model_calls=1)),
            '{"status": "failed", "error": "boom", "usage": {"input_tokens": 5, "output_tokens": 0, "total_tokens": 0, '
            '"tool_uses": 0, "model_calls": 1, "duration_ms": 0, "cached_input_tokens": 0}}',
        ),
        (
            AwaitingApprovalData(reason="awaiting approval", calls=PARKED[:1]),
            '{"reason":"awaiting approval","calls":[{"call_id":"w1","index":0,"step":1,"name":"write_file",'
            '"args":{"path":"a.txt","content":"é"}}]}',
        ),
    ],
    ids=["queued", "model_call", "step", "tool", "feedback", "message", "approved", "paused", "finished", "parked"],
)
def test_each_event_model_writes_the_json_its_plain_dict_wrote_before(data: Any, stored_json: str) -> None:
    assert data.to_json() == stored_json


def test_a_decision_is_an_approved_or_denied_event() -> None:
    data = DecisionData(call_id="w1", name="write_file", reason=None)

    assert decision_event("approve", data).encoded() == ("approved", data.to_json())
    assert decision_event("deny", data).encoded() == ("denied", data.to_json())


def test_a_stored_event_goes_out_with_its_keys_as_stored_and_keys_a_newer_writer_added() -> None:
    # an older step without cached tokens, a newer one with a key this version does not know
    older = decode_event(b"1-0", {b"type": b"step", b"data": b'{"step": 1, "tool_calls": []}'})
    newer = decode_event(b"2-0", {b"type": b"step", b"data": b'{"step": 2, "tool_calls": [], "thinking_tokens": 7}'})

    assert isinstance(older, StepEvent) and isinstance(newer, StepEvent)
    assert older.data.cached_input_tokens == 0 and older.wire_data() == {"step": 1, "tool_calls": []}
    assert newer.wire_data() == {"step": 2, "tool_calls": [], "thinking_tokens": 7}
    assert (older.at_ms, newer.id) == (1, "2-0")


# ── what this version does not know ────────────────────────────────────────────────────────────


def test_an_event_of_a_type_a_newer_version_writes_is_read_as_an_unknown_event_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="forkq.events"):
        event = decode_event(b"7-1", {b"type": b"budget_spent", b"data": b'{"tokens": 9000}'})

    assert isinstance(event, UnknownEvent)
    assert (event.id, event.type, event.wire_data(), event.terminal) == ("7-1", "budget_spent", {"tokens": 9000}, False)
    assert "type 'budget_spent' unknown to this version" in caplog.text


def test_an_event_whose_data_does_not_fit_its_type_is_passed_on_as_stored_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    finished = decode_event(b"8-0", {b"type": b"finished", b"data": b'{"status": "evaporated"}'})
    not_json = decode_event(b"9-0", {b"type": b"step", b"data": b"\xff{"})

    assert isinstance(finished, UnknownEvent) and finished.terminal  # a follower still stops at the end
    assert finished.wire_data() == {"status": "evaporated"}
    assert isinstance(not_json, UnknownEvent) and not_json.wire_data() == {"text": "\ufffd{"}
    assert "event 8-0 (finished): data does not fit its model" in caplog.text


def test_forkq_status_loads_no_event_model_while_forkq_events_does(
    forkq_env: Settings, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # thirty-odd models cost a cold `forkq status` about 10 ms: they load at the first event read or written
    fork_id, _ = make_queued_fork()
    loaded = "'workers.records.events' in sys.modules"
    for command, expected in (("status", "False"), ("events", "True")):
        code = (
            "import contextlib, io, sys\nfrom workers.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n    assert main([{command!r}, {fork_id!r}]) == 0\n"
            f"print({loaded})"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected, command

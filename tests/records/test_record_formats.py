"""Stored formats kept byte for byte: bootstrap records (typed options, approval mode), parked calls and journal
entries (typed content, entry kinds); and results written before a usage counter was added still read.

The literals below were written by the code before `ForkOptions`, `ApprovalMode` and `ParkedCall`
typed these fields (when options were a plain map and parked calls plain JSON objects): records and
states already in Redis must read back, and the same inputs must give the same bytes and digest.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.conftest import TEST_NAMESPACE
from workers.base import codec
from workers.base.keys import Keys
from workers.errors import RecordDecodeError
from workers.history.messages import Content
from workers.records.fork import BootstrapRecord, ForkOptions, ForkResult, ForkState, Status, chunk_digest
from workers.records.journal import EntryKind, JournalEntry
from workers.records.parked import ApprovalWait, ParkedCall, ResumeWait, WaitingCall, decode_parked, encode_parked
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases

KEYS = Keys(TEST_NAMESPACE)

# the context chunk every golden record names: no system instruction, no tools
CONTEXT = base64.b64decode("grJzeXN0ZW1faW5zdHJ1Y3Rpb27AqnRvb2xzX2pzb26iW10=")
SEED_CHUNKS = [
    bytes.fromhex("f3228811e6cb424bd7a27d137c3e819635008874c4068e2b799c8bcdb36dc970"),
    bytes.fromhex("adc2bcce821e0c735fba0efc93f613ff786a53fb4a8fb565a98b4f35f909f6cf"),
]
LAUNCH_OPTIONS: dict[str, Any] = {
    "fork_tools": ["read_file", "mcp__github__*"],
    "approval_policy": "park",
    "output_schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    "max_wall_s": 600,
    "max_turns": 12,
}
# name: (the record's own fields, its stored bytes (base64), their digest)
GOLDEN: dict[str, tuple[dict[str, Any], str, str]] = {
    "plain": (
        {},
        "3gATrWFwcHJvdmFsX21vZGWnZGVmYXVsdK1jb250ZXh0X2NodW5rxCDxepK89qWpy6tZCp5XK7VrNi+B+IFwhQ3AvivqIoQ9nqNjd2Sh"
        "LqVkZXB0aACrZGVzY3JpcHRpb26mYSB0YXNrqWRpcmVjdGl2ZaxEbyB0aGUgdGFzay6nZm9ya19pZK5mLWdvbGRlbi1wbGFpbqpmb3Jr"
        "X3R1cm5zwKpnZW5lcmF0aW9ugKRraW5kpGZvcmutbWVzc2FnZV9jb3VudAelbW9kZWzApG5hbWXAp29wdGlvbnOArnBhcmVudF9zZXNz"
        "aW9uo3MtMa5zY2hlbWFfdmVyc2lvbgGrc2VlZF9jaHVua3OSxCDzIogR5stCS9eifRN8PoGWNQCIdMQGjit5nIvNs23JcMQgrcK8zoIe"
        "DHNfug78k/YT/3hqU/tKj7VlqYtPNfkJ9s+tc3ViYWdlbnRfdHlwZcCrdGFza19wcm9tcHSmQmVnaW4u",
        "00b0baf519246111d83c699bfb3e9eae94ea2962ca6e21c5db114046352d6e0a",
    ),
    "launch_options": (
        {
            "approval_mode": "auto-edit",
            "model": "gemini-2.5-pro",
            "generation": {"temperature": 0.2},
            "options": LAUNCH_OPTIONS,
        },
        "3gATrWFwcHJvdmFsX21vZGWpYXV0by1lZGl0rWNvbnRleHRfY2h1bmvEIPF6krz2panLq1kKnlcrtWs2L4H4gXCFDcC+K+oihD2eo2N3"
        "ZKEupWRlcHRoAKtkZXNjcmlwdGlvbqZhIHRhc2upZGlyZWN0aXZlrERvIHRoZSB0YXNrLqdmb3JrX2lkt2YtZ29sZGVuLWxhdW5jaF9v"
        "cHRpb25zqmZvcmtfdHVybnPAqmdlbmVyYXRpb26Bq3RlbXBlcmF0dXJlyz/JmZmZmZmapGtpbmSkZm9ya61tZXNzYWdlX2NvdW50B6Vt"
        "b2RlbK5nZW1pbmktMi41LXByb6RuYW1lwKdvcHRpb25zha9hcHByb3ZhbF9wb2xpY3mkcGFya6pmb3JrX3Rvb2xzkqlyZWFkX2ZpbGWu"
        "bWNwX19naXRodWJfXyqpbWF4X3R1cm5zDKptYXhfd2FsbF9zzQJYrW91dHB1dF9zY2hlbWGDqnByb3BlcnRpZXOBpmFuc3dlcoGkdHlw"
        "ZaZzdHJpbmeocmVxdWlyZWSRpmFuc3dlcqR0eXBlpm9iamVjdK5wYXJlbnRfc2Vzc2lvbqNzLTGuc2NoZW1hX3ZlcnNpb24Bq3NlZWRf"
        "Y2h1bmtzksQg8yKIEebLQkvXon0TfD6BljUAiHTEBo4reZyLzbNtyXDEIK3CvM6CHgxzX7oO/JP2E/94alP7So+1ZamLTzX5CfbPrXN1"
        "YmFnZW50X3R5cGXAq3Rhc2tfcHJvbXB0pkJlZ2luLg==",
        "a89ed308ecddf73226997fda79f08e14f890ae2f760f8d37bb08b788d63be0bd",
    ),
    "float_limit": (
        {"approval_mode": "yolo", "options": {"max_wall_s": 1.5}},
        "3gATrWFwcHJvdmFsX21vZGWkeW9sb61jb250ZXh0X2NodW5rxCDxepK89qWpy6tZCp5XK7VrNi+B+IFwhQ3AvivqIoQ9nqNjd2ShLqVk"
        "ZXB0aACrZGVzY3JpcHRpb26mYSB0YXNrqWRpcmVjdGl2ZaxEbyB0aGUgdGFzay6nZm9ya19pZLRmLWdvbGRlbi1mbG9hdF9saW1pdKpm"
        "b3JrX3R1cm5zwKpnZW5lcmF0aW9ugKRraW5kpGZvcmutbWVzc2FnZV9jb3VudAelbW9kZWzApG5hbWXAp29wdGlvbnOBqm1heF93YWxs"
        "X3PLP/gAAAAAAACucGFyZW50X3Nlc3Npb26jcy0xrnNjaGVtYV92ZXJzaW9uAatzZWVkX2NodW5rc5LEIPMiiBHmy0JL16J9E3w+gZY1"
        "AIh0xAaOK3mci82zbclwxCCtwrzOgh4Mc1+6DvyT9hP/eGpT+0qPtWWpi081+Qn2z61zdWJhZ2VudF90eXBlwKt0YXNrX3Byb21wdKZC"
        "ZWdpbi4=",
        "8d8fea2aa9f3e02f92f5f27f5eb1bc84f038ad71200cf8cb865698eeb5ded91b",
    ),
}

# the `pending` field of a fork parked on two calls, as the park wrote it (compact, UTF-8 kept)
PARKED_JSON = (
    '[{"call_id":"c-1","index":0,"step":2,"name":"write_file","args":{"path":"notes/é.md","content":"ünïcode ✓"}},'
    '{"call_id":"2.1","index":1,"step":2,"name":"run_shell_command","args":{"command":"make test"}}]'
)
PARKED = [
    ParkedCall(call_id="c-1", index=0, step=2, name="write_file", args={"path": "notes/é.md", "content": "ünïcode ✓"}),
    ParkedCall(call_id="2.1", index=1, step=2, name="run_shell_command", args={"command": "make test"}),
]


def golden_record(name: str) -> BootstrapRecord:
    """The golden record `name` built from its inputs, as a launch builds one."""
    fields, _, _ = GOLDEN[name]
    return BootstrapRecord(
        fork_id=f"f-golden-{name}",
        parent_session="s-1",
        kind="fork",
        seed_chunks=SEED_CHUNKS,
        message_count=7,
        task_prompt="Begin.",
        directive="Do the task.",
        description="a task",
        **fields,
    )


@pytest.mark.parametrize("name", list(GOLDEN))
def test_a_record_written_before_typed_options_decodes_and_encodes_to_the_same_bytes_and_digest(name: str) -> None:
    _, stored, digest = GOLDEN[name]
    data = base64.b64decode(stored)

    record = BootstrapRecord.decode(data, fork_id=f"f-golden-{name}", context=CONTEXT, expected_digest=digest)

    assert isinstance(record.options, ForkOptions)
    assert record.encode() == (data, digest)


@pytest.mark.parametrize("name", list(GOLDEN))
def test_the_same_launch_inputs_give_the_bytes_and_digest_records_had_before(name: str) -> None:
    _, stored, digest = GOLDEN[name]

    assert golden_record(name).encode() == (base64.b64decode(stored), digest)


def test_a_stored_record_reads_its_options_as_named_fields_keeping_an_int_limit_an_int() -> None:
    _, stored, digest = GOLDEN["launch_options"]
    record = BootstrapRecord.decode(base64.b64decode(stored), fork_id="f-x", context=CONTEXT, expected_digest=digest)

    options = record.options
    assert (options.fork_tools, options.approval_policy, options.max_turns) == (
        ["read_file", "mcp__github__*"],
        "park",
        12,
    )
    assert options.output_schema == LAUNCH_OPTIONS["output_schema"]
    assert options.max_wall_s == 600 and isinstance(options.max_wall_s, int)
    assert record.approval_mode == "auto-edit"
    assert ForkOptions().model_dump() == {}  # unset options are left out of the stored map, never null


@pytest.mark.parametrize(
    ("field", "value"),
    [("options", {"max_turns": 3, "shell": True}), ("options", {"max_turns": "3"}), ("approval_mode", "lenient")],
)
def test_a_stored_record_with_an_unknown_option_or_mode_is_refused_not_coerced(field: str, value: Any) -> None:
    record = golden_record("plain")
    raw = {**record.model_dump(exclude={"system_instruction", "tools_json"}), field: value}
    raw["context_chunk"] = chunk_digest(CONTEXT)
    data = codec.encode(raw)

    with pytest.raises(RecordDecodeError, match="f-odd: bootstrap record does not have the expected fields"):
        BootstrapRecord.decode(data, fork_id="f-odd", context=CONTEXT)


def test_parked_calls_encode_to_the_json_the_park_wrote_before_and_decode_from_it() -> None:
    assert encode_parked(PARKED) == PARKED_JSON
    assert decode_parked(PARKED_JSON, fork_id="f-1") == PARKED
    assert decode_parked("", fork_id="f-1") == []


@pytest.mark.parametrize("text", ["{not json", '{"call_id": "c1"}', '[{"call_id": "c1", "name": "write_file"}]'])
def test_a_pending_field_that_is_not_parked_calls_is_refused_naming_the_fork(text: str) -> None:
    with pytest.raises(RecordDecodeError, match="fork f-9: the pending calls of its state are not"):
        ForkState.from_hash("f-9", {"status": "awaiting_approval", "pending": text})


def test_a_parked_fork_stores_the_same_json_as_before_and_its_state_reads_it_back_typed(
    redis_client: redis.Redis, fork_store: ForkStore, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given a claimed fork
    fid, _ = make_queued_fork()
    leases = Leases(redis_client, KEYS, ttl_ms=10_000, retention_s=3600)
    claim = leases.claim(fid, "worker-a")
    assert isinstance(claim, Claim), claim

    # When its run parks on two calls
    leases.park(claim, PARKED)

    # Then the state holds the JSON written before the calls were typed, the event the same calls, and both read back
    assert redis_client.hget(KEYS.state(fid), "pending") == PARKED_JSON.encode()
    event = fork_store.events(fid)[-1]
    assert (event.type, event.wire_data()["calls"]) == ("awaiting_approval", json.loads(PARKED_JSON))
    assert fork_store.state(fid).pending_approval == PARKED
    state = fork_store.state(fid)
    assert state.error is None
    assert state.waiting_for == ApprovalWait(
        calls=[WaitingCall(call_id="c-1", name="write_file"), WaitingCall(call_id="2.1", name="run_shell_command")]
    )


# the states an earlier version parked: why the fork waits in `error`, and no `waiting` field
OLD_PAUSED = {"status": "paused", "attempt": "2", "error": "declared tool(s) count not available on this worker"}
OLD_PARKED = {
    "status": "awaiting_approval",
    "attempt": "1",
    "error": "awaiting approval of write_file (c-1): forkq approve f-1 CALL_ID, or forkq deny f-1 CALL_ID",
    "pending": PARKED_JSON,
}


def test_a_state_paused_before_the_waiting_field_reads_its_error_as_the_reason_it_waits() -> None:
    state = ForkState.from_hash("f-1", OLD_PAUSED)

    assert state.waiting_for == ResumeWait(reason="declared tool(s) count not available on this worker")
    assert state.error is None


def test_a_state_parked_on_calls_before_the_waiting_field_waits_on_its_calls_with_no_error() -> None:
    state = ForkState.from_hash("f-1", OLD_PARKED)

    assert isinstance(state.waiting_for, ApprovalWait)
    calls = [(c.call_id, c.name) for c in state.waiting_for.calls]
    assert calls == [("c-1", "write_file"), ("2.1", "run_shell_command")]
    assert state.error is None and state.pending_approval == PARKED


def test_a_fork_that_is_not_parked_waits_for_nothing_whatever_its_hash_kept() -> None:
    cancelled = ForkState.from_hash("f-1", {**OLD_PAUSED, "status": "cancelled", "waiting": "x", "error": "cancelled"})

    assert (cancelled.waiting_for, cancelled.error) == (None, "cancelled")


# a result as the code before cached input tokens wrote it (ForkResult.encode)
OLD_RESULT = base64.b64decode(
    "hqVlcnJvcsCnZm9ya19pZKNmLTGmb3V0cHV0pGRvbmWuc2NoZW1hX3ZlcnNpb24BpnN0YXR1c6lzdWNjZWVkZWSldXNhZ2WGq2R1cmF0"
    "aW9uX21zzQTSrGlucHV0X3Rva2Vuc80E0qttb2RlbF9jYWxscwKtb3V0cHV0X3Rva2VucyKpdG9vbF91c2VzA6x0b3RhbF90b2tlbnPNBPQ="
)


def test_a_result_written_before_cached_tokens_were_counted_reads_them_as_zero() -> None:
    result = ForkResult.decode(OLD_RESULT, fork_id="f-1")

    assert (result.status, result.output) == (Status.SUCCEEDED, "done")
    assert result.usage.model_dump() == {
        "input_tokens": 1234,
        "output_tokens": 34,
        "total_tokens": 1268,
        "tool_uses": 3,
        "model_calls": 2,
        "duration_ms": 1234,
        "cached_input_tokens": 0,
    }


# journal entries as the code before `JournalEntry.content` was a typed Content wrote them (a wire dict): a model
# response with thoughts, signatures, a call whose arguments hold nulls, media, unknown keys, cached tokens, a
# garbled call and a finish reason; a delivered message (UTF-8); a feedback; a tool result holding a null
OLD_ENTRIES = [
    "i7NjYWNoZWRfaW5wdXRfdG9rZW5zzQQAp2NvbnRlbnSDpXBhcnRzlIOkdGV4dKh0aGlua2luZ6d0aG91Z2h0w7B0aG91Z2h0U2lnbmF0dXJl"
    "pXNpZy0xgaR0ZXh0qENhbGxpbmcugqxmdW5jdGlvbkNhbGyDpGFyZ3ODpGRlZXCBoXiTAcDLQAQAAAAAAAClbGltaXTApHBhdGikYS5weaJp"
    "ZKJjMaRuYW1lqXJlYWRfZmlsZbB0aG91Z2h0U2lnbmF0dXJlpXNpZy0ygqppbmxpbmVEYXRhgqRkYXRhrGlWQk9SdzBLR2dvPahtaW1lVHlw"
    "ZalpbWFnZS9wbmemeFRyYWNlgaFhwKxwcm92aWRlck1ldGGka2VwdKRyb2xlpW1vZGVsrWZpbmlzaF9yZWFzb26mbGVuZ3RorGlucHV0X3Rv"
    "a2Vuc80EsK1pbnZhbGlkX2NhbGxzgaJjOadnYXJibGVkpGtpbmSlbW9kZWytb3V0cHV0X3Rva2VucyKucmVxdWVzdF9kaWdlc3TZQGFiYWJh"
    "YmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWKuc2NoZW1hX3ZlcnNpb24Bo3NlcQGk"
    "c3RlcAA=",
    "h6djb250ZW50gqVwYXJ0c5GBpHRleHS+QWxzbyBjaGVjayBiLnB5LCDDvG7Dr2NvZGUg4pyTpHJvbGWkdXNlcqxpbnB1dF90b2tlbnMApGtp"
    "bmSnbWVzc2FnZa1vdXRwdXRfdG9rZW5zAK5zY2hlbWFfdmVyc2lvbgGjc2VxAqRzdGVwAA==",
    "h6djb250ZW50gqVwYXJ0c5GBpHRleHSpTm90IEpTT04upHJvbGWkdXNlcqxpbnB1dF90b2tlbnMApGtpbmSoZmVlZGJhY2utb3V0cHV0X3Rv"
    "a2VucwCuc2NoZW1hX3ZlcnNpb24Bo3NlcQOkc3RlcAA=",
    "iqdjYWxsX2lkomMxqmNhbGxfaW5kZXgArGlucHV0X3Rva2VucwCka2luZKt0b29sX3Jlc3VsdKRuYW1lqXJlYWRfZmlsZa1vdXRwdXRfdG9r"
    "ZW5zAKhyZXNwb25zZYGmb3V0cHV0gaVsaW5lc5KheMCuc2NoZW1hX3ZlcnNpb24Bo3NlcQSkc3RlcAA=",
]


@pytest.mark.parametrize("stored", OLD_ENTRIES)
def test_a_journal_entry_written_before_its_content_was_typed_decodes_and_encodes_to_the_same_bytes(
    stored: str,
) -> None:
    data = base64.b64decode(stored)

    entry = JournalEntry.decode(data, fork_id="f-1")

    assert entry.encode() == data
    assert entry.content is None or isinstance(entry.content, Content)
    # the same entry built anew from its wire dict gives the same bytes too
    raw = codec.decode(data)
    assert JournalEntry.model_validate(raw).encode() == data


def test_an_old_model_entry_reads_its_content_typed_keeping_nulls_in_arguments_and_unknown_keys() -> None:
    entry = JournalEntry.decode(base64.b64decode(OLD_ENTRIES[0]), fork_id="f-1")

    assert entry.kind is EntryKind.MODEL and entry.content is not None
    thought, text, call, media = entry.content.parts
    assert (thought.thought, thought.thought_signature, text.text) == (True, "sig-1", "Calling.")
    assert call.function_call is not None and call.function_call.args == {
        "path": "a.py",
        "limit": None,
        "deep": {"x": [1, None, 2.5]},
    }
    assert media.inline_data is not None and media.model_extra == {"xTrace": {"a": None}}
    assert entry.content.model_extra == {"providerMeta": "kept"}

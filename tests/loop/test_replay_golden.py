"""Replay reads journals written before `workers.loop.replay`: literal bytes, literal requests, literal history.

`test_replay` checks that a live run and a replay of its journal agree; both go through today's
`Conversation.apply`, so a change in it shows on both sides. The literals below were written by the loop
before replay moved into `workers.loop` (when the live loop kept its own state): a fork launched with a
schema and the `park` approval policy whose first response garbled one call and asked to write with
the other, a person approved the write, the worker was lost while it ran, and the revived run answered
it as interrupted; then a response ended as a malformed call, and a final answer failed the schema and
got feedback before the one that passed. Today's replay of those entries must rebuild the very
requests (digest for digest) and history the old loop made, and a run revived from the lost worker's
journal must write the same entry bytes.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Final

import pytest

from tests.records.test_journal import MemoryJournal
from workers.base import codec
from workers.errors import RecordDecodeError
from workers.history.messages import Content
from workers.history.selection import ForkSeed
from workers.loop.child import ChildLoop, model_request
from workers.loop.replay import replay
from workers.providers import ModelRequest, ModelResponse, TokenUsage
from workers.records.fork import BootstrapRecord
from workers.records.journal import JournalEntry, RequestDigests
from workers.tools.registry import Tool, ToolContext, ToolRegistry

FORK_ID: Final = "f-golden"
# the stored bootstrap record, its context chunk (system instruction, tool declarations: `lookup`, `write`)
# and the seed (msgpack), as the old code wrote them
RECORD: Final = base64.b64decode(
    "3gATrWFwcHJvdmFsX21vZGWnZGVmYXVsdK1jb250ZXh0X2NodW5rxCDLMQHSLa33aJVmF8NkOuJ4y01ZQCIfz8hbfgebMTBtOKNj"
    "d2ShL6VkZXB0aACrZGVzY3JpcHRpb26mZ29sZGVuqWRpcmVjdGl2ZbBUaWR5IHRoZSBjb25maWcup2ZvcmtfaWSoZi1nb2xkZW6q"
    "Zm9ya190dXJuc8CqZ2VuZXJhdGlvboCka2luZKRmb3JrrW1lc3NhZ2VfY291bnQCpW1vZGVsqnRlc3QtbW9kZWykbmFtZcCnb3B0"
    "aW9uc4KvYXBwcm92YWxfcG9saWN5pHBhcmutb3V0cHV0X3NjaGVtYYKocmVxdWlyZWSRom9rpHR5cGWmb2JqZWN0rnBhcmVudF9z"
    "ZXNzaW9uqHMtZ29sZGVurnNjaGVtYV92ZXJzaW9uAatzZWVkX2NodW5rc5Ctc3ViYWdlbnRfdHlwZcCrdGFza19wcm9tcHSmQmVn"
    "aW4u"
)
CONTEXT: Final = base64.b64decode(
    "grJzeXN0ZW1faW5zdHJ1Y3Rpb27AqnRvb2xzX2pzb27Zo1t7Im5hbWUiOiJsb29rdXAiLCJkZXNjcmlwdGlvbiI6IlRoZSBsb29r"
    "dXAgdG9vbC4iLCJwYXJhbWV0ZXJzIjp7InR5cGUiOiJvYmplY3QifX0seyJuYW1lIjoid3JpdGUiLCJkZXNjcmlwdGlvbiI6IlRo"
    "ZSB3cml0ZSB0b29sLiIsInBhcmFtZXRlcnMiOnsidHlwZSI6Im9iamVjdCJ9fV0="
)
SEED: Final = base64.b64decode(
    "g7Bpbml0aWFsX21lc3NhZ2VzkoKlcGFydHORgaR0ZXh0t1BsZWFzZSB0aWR5IHRoZSBjb25maWcupHJvbGWkdXNlcoKlcGFydHOR"
    "gaR0ZXh0sUZvcmtpbmcgdGhhdCBvZmYupHJvbGWlbW9kZWyuc2NoZW1hX3ZlcnNpb24Bq3Rhc2tfcHJvbXB0pkJlZ2luLg=="
)
# the journal's entries, in order: surface, model (a garbled call, a call to approve), tool_result (the
# garbled call's error), approval, tool_started (the worker was lost here), tool_result (interrupted),
# model (ended as a malformed call), model (not JSON), feedback, model (the answer)
ENTRIES: Final = [
    base64.b64decode(entry)
    for entry in [
        (
            "h6xpbnB1dF90b2tlbnMApGtpbmSnc3VyZmFjZa1vdXRwdXRfdG9rZW5zAK5zY2hlbWFfdmVyc2lvbgGjc2VxAKRzdGVwAKV0b29s"
            "c5KmbG9va3VwpXdyaXRl"
        ),
        (
            "iadjb250ZW50gqVwYXJ0c5OCpHRleHSsTGV0IG1lIGxvb2sup3Rob3VnaHTDgaxmdW5jdGlvbkNhbGyDpGFyZ3OAomlkpGMwLjCk"
            "bmFtZaZsb29rdXCBrGZ1bmN0aW9uQ2FsbIOkYXJnc4GkcGF0aKVhLmNmZ6JpZKRjMC4xpG5hbWWld3JpdGWkcm9sZaVtb2RlbKxp"
            "bnB1dF90b2tlbnNkrWludmFsaWRfY2FsbHOBpGMwLjDZMmFyZ3VtZW50cyBvZiBsb29rdXAgYXJlIG5vdCBhIEpTT04gb2JqZWN0"
            "OiAne29vcHMnpGtpbmSlbW9kZWytb3V0cHV0X3Rva2VucxSucmVxdWVzdF9kaWdlc3TZQDhmNDcwNjEzZjY2Y2JlN2Y1YWQxMDEx"
            "M2QwNjNkMDdjYzhmZjdmZjIyYWU3NjVkZTc5YWZlYzgyNmZmODM2Nzmuc2NoZW1hX3ZlcnNpb24Bo3NlcQGkc3RlcAA="
        ),
        (
            "iqdjYWxsX2lkpGMwLjCqY2FsbF9pbmRleACsaW5wdXRfdG9rZW5zAKRraW5kq3Rvb2xfcmVzdWx0pG5hbWWmbG9va3VwrW91dHB1"
            "dF90b2tlbnMAqHJlc3BvbnNlgaVlcnJvctkyYXJndW1lbnRzIG9mIGxvb2t1cCBhcmUgbm90IGEgSlNPTiBvYmplY3Q6ICd7b29w"
            "cyeuc2NoZW1hX3ZlcnNpb24Bo3NlcQKkc3RlcAA="
        ),
        (
            "iqdjYWxsX2lkpGMwLjGqY2FsbF9pbmRleAGoZGVjaXNpb26nYXBwcm92ZaxpbnB1dF90b2tlbnMApGtpbmSoYXBwcm92YWykbmFt"
            "ZaV3cml0Za1vdXRwdXRfdG9rZW5zAK5zY2hlbWFfdmVyc2lvbgGjc2VxA6RzdGVwAA=="
        ),
        (
            "iadjYWxsX2lkpGMwLjGqY2FsbF9pbmRleAGsaW5wdXRfdG9rZW5zAKRraW5krHRvb2xfc3RhcnRlZKRuYW1lpXdyaXRlrW91dHB1"
            "dF90b2tlbnMArnNjaGVtYV92ZXJzaW9uAaNzZXEEpHN0ZXAA"
        ),
        (
            "iqdjYWxsX2lkpGMwLjGqY2FsbF9pbmRleAGsaW5wdXRfdG9rZW5zAKRraW5kq3Rvb2xfcmVzdWx0pG5hbWWld3JpdGWtb3V0cHV0"
            "X3Rva2VucwCocmVzcG9uc2WBpWVycm9y2aRUaGlzIHRvb2wgY2FsbCB3YXMgaW50ZXJydXB0ZWQ6IHRoZSB3b3JrZXIgcnVubmlu"
            "ZyBpdCBzdG9wcGVkIGJlZm9yZSBpdCBmaW5pc2hlZC4gSXQgbWF5IG9yIG1heSBub3QgaGF2ZSB0YWtlbiBlZmZlY3Q7IGNoZWNr"
            "IHRoZSBjdXJyZW50IHN0YXRlIGJlZm9yZSB5b3UgcmVwZWF0IGl0Lq5zY2hlbWFfdmVyc2lvbgGjc2VxBaRzdGVwAA=="
        ),
        (
            "iadjb250ZW50gqVwYXJ0c5GBpHRleHSqY2FsbGluZy4uLqRyb2xlpW1vZGVsrWZpbmlzaF9yZWFzb263bWFsZm9ybWVkX2Z1bmN0"
            "aW9uX2NhbGysaW5wdXRfdG9rZW5zeKRraW5kpW1vZGVsrW91dHB1dF90b2tlbnMFrnJlcXVlc3RfZGlnZXN02UA0YWUxNzc4YWYz"
            "M2VkMTBlZGQ1YjU0N2M3NzA1NzQxODZlZmFkY2Y3MTE3Nzc2ZTM1MGVlM2Q4NmE4ZTE3NjNhrnNjaGVtYV92ZXJzaW9uAaNzZXEG"
            "pHN0ZXAB"
        ),
        (
            "iKdjb250ZW50gqVwYXJ0c5GBpHRleHSobm90IGpzb26kcm9sZaVtb2RlbKxpbnB1dF90b2tlbnPMgqRraW5kpW1vZGVsrW91dHB1"
            "dF90b2tlbnMDrnJlcXVlc3RfZGlnZXN02UAzZTAyMzQ1MGZmZjIxODQ4ZmJjMTllMjNhMjdhZTg4ZjNkY2I1Y2Q4NTdjMWIyZTJi"
            "Mzk1MDUyOTNjZWJmMWIzrnNjaGVtYV92ZXJzaW9uAaNzZXEHpHN0ZXAC"
        ),
        (
            "h6djb250ZW50gqVwYXJ0c5GBpHRleHTZx1lvdXIgZmluYWwgYW5zd2VyIGRvZXMgbm90IG1hdGNoIHRoZSByZXF1aXJlZCBvdXRw"
            "dXQgc2NoZW1hOiB0aGUgYW5zd2VyIGlzIG5vdCBKU09OIChFeHBlY3RpbmcgdmFsdWUgYXQgbGluZSAxIGNvbHVtbiAxKS4gUmVw"
            "bHkgYWdhaW4gd2l0aCBvbmx5IGEgSlNPTiB2YWx1ZSB0aGF0IG1hdGNoZXMgdGhlIHNjaGVtYSwgYW5kIG5vdGhpbmcgZWxzZS6k"
            "cm9sZaR1c2VyrGlucHV0X3Rva2VucwCka2luZKhmZWVkYmFja61vdXRwdXRfdG9rZW5zAK5zY2hlbWFfdmVyc2lvbgGjc2VxCKRz"
            "dGVwAw=="
        ),
        (
            "iKdjb250ZW50gqVwYXJ0c5GBpHRleHSseyJvayI6IHRydWV9pHJvbGWlbW9kZWysaW5wdXRfdG9rZW5zzIyka2luZKVtb2RlbK1v"
            "dXRwdXRfdG9rZW5zBK5yZXF1ZXN0X2RpZ2VzdNlAYmQwYWI1Njg5MzZiOWFhNzU5OGI4YTdjMDEwYTNkYTcwODU4NDk1OGNhNDkx"
            "MDhlMzI2MDZlNTBmYzJiOTc5NK5zY2hlbWFfdmVyc2lvbgGjc2VxCaRzdGVwAw=="
        ),
    ]
]
LOST_AT: Final = 5  # the entries the lost worker wrote: its write's tool_started is the last
# the digest of the model request made before each model entry (by position), as the old loop computed it
DIGESTS: Final = {
    1: "8f470613f66cbe7f5ad10113d063d07cc8ff7ff22ae765de79afec826ff83679",
    6: "4ae1778af33ed10edd5b547c770574186efadcf7117776e350ee3d86a8e1763a",
    7: "3e023450fff21848fbc19e23a27ae88f3dcb5cd857c1b2e2b39505293cebf1b3",
    9: "bd0ab568936b9aa7598b8a7c010a3da708584958ca49108e32606e50fc2b9794",
}
# the fork's whole history after the last entry, as wire Contents
MESSAGES: Final = json.loads(
    '[{"role": "user", "parts": [{"text": "Please tidy the config."}]}, {"role": "model", "parts": [{'
    '"text": "Forking that off."}]}, {"role": "user", "parts": [{"text": "Begin."}]}, {"role": "model'
    '", "parts": [{"text": "Let me look.", "thought": true}, {"functionCall": {"id": "c0.0", "name": '
    '"lookup", "args": {}}}, {"functionCall": {"id": "c0.1", "name": "write", "args": {"path": "a.cfg'
    '"}}}]}, {"role": "user", "parts": [{"functionResponse": {"id": "c0.0", "name": "lookup", "respon'
    'se": {"error": "arguments of lookup are not a JSON object: \'{oops\'"}}}, {"functionResponse": {"i'
    'd": "c0.1", "name": "write", "response": {"error": "This tool call was interrupted: the worker r'
    "unning it stopped before it finished. It may or may not have taken effect; check the current sta"
    'te before you repeat it."}}}]}, {"role": "model", "parts": [{"text": "calling..."}]}, {"role": "'
    'user", "parts": [{"text": "Your last function call was malformed and could not be parsed, so not'
    'hing was run. Call the tool again with valid arguments, or answer in text."}]}, {"role": "model"'
    ', "parts": [{"text": "not json"}]}, {"role": "user", "parts": [{"text": "Your final answer does '
    "not match the required output schema: the answer is not JSON (Expecting value at line 1 column 1"
    '). Reply again with only a JSON value that matches the schema, and nothing else."}]}, {"role": "'
    'model", "parts": [{"text": "{\\"ok\\": true}"}]}]'
)
OUTPUT: Final = '{"ok": true}'
# the old loop counted no cached tokens: its journal has none, so today's usage reads 0
USAGE: Final = {
    "input_tokens": 490,
    "output_tokens": 32,
    "total_tokens": 522,
    "tool_uses": 2,
    "model_calls": 4,
    "cached_input_tokens": 0,
}


def inputs() -> tuple[BootstrapRecord, ForkSeed, list[JournalEntry]]:
    """The golden record, seed and journal, read with today's code."""
    record = BootstrapRecord.decode(RECORD, fork_id=FORK_ID, context=CONTEXT, expected_digest=codec.digest(RECORD))
    seed = ForkSeed.from_wire(codec.decode(SEED, what="golden seed"))
    return record, seed, [JournalEntry.decode(raw, fork_id=FORK_ID) for raw in ENTRIES]


def digest_of(record: BootstrapRecord, step: int, messages: list[Content]) -> str:
    """The digest a live loop journals for its request of `step` over `messages`."""
    return RequestDigests().digest(model_request(record, record.tools, step, messages))


def test_replay_before_each_model_entry_rebuilds_the_request_the_old_loop_made() -> None:
    record, seed, entries = inputs()

    # When the journal before each model entry is replayed
    rebuilt = {}
    for k, entry in enumerate(entries):
        if entry.kind == "model":
            state = replay(seed, entries[:k])
            assert (state.step, state.pending, state.final) == (entry.step, [], None), k
            rebuilt[k] = digest_of(record, state.step, state.messages)

    # Then each request is the one the old loop made and journalled
    assert rebuilt == DIGESTS
    assert {k: entries[k].request_digest for k in DIGESTS} == DIGESTS


def test_replay_of_the_whole_journal_rebuilds_the_old_history_and_usage() -> None:
    _, seed, entries = inputs()

    state = replay(seed, entries)

    assert [m.to_wire() for m in state.messages] == MESSAGES
    assert (
        state.step,
        state.usage.tool_uses,
        state.usage.input_tokens,
        state.usage.output_tokens,
        state.feedbacks,
    ) == (
        USAGE["model_calls"],
        USAGE["tool_uses"],
        USAGE["input_tokens"],
        USAGE["output_tokens"],
        1,
    )
    assert state.final is not None and state.final.to_wire() == MESSAGES[-1]
    assert (state.pending, state.next_seq) == ([], len(ENTRIES))


@dataclass
class Recorded:
    """Answers each step with the response its model entry recorded; keeps each request's step."""

    entries: list[JournalEntry]
    steps: list[int] = field(default_factory=list)
    name: str = "recorded"

    def generate(self, request: ModelRequest) -> ModelResponse:
        self.steps.append(request.step)
        entry = next(e for e in self.entries if e.kind == "model" and e.step == request.step)
        usage = TokenUsage(input_tokens=entry.input_tokens, output_tokens=entry.output_tokens)
        finish = entry.finish_reason or "stop"
        return ModelResponse(
            content=Content.model_validate(entry.content),
            usage=usage,
            finish_reason=finish,
            invalid_calls=entry.invalid_calls or {},
        )


def never_run(args: Any, _: ToolContext) -> Any:
    raise AssertionError(f"a tool ran on revival: {args}")


def test_a_run_revived_from_the_lost_workers_journal_writes_the_old_entries_byte_for_byte() -> None:
    record, seed, entries = inputs()
    tools = ToolRegistry()
    tools.register(Tool("lookup", "Read something.", {"type": "object"}, never_run))
    tools.register(Tool("write", "Change something.", {"type": "object"}, never_run, mutating=True))
    provider = Recorded(entries)
    journal = MemoryJournal(entries=entries[:LOST_AT])

    # When today's loop is revived from the journal the lost worker left (its write started, unanswered)
    loop = ChildLoop(record=record, seed=seed, provider=provider, tools=tools, io=journal, entries=entries[:LOST_AT])
    result = loop.run()

    # Then it answers the write as interrupted and asks the model what the old loop asked, entry for entry
    assert [entry.encode() for entry in journal.entries] == ENTRIES
    assert provider.steps == [1, 2, 3]
    assert loop.state is not None and [m.to_wire() for m in loop.state.messages] == MESSAGES
    assert (result.output, result.error) == (OUTPUT, None)
    assert result.usage.model_dump(exclude={"duration_ms"}) == USAGE


# ── damaged journals ──────────────────────────────────────────────────────────────────────────


def test_a_model_entry_while_calls_wait_for_their_results_is_a_damaged_journal() -> None:
    _, seed, entries = inputs()
    # the next step's model entry right after the garbled call's error: the write was never answered
    damaged = [*entries[:3], entries[6].model_copy(update={"seq": 3})]

    with pytest.raises(RecordDecodeError, match=r"fork f-golden: journal entry 3 \(model\).*calls 1 of step 0") as info:
        replay(seed, damaged, fork_id=FORK_ID)
    assert info.value.fork_id == FORK_ID


def test_a_second_result_for_an_answered_call_is_a_damaged_journal() -> None:
    _, seed, entries = inputs()
    damaged = [*entries[:3], entries[2].model_copy(update={"seq": 3})]  # the garbled call's error, twice

    with pytest.raises(RecordDecodeError, match=r"fork f-golden: journal entry 3 \(tool_result\).*call 0 .*second"):
        replay(seed, damaged, fork_id=FORK_ID)


def test_a_result_for_a_call_the_step_did_not_make_is_a_damaged_journal() -> None:
    _, seed, entries = inputs()
    damaged = [*entries[:3], entries[2].model_copy(update={"seq": 3, "call_index": 7})]

    with pytest.raises(RecordDecodeError, match=r"fork f-golden: journal entry 3 \(tool_result\).*call 7"):
        replay(seed, damaged, fork_id=FORK_ID)

"""The journal's fold (workers/records/conversation.py): every entry kind has its meaning there, once.

The loop's replay, the usage of a cancel, inspect's exchanges, the transcript and the runner's checks all
read this one fold; here each kind's effect, the strict and the lenient fold of a damaged journal, the
exchanges of a continued fork and the usage of each exchange. How the cancel script's own tally agrees
with it: test_forks.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from workers.errors import RecordDecodeError
from workers.history.messages import Content, Part
from workers.records.conversation import (
    MALFORMED_CALL,
    Approval,
    Conversation,
    Decision,
    Delivered,
    Feedback,
    ModelTurn,
    ToolResult,
    exchanges,
    fold,
    is_final_answer,
    journal_usage,
    recorded_surface,
)
from workers.records.journal import EntryKind, JournalEntry


def model_entry(seq: int, step: int, *parts: dict[str, Any], tokens: int = 10, **fields: Any) -> JournalEntry:
    content = Content.model_validate({"role": "model", "parts": list(parts)})
    return JournalEntry(
        seq=seq, step=step, kind=EntryKind.MODEL, content=content, input_tokens=tokens, output_tokens=1, **fields
    )


def call(call_id: str, name: str = "lookup") -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": name, "args": {}}}


def user_entry(seq: int, step: int, kind: EntryKind, text: str) -> JournalEntry:
    return JournalEntry(seq=seq, step=step, kind=kind, content=Content(role="user", parts=[Part(text=text)]))


def result_entry(seq: int, step: int, index: int, call_id: str, response: dict[str, Any]) -> JournalEntry:
    return JournalEntry(
        seq=seq,
        step=step,
        kind=EntryKind.TOOL_RESULT,
        call_index=index,
        call_id=call_id,
        name="lookup",
        response=response,
    )


ASKING = model_entry(0, 0, {"text": "Looking."}, call("c1"))  # a step with one call
ANSWERED = model_entry(0, 0, {"text": "Done."})  # a final answer


def _check_model(state: Conversation) -> None:
    assert (state.step, len(state.messages), [p.index for p in state.pending]) == (1, 1, [0])
    assert (state.usage.model_calls, state.usage.input_tokens, state.usage.total_tokens) == (1, 10, 11)
    assert isinstance(state.steps[-1], ModelTurn) and state.steps[-1].calls == state.calls


def _check_result(state: Conversation) -> None:
    assert (state.pending, state.usage.tool_uses, len(state.messages)) == ([], 1, 2)
    assert state.messages[-1].parts[0].function_response is not None
    assert isinstance(state.steps[-1], ToolResult) and state.steps[-1].response == {"output": "ok"}


def _check_feedback(state: Conversation) -> None:
    assert (state.final, state.feedbacks, state.messages[-1].parts[0].text) == (None, 1, "Not JSON.")
    assert isinstance(state.steps[-1], Feedback)


def _check_message(state: Conversation) -> None:
    assert (len(state.exchanges), state.exchange_step, state.final) == (2, 1, None)
    assert isinstance(state.steps[-1], Delivered) and state.messages[-1].parts[0].text == "And then?"


# kind: (the entries before, an entry of that kind, what applying it must have done)
EXAMPLES: dict[EntryKind, tuple[list[JournalEntry], JournalEntry, Callable[[Conversation], None]]] = {
    EntryKind.SURFACE: (
        [],
        JournalEntry(seq=0, step=0, kind=EntryKind.SURFACE, tools=["lookup"]),
        lambda state: assert_equal(state.surface, ["lookup"]),
    ),
    EntryKind.MODEL: ([], ASKING, _check_model),
    EntryKind.TOOL_STARTED: (
        [ASKING],
        JournalEntry(seq=1, step=0, kind=EntryKind.TOOL_STARTED, call_index=0, call_id="c1", name="lookup"),
        lambda state: assert_equal([p.started for p in state.pending], [True]),
    ),
    EntryKind.TOOL_RESULT: ([ASKING], result_entry(1, 0, 0, "c1", {"output": "ok"}), _check_result),
    EntryKind.APPROVAL: (
        [ASKING],
        JournalEntry(seq=1, step=0, kind=EntryKind.APPROVAL, call_index=0, call_id="c1", decision="deny", reason="no"),
        lambda state: assert_equal((state.decisions, type(state.steps[-1])), ({0: Decision("deny", "no")}, Approval)),
    ),
    EntryKind.FEEDBACK: ([ANSWERED], user_entry(1, 1, EntryKind.FEEDBACK, "Not JSON."), _check_feedback),
    EntryKind.MESSAGE: ([ANSWERED], user_entry(1, 1, EntryKind.MESSAGE, "And then?"), _check_message),
}


def assert_equal(actual: object, expected: object) -> None:
    assert actual == expected


@pytest.mark.parametrize("kind", list(EntryKind))
def test_the_fold_gives_every_entry_kind_its_meaning(kind: EntryKind) -> None:
    # a kind added to EntryKind without a meaning in the fold fails here (and `apply` fails mypy's exhaustiveness)
    assert kind in EXAMPLES, f"entry kind {kind!r} has no example: add one, and its case in Conversation.apply"
    before, entry, check = EXAMPLES[kind]
    assert entry.kind is kind
    state = fold(before)

    state.apply(entry)

    check(state)
    assert state.next_seq == entry.seq + 1


def test_an_entry_kind_is_stored_as_the_word_it_always_was() -> None:
    entry = JournalEntry(seq=0, step=0, kind=EntryKind.TOOL_STARTED, call_index=0)

    assert b"\xactool_started" in entry.encode()
    assert JournalEntry.decode(entry.encode(), fork_id="f-1").kind is EntryKind.TOOL_STARTED
    assert [k.value for k in EntryKind] == [
        "surface",
        "model",
        "tool_started",
        "tool_result",
        "approval",
        "feedback",
        "message",
    ]


DAMAGED = [
    model_entry(0, 0, call("c1"), call("c2")),
    result_entry(1, 0, 0, "c1", {"output": "ok"}),
    result_entry(2, 0, 0, "c1", {"output": "again"}),  # call 0 answered a second time
    result_entry(3, 0, 7, "c7", {"output": "never made"}),  # a call the step did not make
    user_entry(4, 1, EntryKind.MESSAGE, "while calls wait"),  # call 1 still waits
    model_entry(5, 1, {"text": "Done."}),  # a model response while call 1 waits
]


def test_a_strict_fold_refuses_a_damaged_journal_naming_the_fork_and_the_entry() -> None:
    with pytest.raises(RecordDecodeError, match=r"fork f-9: journal entry 2 \(tool_result\) answers call 0"):
        Conversation(fork_id="f-9").fold(DAMAGED)


def test_a_lenient_fold_counts_a_damaged_journal_and_shows_every_step() -> None:
    state = fold(DAMAGED)

    assert (state.usage.model_calls, state.usage.tool_uses, state.usage.input_tokens) == (2, 3, 20)
    assert [type(s).__name__ for s in state.steps] == [
        "ModelTurn",
        "ToolResult",
        "ToolResult",
        "ToolResult",
        "Delivered",
        "ModelTurn",
    ]
    # the messages keep only what a run could have written: the step's calls, then the last response
    assert [m.role for m in state.messages] == ["model", "model"]
    assert state.final is not None and state.final.parts[0].text == "Done."
    assert journal_usage([e.encode() for e in DAMAGED], "f-9") == state.usage


def test_a_continued_forks_exchanges_have_their_messages_answers_and_usage() -> None:
    # Given a fork that answered, was sent a message, got one more while it worked, and answered again
    entries = [
        ANSWERED,
        user_entry(1, 1, EntryKind.MESSAGE, "And then?"),
        model_entry(2, 1, {"text": "Checking.", "thought": True}, call("c2"), tokens=30),
        result_entry(3, 1, 0, "c2", {"output": "ok"}),
        user_entry(4, 2, EntryKind.MESSAGE, "Also this."),
        model_entry(5, 2, {"text": "Both done."}, tokens=50),
    ]

    state = fold(entries)

    # Then there are two exchanges, the second with the message delivered while it ran
    assert exchanges("Do it.", entries) == [
        {"message": "Do it.", "during": [], "answer": "Done."},
        {"message": "And then?", "during": ["Also this."], "answer": "Both done."},
    ]
    first, second = state.exchanges
    assert (first.usage.model_calls, first.usage.input_tokens, first.usage.tool_uses) == (1, 10, 0)
    assert (second.usage.model_calls, second.usage.input_tokens, second.usage.tool_uses) == (2, 80, 1)
    assert (state.usage.model_calls, state.usage.input_tokens, state.exchange_step) == (3, 90, 1)


def test_a_message_after_an_answer_sent_back_or_a_malformed_call_stays_in_the_exchange() -> None:
    # the fork was still at work on its task: neither answer ended the exchange (the loop counts its turns on)
    entries = [
        ANSWERED,
        user_entry(1, 1, EntryKind.FEEDBACK, "Not JSON."),
        user_entry(2, 1, EntryKind.MESSAGE, "Hurry."),
        model_entry(3, 1, {"text": "calling..."}, finish_reason=MALFORMED_CALL),
        user_entry(4, 2, EntryKind.MESSAGE, "Still there?"),
    ]

    assert exchanges("Do it.", entries) == [{"message": "Do it.", "during": ["Hurry.", "Still there?"], "answer": None}]


def test_a_final_answer_is_a_model_response_without_calls_that_ended_normally() -> None:
    assert is_final_answer(ANSWERED)
    assert not is_final_answer(ASKING)
    assert not is_final_answer(model_entry(0, 0, {"text": "cut"}, finish_reason="length"))
    assert not is_final_answer(user_entry(0, 0, EntryKind.MESSAGE, "Done."))


def test_the_recorded_surface_read_alone_is_the_folds_surface() -> None:
    # Given journals without a surface, with one, with an empty one, and with a second one after the first
    first = JournalEntry(seq=0, step=0, kind=EntryKind.SURFACE, tools=["lookup"])
    empty = JournalEntry(seq=0, step=0, kind=EntryKind.SURFACE)
    later = JournalEntry(seq=2, step=1, kind=EntryKind.SURFACE, tools=["other"])
    journals = [[], [ASKING], [first], [empty, ASKING], [first, ASKING, later]]
    # Then reading the surface alone gives what the whole fold gives
    assert [recorded_surface(j) for j in journals] == [fold(j).surface for j in journals]
    assert [recorded_surface(j) for j in journals] == [None, None, ["lookup"], [], ["lookup"]]


def test_journal_usage_counts_model_calls_tokens_and_tool_uses_and_skips_a_damaged_entry() -> None:
    model = {"role": "model", "parts": [{"functionCall": {"id": "c1", "name": "t", "args": {}}}]}
    entries = [
        JournalEntry(seq=0, step=0, kind="surface", tools=["t"]).encode(),
        JournalEntry(seq=1, step=0, kind="model", content=model, input_tokens=100, output_tokens=7).encode(),
        JournalEntry(seq=2, step=0, kind="tool_started", call_index=0, call_id="c1", name="t").encode(),
        JournalEntry(seq=3, step=0, kind="tool_result", call_index=0, response={"output": "ok"}).encode(),
        b"\xc1 not msgpack",
        JournalEntry(seq=5, step=1, kind="model", content=model, input_tokens=150, output_tokens=3).encode(),
    ]

    usage = journal_usage(entries, "f-1")

    assert (usage.model_calls, usage.tool_uses, usage.input_tokens, usage.output_tokens) == (2, 1, 250, 10)
    assert (usage.total_tokens, usage.duration_ms) == (260, 0)
    assert journal_usage([], "f-1").model_dump() == {k: 0 for k in usage.model_dump()}


def test_cached_input_tokens_are_summed_and_an_entry_without_them_keeps_its_bytes() -> None:
    model = {"role": "model", "parts": [{"text": "done"}]}
    plain = JournalEntry(seq=0, step=0, kind="model", content=model, input_tokens=100, output_tokens=7)
    cached = JournalEntry(seq=1, step=1, kind="model", content=model, input_tokens=120, cached_input_tokens=96)

    usage = journal_usage([plain.encode(), cached.encode()], "f-1")

    assert (usage.input_tokens, usage.cached_input_tokens) == (220, 96)
    assert b"cached_input_tokens" not in plain.encode()  # what entries were before the field existed
    assert JournalEntry.decode(cached.encode(), fork_id="f-1") == cached

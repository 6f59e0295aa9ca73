"""Examples for workers.history.selection, one or more per rule and trap of docs/fork-history.md (§1-§6)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.factories import (
    ACK_TEXT,
    ATTACHMENT_PREFIXES,
    BEGIN,
    LEGACY_ACK,
    PLACEHOLDER_OUTPUT,
    SUMMARY_ACK,
    SUMMARY_TEXT,
    agent_call,
    all_texts,
    call,
    calls,
    containers,
    dump,
    legacy_startup,
    media,
    model,
    reminder,
    reminder_text,
    response,
    responses,
    summary,
    text,
    texts,
    thought,
    tool_round,
    user,
    wire,
)
from workers.errors import InvalidAgentParams
from workers.history.messages import Content
from workers.history.selection import (
    FORK_INSTRUCTIONS,
    ForkSeed,
    build_fork_seed,
    curate_history,
    is_real_user_turn,
    is_system_reminder_content,
    startup_context_length,
)

DIRECTIVE = "Directive: rename parse_args to parse_cli everywhere."
FORK_TURNS_VALUE_MESSAGE = 'Parameter "fork_turns" must be "all" or a positive integer string such as "3".'


def seed_of(history: list[Content], fork_turns: str | None = None, directive: str = DIRECTIVE) -> ForkSeed:
    return build_fork_seed(history, fork_turns=fork_turns, directive=directive)


def carries_directive(value: str, directive: str = DIRECTIVE) -> bool:
    """The fork instructions and the directive are both in `value`."""
    return directive in value and FORK_INSTRUCTIONS in value


def two_turn_history() -> list[Content]:
    """Startup reminder, two real user turns, ending with the model's Agent call."""
    return [
        reminder("cwd /repo, os linux"),
        user("first task: add a --verbose flag"),
        model("Added the flag."),
        user("second task: rename parse_args"),
        model(agent_call("c-fork", DIRECTIVE)),
    ]


# ── §1 system reminders ───────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("count", [1, 3])
def test_a_content_whose_every_part_is_a_reminder_is_a_pure_reminder(count: int) -> None:
    assert is_system_reminder_content(reminder(*(f"note {i}" for i in range(count))))


def test_a_prompt_that_contains_a_reminder_followed_by_more_text_is_not_a_reminder() -> None:
    assert not is_system_reminder_content(user(reminder_text("skills: none") + "\nNow fix the bug."))


@pytest.mark.parametrize("trailing", ["\n", "  \n\t", "\r\n\n"])
def test_a_reminder_followed_only_by_trailing_whitespace_is_a_reminder(trailing: str) -> None:
    assert is_system_reminder_content(user(reminder_text("env") + trailing))


def test_a_reminder_with_leading_whitespace_does_not_start_with_the_tag_and_is_not_a_reminder() -> None:
    assert not is_system_reminder_content(user(" " + reminder_text("env")))


def test_a_text_that_only_ends_with_the_closing_tag_is_not_a_reminder() -> None:
    assert not is_system_reminder_content(user("env</system-reminder>"))


def test_a_content_without_parts_is_not_a_pure_reminder() -> None:
    assert not is_system_reminder_content(user())


@pytest.mark.parametrize("other", ["plain prompt", media(), response("c1")], ids=["text", "media", "response"])
def test_a_reminder_next_to_any_other_part_is_not_a_pure_reminder(other: Any) -> None:
    assert not is_system_reminder_content(user(reminder_text("env"), other))


# ── §2 startup detection ──────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("body", ["cwd /repo", "Skills: pdf, docx", "MCP server github: use it for PRs", ""])
def test_a_pure_reminder_at_index_0_is_a_startup_context_of_length_1_whatever_it_says(body: str) -> None:
    history = [reminder(body), user("fix the bug"), model("done")]
    assert startup_context_length(history) == 1


def test_a_user_content_followed_by_the_exact_legacy_acknowledgement_is_a_startup_pair() -> None:
    assert startup_context_length([*legacy_startup(), user("fix the bug"), model("ok")]) == 2


@pytest.mark.parametrize(
    "ack",
    ["Got it. Thanks for the context", "got it. thanks for the context!", "Got it. Thanks for the context! ", "Sure."],
)
def test_the_legacy_pair_needs_exactly_the_acknowledgement_text(ack: str) -> None:
    assert startup_context_length([user("env: linux"), model(ack), user("hi")]) == 0


def test_the_legacy_acknowledgement_must_be_the_first_part_of_the_model_content() -> None:
    assert startup_context_length([user("env: linux"), model("Hmm.", LEGACY_ACK)]) == 0


def test_the_reminder_form_is_checked_before_the_legacy_pair() -> None:
    # Given a pure reminder at index 0 that is also followed by the legacy acknowledgement
    history = [reminder("env"), model(LEGACY_ACK), user("hi")]
    # Then the reminder form wins: the startup context is the reminder alone
    assert startup_context_length(history) == 1


@pytest.mark.parametrize(
    "history",
    [
        [],
        [user("fix the bug"), model("done")],
        [model(LEGACY_ACK)],
        [user("hi"), reminder("env"), model("ok")],
    ],
    ids=["empty", "plain-prompt", "model-first", "reminder-not-at-0"],
)
def test_a_history_without_a_startup_prefix_has_startup_length_0(history: list[Content]) -> None:
    assert startup_context_length(history) == 0
    assert startup_context_length(history, include_summary=True) == 0


def test_startup_detection_alone_never_treats_a_summary_as_startup() -> None:
    history = [*summary(attachments="<background-tasks>"), user("go on")]
    assert startup_context_length(history) == 0


def test_startup_detection_alone_stops_at_the_startup_reminder_before_a_summary() -> None:
    assert startup_context_length([reminder("env"), *summary(), user("go on")]) == 1


def test_a_summary_written_as_a_reminder_is_still_a_summary_and_not_startup() -> None:
    # Given a summary whose user Content happens to be a pure reminder
    history = [user(reminder_text(SUMMARY_TEXT)), model(SUMMARY_ACK), user("go on")]
    # Then startup detection alone does not take it for startup; with the summary it is 2 long
    assert startup_context_length(history) == 0
    assert startup_context_length(history, include_summary=True) == 2


# ── §2 summary detection (include_summary) ────────────────────────────────────────────────────


def test_a_summary_and_its_acknowledgement_at_index_0_have_length_2() -> None:
    assert startup_context_length([*summary(), user("go on")], include_summary=True) == 2


@pytest.mark.parametrize("prefix", ATTACHMENT_PREFIXES)
def test_a_summary_followed_by_an_attachments_content_has_length_3_for_each_prefix(prefix: str) -> None:
    assert startup_context_length([*summary(attachments=prefix), model("ok")], include_summary=True) == 3


def test_an_attachments_content_counts_when_any_of_its_parts_starts_with_a_prefix() -> None:
    history = [*summary(), user("Attachments follow.", "<plan-mode-active> read only"), model("ok")]
    assert startup_context_length(history, include_summary=True) == 3


def test_an_attachment_prefix_in_the_middle_of_a_text_does_not_make_an_attachments_content() -> None:
    history = [*summary(), user("please keep <plan-mode-active> in mind"), model("ok")]
    assert startup_context_length(history, include_summary=True) == 2


def test_a_model_call_after_the_attachments_content_makes_the_summary_4_long() -> None:
    history = [*summary(attachments="<background-tasks>", follow_call=True), user(response("c-summary"))]
    assert startup_context_length(history, include_summary=True) == 4


def test_a_model_content_without_a_call_after_the_attachments_is_not_part_of_the_summary() -> None:
    history = [*summary(attachments="<background-tasks>"), model("Looking at the tasks."), user("go")]
    assert startup_context_length(history, include_summary=True) == 3


def test_a_model_call_right_after_the_summary_acknowledgement_is_not_part_of_the_summary() -> None:
    history = [*summary(), model(call("c1")), user(response("c1"))]
    assert startup_context_length(history, include_summary=True) == 2


def test_the_summary_marker_may_stand_anywhere_in_the_first_part_text() -> None:
    history = [user("Context was compacted. Resume the prior task now."), model(SUMMARY_ACK), user("go")]
    assert startup_context_length(history, include_summary=True) == 2


def test_the_summary_marker_outside_the_first_part_is_not_a_summary() -> None:
    history = [user("Context was compacted.", "Resume the prior task"), model(SUMMARY_ACK), user("go")]
    assert startup_context_length(history, include_summary=True) == 0


def test_a_summary_needs_the_exact_acknowledgement() -> None:
    history = [user(SUMMARY_TEXT), model("Got it. Thanks for the additional context"), user("go")]
    assert startup_context_length(history, include_summary=True) == 0


@pytest.mark.parametrize(
    ("summary_contents", "length"),
    [
        (summary(), 2),
        (summary(attachments="<background-tasks>"), 3),
        (summary(attachments="<background-tasks>", follow_call=True), 4),
    ],
    ids=["2", "3", "4"],
)
def test_a_summary_right_after_a_startup_reminder_adds_its_length_to_the_startup(
    summary_contents: list[Content], length: int
) -> None:
    history = [reminder("env"), *summary_contents, user("go on")]
    assert startup_context_length(history, include_summary=True) == 1 + length


def test_a_summary_after_the_legacy_pair_is_not_detected() -> None:
    history = [*legacy_startup(), *summary(attachments="<background-tasks>"), user("go on")]
    assert startup_context_length(history, include_summary=True) == 2


def test_a_summary_later_in_the_conversation_is_not_a_synthetic_prefix() -> None:
    history = [user("hi"), model("hello"), *summary(), user("go on")]
    assert startup_context_length(history, include_summary=True) == 0


# ── §3 curation ───────────────────────────────────────────────────────────────────────────────


def test_curation_merges_adjacent_user_contents_by_concatenating_their_parts() -> None:
    curated = curate_history([user("a"), user("b", media()), model("ok")])
    assert dump(curated) == [wire("user", "a", "b", media()), wire("model", "ok")]


def test_curation_merges_user_contents_across_a_dropped_model_run() -> None:
    # Given a user prompt, an invalid model Content (empty text), then another user prompt
    history = [user("a"), model(""), user("b"), model("ok")]
    # Then the model run is dropped and the two prompts become one user Content
    assert dump(curate_history(history)) == [wire("user", "a", "b"), wire("model", "ok")]


def test_a_merged_user_content_is_a_new_object_and_the_inputs_are_unchanged() -> None:
    first, second = user("a"), user("b")
    before = dump([first, second])
    curated = curate_history([first, second])
    assert curated[0] is not first
    assert curated[0] is not second
    assert curated[0].parts is not first.parts
    assert dump([first, second]) == before


def test_a_model_run_is_dropped_whole_when_any_of_its_contents_is_invalid() -> None:
    history = [user("a"), model("valid answer"), model(call("c1")), model({}), user("b"), model("kept")]
    assert dump(curate_history(history)) == [wire("user", "a", "b"), wire("model", "kept")]


def test_a_model_run_of_valid_contents_is_kept_whole() -> None:
    history = [user("a"), model(thought("plan")), model("answer"), model(call("c1")), user(response("c1"))]
    assert dump(curate_history(history)) == dump(history)


def test_a_model_run_ends_at_the_next_user_content_so_later_runs_are_judged_apart() -> None:
    history = [user("a"), model({}), user("b"), model("ok"), user("c"), model("ok too")]
    assert dump(curate_history(history)) == [
        wire("user", "a", "b"),
        wire("model", "ok"),
        wire("user", "c"),
        wire("model", "ok too"),
    ]


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [{}],
        [{"text": None}],
        [text("")],
        [text("", thought=False)],
        ["fine", text("")],
        ["fine", {}],
    ],
    ids=["no-parts", "empty-part", "null-text-part", "empty-text", "empty-non-thought", "one-empty-text", "one-empty"],
)
def test_a_model_content_is_invalid_without_parts_or_with_an_empty_part_or_empty_text(parts: list[Any]) -> None:
    history = [user("a"), Content.model_validate(wire("model", *parts))]
    assert dump(curate_history(history)) == [wire("user", "a")]


@pytest.mark.parametrize(
    "part",
    [
        text("", thought=True),
        text("", thoughtSignature="sig-9"),
        {"text": "", **call("c1")},
        call("c1"),
        media(),
        {"executableCode": {"language": "PYTHON", "code": "print(1)"}},
    ],
    ids=["empty-thought", "empty-with-signature", "empty-with-call", "call", "media", "unknown-payload"],
)
def test_a_model_content_is_valid_with_empty_text_only_on_thoughts_signatures_or_calls(part: dict[str, Any]) -> None:
    history = [user("a"), model(part)]
    assert dump(curate_history(history)) == dump(history)


def test_curation_never_drops_user_contents() -> None:
    history = [user(""), model("ok"), user(), model("fine")]
    assert [c.role for c in curate_history(history)] == ["user", "model", "user", "model"]


# ── §5.3 real user turns ──────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "content",
    [
        user("fix the bug"),
        user(media()),
        user({"fileData": {"fileUri": "gs://b/a.pdf", "mimeType": "application/pdf"}}),
        user(response("c1"), "and then also this"),
        user(reminder_text("env"), "the actual prompt"),
    ],
    ids=["text", "inline-data", "file-data", "response-and-text", "reminder-and-text"],
)
def test_a_user_content_with_a_real_part_is_a_real_user_turn(content: Content) -> None:
    assert is_real_user_turn(content)


@pytest.mark.parametrize(
    "content",
    [
        user(response("c1"), response("c2")),
        user(reminder_text("env")),
        user(reminder_text("env") + "\n\n"),
        user(""),
        user("  \n\t"),
        user(response("c1"), reminder_text("late"), "   "),
        user(),
        model("fix the bug"),
    ],
    ids=["responses", "reminder", "reminder-trailing-ws", "empty", "whitespace", "mixed-non-real", "no-parts", "model"],
)
def test_tool_responses_reminders_and_blank_text_are_not_real_user_turns(content: Content) -> None:
    assert not is_real_user_turn(content)


# ── §4/§5 fork_turns: all and N ───────────────────────────────────────────────────────────────


def test_fork_turns_1_after_two_turns_keeps_the_startup_and_the_latest_turn_only() -> None:
    seed = seed_of(two_turn_history(), "1")
    assert [c.role for c in seed.initial_messages] == ["user", "user", "model", "user", "model"]
    assert texts(seed.initial_messages[0]) == [reminder_text("cwd /repo, os linux")]
    assert texts(seed.initial_messages[1]) == ["second task: rename parse_args"]
    assert "first task: add a --verbose flag" not in all_texts(seed.initial_messages)
    assert "Added the flag." not in all_texts(seed.initial_messages)


def test_fork_turns_2_after_two_turns_keeps_both_turns_and_the_startup_apart() -> None:
    seed = seed_of(two_turn_history(), "2")
    assert all_texts(seed.initial_messages[:4]) == [
        reminder_text("cwd /repo, os linux"),
        "first task: add a --verbose flag",
        "Added the flag.",
        "second task: rename parse_args",
    ]
    assert len(seed.initial_messages[0].parts) == 1


def test_fork_turns_all_curates_the_whole_history_so_the_startup_merges_into_the_first_prompt() -> None:
    seed = seed_of(two_turn_history(), "all")
    assert texts(seed.initial_messages[0]) == [reminder_text("cwd /repo, os linux"), "first task: add a --verbose flag"]
    assert all_texts(seed.initial_messages[1:3]) == ["Added the flag.", "second task: rename parse_args"]


def test_fork_turns_none_means_all() -> None:
    history = two_turn_history()
    assert seed_of(history, None) == seed_of(history, "all")


def test_fork_turns_with_fewer_real_turns_than_n_starts_at_the_first_real_turn() -> None:
    history = two_turn_history()
    assert seed_of(history, "5") == seed_of(history, "2")


def test_tool_responses_do_not_count_as_turns_and_stay_in_the_window() -> None:
    # Given one real turn followed by two tool rounds
    history = [
        reminder("env"),
        user("old task"),
        model("old answer"),
        user("new task"),
        *tool_round("c1"),
        *tool_round("c2", name="grep", output={"matches": 3}),
        model("Forking.", agent_call("c-fork", DIRECTIVE)),
    ]
    # When the fork takes one turn
    seed = seed_of(history, "1")
    # Then the window starts at the real prompt and keeps every call and response after it
    window = seed.initial_messages[1:]
    assert texts(window[0]) == ["new task"]
    assert [r["id"] for c in window[:5] for r in responses(c)] == ["c1", "c2"]
    assert [k["id"] for c in window[:5] for k in calls(c)] == ["c1", "c2"]
    assert "old task" not in all_texts(seed.initial_messages)


def test_empty_text_and_pure_reminders_do_not_count_as_turns_and_stay_in_the_window() -> None:
    history = [
        user("old task"),
        model("old answer"),
        user("new task"),
        model("step one"),
        user(""),
        model("step two"),
        reminder("mid-history: a file changed"),
        model("step three"),
        user("   "),
        model(agent_call("c-fork", DIRECTIVE)),
    ]
    seed = seed_of(history, "1")
    assert all_texts(seed.initial_messages[:8]) == [
        "new task",
        "step one",
        "",
        "step two",
        reminder_text("mid-history: a file changed"),
        "step three",
        "   ",
    ]


def test_a_window_without_any_real_user_turn_is_empty() -> None:
    # Given a startup reminder and only tool traffic after it
    history = [reminder("env"), model(call("c1")), user(response("c1")), model(agent_call("c-fork", DIRECTIVE))]
    # When the fork takes 3 turns
    seed = seed_of(history, "3")
    # Then only the startup context is inherited and the task prompt carries the directive
    assert dump(seed.initial_messages) == dump([reminder("env")])
    assert carries_directive(seed.task_prompt)


def test_a_summary_is_kept_by_all_and_excluded_from_every_numeric_window() -> None:
    # Given a startup reminder, a 4-long compacted summary, the answer to its call, then one real turn
    history = [
        reminder("env"),
        *summary(attachments="<background-tasks>", follow_call=True),
        user(response("c-summary", output="summary file")),
        model("Read it."),
        user("next task"),
        model(agent_call("c-fork", DIRECTIVE)),
    ]
    # Then "all" keeps the summary and its attachments
    everything = all_texts(seed_of(history, "all").initial_messages)
    assert SUMMARY_TEXT in everything
    assert "<background-tasks> src/parser.py" in everything
    # And a numeric window, however large, holds none of it: the startup, then the real turn
    for fork_turns in ("1", "3", "1000000"):
        seed = seed_of(history, fork_turns)
        assert texts(seed.initial_messages[0]) == [reminder_text("env")]
        assert texts(seed.initial_messages[1]) == ["next task"]
        assert SUMMARY_TEXT not in json.dumps(seed.to_wire())
        assert "c-summary" not in json.dumps(seed.to_wire())


def test_a_huge_fork_turns_is_not_the_same_as_all_when_a_summary_is_present() -> None:
    history = [*summary(), user("next task"), model(agent_call("c-fork", DIRECTIVE))]
    assert seed_of(history, "99999999999999999999") != seed_of(history, "all")
    assert dump(seed_of(history, "99999999999999999999").initial_messages)[0] == wire("user", "next task")


def test_a_numeric_window_never_merges_an_attachments_content_into_the_prompt_after_it() -> None:
    history = [
        reminder("env"),
        *summary(attachments="<plan-mode-active>"),
        user("real prompt"),
        model(agent_call("c-fork", DIRECTIVE)),
    ]
    seed = seed_of(history, "1")
    assert dump(seed.initial_messages[:2]) == [dump([reminder("env")])[0], wire("user", "real prompt")]


def test_a_numeric_window_keeps_the_startup_reminder_and_the_first_prompt_as_two_contents() -> None:
    history = [reminder("env"), user("only task"), model(agent_call("c-fork", DIRECTIVE))]
    seed = seed_of(history, "1")
    assert dump(seed.initial_messages[:2]) == [dump([reminder("env")])[0], wire("user", "only task")]


def test_a_numeric_window_keeps_the_legacy_startup_pair_in_front() -> None:
    history = [*legacy_startup(), user("old"), model("old answer"), user("new"), model(agent_call("c", DIRECTIVE))]
    seed = seed_of(history, "1")
    assert dump(seed.initial_messages[:3]) == [*dump(legacy_startup()), wire("user", "new")]


def test_a_numeric_window_is_curated_dropping_invalid_model_runs_and_merging_across_them() -> None:
    # Given an invalid model run inside the window, between a prompt and a mid-history reminder
    history = [
        user("old"),
        model("x"),
        user("new"),
        model(""),
        model("fine"),
        reminder("mid"),
        model(agent_call("c", DIRECTIVE)),
    ]
    # Then the run is dropped whole and the prompt and reminder become one user Content
    seed = seed_of(history, "1")
    assert "fine" not in all_texts(seed.initial_messages)
    assert dump(seed.initial_messages)[0] == wire("user", "new", reminder_text("mid"))


@pytest.mark.parametrize(
    "fork_turns",
    ["none", "0", "-1", "1.5", " 3 ", "ALL", "03", "+3", "", "3\n", 3, 0, 1.0, True, False],
)
def test_build_fork_seed_rejects_an_invalid_fork_turns_with_invalid_agent_params(fork_turns: Any) -> None:
    with pytest.raises(InvalidAgentParams) as caught:
        build_fork_seed(two_turn_history(), fork_turns=fork_turns, directive=DIRECTIVE)
    assert str(caught.value) == FORK_TURNS_VALUE_MESSAGE


# ── §5 boundary repair ────────────────────────────────────────────────────────────────────────


def test_a_final_model_call_is_replayed_with_empty_args_and_every_other_key_kept() -> None:
    # Given a final model Content with text, a signed thought, and an Agent call carrying extra keys
    launch = model(
        "I will fork this.",
        thought("plan the fork", signature="sig-thought"),
        {
            **call("c-fork", "Agent", {"prompt": DIRECTIVE}, extra={"a": [1, 2]}, willContinue=False),
            "thoughtSignature": "sig-call",
        },
    )
    seed = seed_of([user("do it"), launch])
    # Then the replayed Content equals the original except that the call's args are {}
    expected = dump([launch])[0]
    expected["parts"][2]["functionCall"]["args"] = {}
    assert dump(seed.initial_messages)[1] == expected


def test_every_final_call_gets_one_placeholder_response_in_call_order_then_one_text_part() -> None:
    # Given a final model Content with three calls, two of them Agent calls
    launch = model(
        agent_call("c-1", DIRECTIVE),
        call("c-2", "read_file", {"path": "b.py"}),
        agent_call("c-3", "Directive: write the changelog."),
    )
    seed = seed_of([user("go"), launch])
    # Then one user Content answers them all, in order, with the exact placeholder shape
    placeholder = dump(seed.initial_messages)[2]
    assert placeholder["role"] == "user"
    assert placeholder["parts"][:3] == [
        {"functionResponse": {"id": "c-1", "name": "Agent", "response": {"output": PLACEHOLDER_OUTPUT}}},
        {"functionResponse": {"id": "c-2", "name": "read_file", "response": {"output": PLACEHOLDER_OUTPUT}}},
        {"functionResponse": {"id": "c-3", "name": "Agent", "response": {"output": PLACEHOLDER_OUTPUT}}},
    ]
    assert len(placeholder["parts"]) == 4
    assert list(placeholder["parts"][3]) == ["text"]
    assert carries_directive(placeholder["parts"][3]["text"])


def test_the_placeholder_output_uses_an_em_dash() -> None:
    seed = seed_of([user("go"), model(agent_call("c-1", DIRECTIVE))])
    output = responses(seed.initial_messages[2])[0]["response"]["output"]
    assert output == "Fork started \u2014 processing in background"


def test_a_final_model_call_is_followed_by_the_acknowledgement_and_the_task_prompt_begin() -> None:
    seed = seed_of([user("go"), model(agent_call("c-1", DIRECTIVE))])
    assert len(seed.initial_messages) == 4
    assert dump(seed.initial_messages)[3] == {"role": "model", "parts": [{"text": ACK_TEXT}]}
    assert seed.task_prompt == BEGIN


def test_a_final_model_content_without_calls_gets_nothing_added_and_the_task_prompt_carries_the_directive() -> None:
    history = [user("go"), model(thought("done?"), "All done.")]
    seed = seed_of(history)
    assert dump(seed.initial_messages) == dump(history)
    assert seed.task_prompt != BEGIN
    assert carries_directive(seed.task_prompt)


def test_a_final_user_content_of_tool_responses_and_reminders_is_kept() -> None:
    history = [user("go"), model(call("c-1"), call("c-2")), user(response("c-1"), response("c-2"), reminder_text("x"))]
    seed = seed_of(history)
    assert dump(seed.initial_messages) == dump(history)
    assert carries_directive(seed.task_prompt)


def test_a_final_unanswered_prompt_is_dropped() -> None:
    seed = seed_of([user("go"), model("done"), user("and now this?")])
    assert dump(seed.initial_messages) == [wire("user", "go"), wire("model", "done")]
    assert carries_directive(seed.task_prompt)


def test_a_final_pure_reminder_is_dropped() -> None:
    seed = seed_of([user("go"), model("done"), reminder("late reminder")])
    assert dump(seed.initial_messages) == [wire("user", "go"), wire("model", "done")]


def test_a_final_prompt_mixed_with_tool_responses_keeps_only_the_responses() -> None:
    # Given answered calls whose responses were merged with a new unanswered prompt
    history = [user("go"), model(call("c-1", args={"path": "x"})), user(response("c-1"), "and also this")]
    # Then the prompt part is dropped, the responses stay, and the answered call keeps its args
    seed = seed_of(history)
    assert dump(seed.initial_messages) == [
        wire("user", "go"),
        wire("model", call("c-1", args={"path": "x"})),
        wire("user", response("c-1")),
    ]
    assert carries_directive(seed.task_prompt)


def test_after_dropping_a_final_prompt_the_end_is_checked_again_and_an_unanswered_call_is_repaired() -> None:
    # Given a model call that was never answered, then a new prompt
    history = [user("go"), model(call("c-9", args={"secret": "s"})), user("never mind")]
    # When the prompt is dropped, the call is now last: it is redacted and answered by a placeholder
    seed = seed_of(history)
    assert calls(seed.initial_messages[1]) == [{"id": "c-9", "name": "read_file", "args": {}}]
    assert [r["id"] for r in responses(seed.initial_messages[2])] == ["c-9"]
    assert dump(seed.initial_messages)[3] == {"role": "model", "parts": [{"text": ACK_TEXT}]}
    assert seed.task_prompt == BEGIN


def test_repair_that_leaves_nothing_gives_an_empty_seed_and_the_directive_as_task_prompt() -> None:
    seed = seed_of([reminder("env"), user("only an unanswered prompt")], "all")
    assert seed.initial_messages == []
    assert carries_directive(seed.task_prompt)


def test_the_startup_prefix_is_never_dropped_by_the_repair_in_numeric_mode() -> None:
    # Given only a startup reminder and an unanswered prompt
    history = [reminder("env"), user("only an unanswered prompt")]
    # When the numeric window is repaired to nothing
    seed = seed_of(history, "1")
    # Then the startup context is still prepended
    assert dump(seed.initial_messages) == dump([reminder("env")])
    assert carries_directive(seed.task_prompt)


def test_the_legacy_startup_pair_is_never_dropped_by_the_repair_in_numeric_mode() -> None:
    seed = seed_of([*legacy_startup(), user("only an unanswered prompt")], "2")
    assert dump(seed.initial_messages) == dump(legacy_startup())


# ── §6 traps ──────────────────────────────────────────────────────────────────────────────────


def test_orphan_responses_at_the_start_of_the_window_are_dropped_and_the_rest_is_kept() -> None:
    # Given tool responses merged with the next real prompt, whose calls stand before the window
    history = [
        reminder("env"),
        user("old task"),
        model(call("c-old")),
        user(response("c-old")),
        user("new task", media()),
        model(agent_call("c-fork", DIRECTIVE)),
    ]
    # When the fork takes one turn
    seed = seed_of(history, "1")
    # Then the window's first Content keeps the prompt and the media but not the orphan response
    assert dump(seed.initial_messages)[1] == wire("user", "new task", media())
    assert "c-old" not in json.dumps(seed.to_wire())


def test_orphan_responses_are_dropped_before_the_boundary_repair() -> None:
    # Given a window made of one Content: orphan responses merged with an unanswered prompt
    history = [user("old task"), model(call("c-old")), user(response("c-old")), user("unanswered")]
    # Then the orphans are gone before repair, so repair drops the prompt and nothing is left
    seed = seed_of(history, "1")
    assert seed.initial_messages == []


@pytest.mark.parametrize("fork_turns", ["all", "1", "2"])
def test_parallel_sibling_forks_never_see_each_others_directives(fork_turns: str) -> None:
    # Given a model Content launching three forks at once
    directives = {
        "c-a": "Directive alpha: fix the tokenizer.",
        "c-b": "Directive beta: document the CLI.",
        "c-c": "Directive gamma: profile the parser.",
    }
    launch = model("Launching three forks.", *(agent_call(i, d) for i, d in directives.items()))
    history = [reminder("env"), user("split the work"), model("ok"), user("go"), launch]
    for own_id, own in directives.items():
        # When the fork of `own_id` builds its seed
        seed = build_fork_seed(history, fork_turns=fork_turns, directive=own)
        wire_seed = json.dumps(seed.to_wire(), ensure_ascii=False)
        # Then no sibling's directive appears anywhere, and its own does
        for other_id, other in directives.items():
            if other_id != own_id:
                assert other not in wire_seed
        assert own in wire_seed
        # And every call id is answered by exactly one placeholder
        answered = [r["id"] for c in seed.initial_messages for r in responses(c)]
        assert sorted(answered) == sorted(directives)


def test_sibling_calls_without_a_directive_in_args_are_redacted_too() -> None:
    launch = model(agent_call("c-a", "alpha"), call("c-b", "Agent", {"prompt": "beta", "nested": {"x": ["beta"]}}))
    seed = seed_of([user("go"), launch], directive="alpha")
    assert [k["args"] for k in calls(seed.initial_messages[1])] == [{}, {}]


# ── deep copy and unknown keys ────────────────────────────────────────────────────────────────


def rich_history() -> list[Content]:
    """A history with nested dicts and lists everywhere: args, responses, media, unknown keys."""
    return [
        reminder("env"),
        user("task", media()),
        model(
            text("calling", custom={"k": [1, {"n": None}]}),
            call("c-1", "grep", {"pattern": "x", "paths": ["a", {"deep": [1]}]}, extra={"l": [[1]]}),
            meta={"tags": ["a", {"b": [1]}]},
        ),
        user(
            {
                "functionResponse": {
                    "id": "c-1",
                    "name": "grep",
                    "response": {"output": {"hits": [{"line": 1, "cols": [2, 3]}]}},
                    "parts": [media()],
                    "scheduling": {"when": ["now"]},
                }
            },
            "next real task",
            envelope={"trace": [{"id": "t"}]},
        ),
        model(
            thought("plan", signature="sig"),
            call("c-fork", "Agent", {"prompt": DIRECTIVE, "opts": {"x": [1]}}, unknownOnCall={"y": [2]}),
            agent_call("c-sib", "sibling directive"),
            usage={"tokens": [1, 2]},
        ),
    ]


def mutate_every_container(value: Any) -> None:
    """Add a key to every dict and empty every list reachable from `value`."""
    found = [c for c in containers(value) if isinstance(c, dict | list)]
    for item in found:
        if isinstance(item, dict):
            item["__mutated__"] = True
        else:
            item.clear()


@pytest.mark.parametrize("fork_turns", ["all", "1", "2"])
def test_the_seed_shares_no_object_list_or_dict_with_the_parent_history(fork_turns: str) -> None:
    parent = rich_history()
    seed = seed_of(parent, fork_turns)
    parent_ids = {id(c) for c in containers(parent)}
    shared = [c for c in containers(seed.initial_messages) if id(c) in parent_ids]
    assert shared == []


@pytest.mark.parametrize("fork_turns", ["all", "1", "2"])
def test_mutating_any_nested_dict_or_list_of_the_seed_leaves_the_parent_unchanged(fork_turns: str) -> None:
    parent = rich_history()
    before = dump(parent)
    seed = seed_of(parent, fork_turns)
    mutate_every_container(seed.initial_messages)
    assert dump(parent) == before


@pytest.mark.parametrize("fork_turns", ["all", "1", "2"])
def test_mutating_any_nested_dict_or_list_of_the_parent_leaves_the_seed_unchanged(fork_turns: str) -> None:
    parent = rich_history()
    seed = seed_of(parent, fork_turns)
    before = dump(seed.initial_messages)
    mutate_every_container(parent)
    assert dump(seed.initial_messages) == before


@pytest.mark.parametrize("fork_turns", ["all", "1"])
def test_a_seed_built_from_wire_dicts_shares_nothing_with_them_in_either_direction(fork_turns: str) -> None:
    # Given the parent history as raw wire dicts
    raw = dump(rich_history())
    snapshot = json.loads(json.dumps(raw))
    seed = build_fork_seed(raw, fork_turns=fork_turns, directive=DIRECTIVE)
    seed_before = dump(seed.initial_messages)
    # When the seed is mutated, the raw history is unchanged
    mutate_every_container(seed.initial_messages)
    assert raw == snapshot
    # And when the raw history is mutated, a fresh seed's nested data is unaffected
    seed = build_fork_seed(raw, fork_turns=fork_turns, directive=DIRECTIVE)
    mutate_every_container(raw)
    assert dump(seed.initial_messages) == seed_before


def test_unknown_keys_at_every_level_survive_into_an_all_seed() -> None:
    seed_wire = json.dumps(seed_of(rich_history(), "all").to_wire())
    for key in ("meta", "custom", "extra", "scheduling", "envelope", "unknownOnCall", "usage"):
        assert f'"{key}"' in seed_wire
    assert '"custom": {"k": [1, {"n": null}]}' in seed_wire


def test_unknown_keys_survive_into_a_numeric_seed() -> None:
    # Given the window of one turn: it starts at "next real task" (its orphan response is dropped)
    seed = seed_of(rich_history(), "1")
    wire_seed = dump(seed.initial_messages)
    # Then the keys of the Contents and calls in the window survive
    assert wire_seed[1]["envelope"] == {"trace": [{"id": "t"}]}
    assert wire_seed[2]["usage"] == {"tokens": [1, 2]}
    assert wire_seed[2]["parts"][1]["functionCall"]["unknownOnCall"] == {"y": [2]}

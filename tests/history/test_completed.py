"""Examples and properties for workers.history.completed: the completed-turn fork's seed (docs/fork-history.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from tests.factories import (
    LEGACY_ACK,
    SUMMARY_ACK,
    SUMMARY_TEXT,
    agent_call,
    all_texts,
    call,
    containers,
    dump,
    legacy_startup,
    media,
    model,
    reminder,
    reminder_text,
    response,
    summary,
    text,
    thought,
    tool_round,
    user,
    wire,
)
from tests.strategies import GeneratedHistory, parent_histories
from workers.history import (
    build_completed_seed,
    build_completed_seed_wire,
    completed_turns_end,
    curate_history,
    is_real_user_turn,
    select_completed_turns,
    startup_context_length,
)
from workers.history.messages import Content, dump_contents, load_contents, parse_history
from workers.history.selection import FORK_INSTRUCTIONS, fork_directive_text
from workers.providers.gemini import to_contents
from workers.providers.openai_compat import NO_RESPONSE_ERROR, to_messages

DIRECTIVE = "Rename parse_args to parse_cli everywhere."
SIBLING = "Write the changelog entry for the rename."


def in_flight(*, tool_first: bool = True) -> list[Content]:
    """The parent's open turn: its prompt, a tool round, then the Agent call with a sibling launch."""
    turn = [user("third task: rename parse_args and write the changelog")]
    if tool_first:
        turn += [
            model(thought("plan the rename"), call("c-grep", "grep_search")),
            user(response("c-grep", "grep_search")),
        ]
    return [*turn, model(text("Launching two forks."), agent_call("a-1", DIRECTIVE), agent_call("a-2", SIBLING))]


def two_completed_turns() -> list[Content]:
    """Startup reminder, then two completed turns (the first with a tool round)."""
    return [
        reminder("cwd /repo, os linux"),
        user("first task: add a --verbose flag"),
        *tool_round("c-read"),
        model("Added the flag."),
        user("second task: explain the flag"),
        model("It prints every step."),
    ]


def seed_texts(history: list[Any]) -> list[str]:
    return all_texts(build_completed_seed(history, directive=DIRECTIVE).initial_messages)


# ── the end of the last completed turn ────────────────────────────────────────────────────────


def test_the_seed_is_every_completed_turn_and_nothing_of_the_open_one() -> None:
    history = [*two_completed_turns(), *in_flight()]

    seed = build_completed_seed(history, directive=DIRECTIVE)

    assert dump(seed.initial_messages) == dump(curate_history(two_completed_turns()))
    assert completed_turns_end(history) == len(two_completed_turns())


def test_the_open_turns_prompt_agent_calls_and_sibling_directives_are_left_out() -> None:
    dumped = json.dumps(build_completed_seed_wire([*two_completed_turns(), *in_flight()], directive=DIRECTIVE)[0])

    for left_out in ("third task", "a-1", "a-2", SIBLING, "Launching two forks.", '"Agent"'):
        assert left_out not in dumped


def test_tool_calls_and_model_text_of_the_open_turn_before_its_agent_call_are_left_out() -> None:
    # Given an open turn that already ran a tool and said something before launching
    turn = [
        user("third task"),
        model("Let me look first."),
        *tool_round("c-open", name="glob"),
        model("Found it; launching."),
        model(agent_call("a-1", DIRECTIVE)),
    ]

    # When the seed is built, Then none of that turn is in it, its model texts without calls included
    dumped = json.dumps(build_completed_seed_wire([*two_completed_turns(), *turn], directive=DIRECTIVE)[0])
    for left_out in ("Let me look first.", "c-open", "glob", "Found it"):
        assert left_out not in dumped


def test_a_non_empty_seed_gets_the_fork_instructions_and_the_directive_as_its_task_prompt() -> None:
    seed = build_completed_seed([*two_completed_turns(), *in_flight()], directive=DIRECTIVE)

    assert seed.task_prompt == fork_directive_text(DIRECTIVE)
    assert seed.initial_messages[-1].role == "model"  # no placeholder responses, no acknowledgement after it
    assert "Understood. Executing directive now." not in seed_texts([*two_completed_turns(), *in_flight()])


def test_every_completed_turn_is_kept_not_only_the_last() -> None:
    turns = [user(f"task {i}") if i % 2 == 0 else model(f"done {i}") for i in range(10)]

    texts = seed_texts([reminder(), *turns, *in_flight(tool_first=False)])

    assert [t for t in texts if t.startswith(("task", "done"))] == [
        f"{k} {i}" for i, k in enumerate(["task", "done"] * 5)
    ]


def test_a_turn_that_ended_in_a_tool_round_without_a_model_text_is_not_completed() -> None:
    # Given a second turn whose last model Content holds a call (its answer came, the model never replied)
    history = [reminder(), user("task 1"), model("done 1"), user("task 2"), *tool_round("c-2"), *in_flight()]

    # Then the seed ends with the first turn
    assert seed_texts(history)[-1] == "done 1"
    assert completed_turns_end(history) == 3


def test_a_history_without_an_open_turn_is_kept_whole() -> None:
    # Given a history that ends with a model text: no real user turn is waiting for an answer
    history = two_completed_turns()

    seed = build_completed_seed(history, directive=DIRECTIVE)

    assert dump(seed.initial_messages) == dump(curate_history(history))
    assert completed_turns_end(history) == len(history)


def test_without_any_real_user_turn_nothing_is_in_flight_and_the_last_model_text_ends_the_seed() -> None:
    history = [reminder(), model("I read the environment."), model(agent_call("a-1", DIRECTIVE))]

    assert completed_turns_end(history) == 2
    assert seed_texts(history) == [reminder_text("env: linux, cwd /repo"), "I read the environment."]


def test_a_prompt_typed_with_tool_results_opens_the_turn_in_flight() -> None:
    # Given a tool round whose results came with a prompt the user typed meanwhile, then the launch
    history = [
        reminder(),
        user("task 1"),
        model("done 1"),
        user("task 2"),
        model(call("c-2")),
        user(response("c-2"), "also rename the tests"),
        model(agent_call("a-1", DIRECTIVE)),
    ]

    # Then that Content is the last real user turn: task 2 never completed
    assert seed_texts(history)[-1] == "done 1"


# ── synthetic prefixes ────────────────────────────────────────────────────────────────────────


def test_the_startup_reminder_is_kept_merged_into_the_first_prompt_as_for_all() -> None:
    seed = build_completed_seed([*two_completed_turns(), *in_flight()], directive=DIRECTIVE)

    first = seed.initial_messages[0]
    assert first.role == "user" and [p.text for p in first.parts][:1] == [reminder_text("cwd /repo, os linux")]


def test_the_legacy_startup_pair_is_kept_before_the_completed_turns() -> None:
    history = [*legacy_startup(), user("task 1"), model("done 1"), *in_flight()]

    assert seed_texts(history) == ["This is the environment: linux, cwd /repo.", LEGACY_ACK, "task 1", "done 1"]


@pytest.mark.parametrize("startup", [[reminder()], legacy_startup(), []], ids=["reminder", "legacy", "none"])
def test_a_first_turn_fork_gets_an_empty_seed_and_the_bare_directive(startup: list[Content]) -> None:
    history = [*startup, *in_flight()]

    seed = build_completed_seed(history, directive=DIRECTIVE)

    assert seed.initial_messages == []
    assert seed.task_prompt == DIRECTIVE  # as a fresh spawn: no fork instructions
    assert FORK_INSTRUCTIONS not in seed.task_prompt
    assert completed_turns_end(history) == 0


def test_a_compacted_summary_counts_as_completed_turns() -> None:
    # Given a startup reminder and a summary, then straight the open turn
    history = [reminder(), *summary(), *in_flight()]

    # Then the seed is the startup and the summary, curated as for `all`
    seed = build_completed_seed(history, directive=DIRECTIVE)
    assert dump(seed.initial_messages) == dump(curate_history([reminder(), *summary()]))
    assert seed.task_prompt == fork_directive_text(DIRECTIVE)
    assert SUMMARY_TEXT in all_texts(seed.initial_messages) and SUMMARY_ACK in all_texts(seed.initial_messages)


def test_post_compaction_attachments_belong_to_the_turn_they_open() -> None:
    # Given a summary with attachments and a call after them, answered, but no model text since
    history = [reminder(), *summary(attachments="<plan-mode-active>", follow_call=True)]
    history += [user(response("c-summary")), *in_flight()]

    # Then the seed ends at the summary's acknowledgement
    texts = seed_texts(history)
    assert texts[-1] == SUMMARY_ACK
    assert not any(t.startswith("<plan-mode-active>") for t in texts)


def test_post_compaction_attachments_are_kept_once_their_turn_completed() -> None:
    history = [*summary(attachments="<background-tasks>"), model("Noted the tasks."), *in_flight()]

    texts = seed_texts(history)

    assert texts[-2:] == ["<background-tasks> src/parser.py", "Noted the tasks."]


# ── curation and balance ──────────────────────────────────────────────────────────────────────


def test_a_model_text_that_curation_drops_does_not_end_the_seed() -> None:
    # Given a second turn whose reply run holds an invalid (empty) model Content
    history = [reminder(), user("task 1"), model("done 1"), user("task 2"), model("half"), model(text(""))]

    # Then the run is dropped and the seed ends with the first turn, its prompt merged as curation does
    history += in_flight()
    assert seed_texts(history)[-1] == "done 1"
    assert completed_turns_end(history) == 3


def test_an_unanswered_call_in_a_completed_turn_is_dropped_and_the_rest_of_its_content_kept() -> None:
    # Given a malformed completed turn: a call with no response, and a response that answers nothing
    history = [
        reminder(),
        user("task 1"),
        model(text("checking"), call("c-lost")),
        user(response("c-other"), "and here is more"),
        model("done 1"),
        *in_flight(),
    ]

    seed = build_completed_seed(history, directive=DIRECTIVE)

    assert "c-lost" not in json.dumps(dump(seed.initial_messages))
    assert "c-other" not in json.dumps(dump(seed.initial_messages))
    assert all_texts(seed.initial_messages)[1:] == ["task 1", "checking", "and here is more", "done 1"]


def test_a_content_left_empty_by_the_balance_is_dropped_and_the_prompts_around_it_merged() -> None:
    history = [user("task 1"), model(call("c-1")), user("no result, a new prompt"), model("done"), *in_flight()]

    seed = build_completed_seed(history, directive=DIRECTIVE)

    assert dump(seed.initial_messages) == [wire("user", "task 1", "no result, a new prompt"), wire("model", "done")]


def test_responses_pair_with_calls_by_id_else_by_name_and_a_repeated_id_stays_unpaired() -> None:
    # Given calls answered out of order, one response without an id, and a call id used twice
    calls = model(call("c-1", "read_file"), call("c-2", "glob"), call("c-2", "glob"), call("c-3", "grep_search"))
    answers = user(
        response("c-2", "glob"),
        {"functionResponse": {"name": "grep_search", "response": {"output": "3 hits"}}},
        response("c-1", "read_file"),
        response("c-2", "glob", output="second"),
    )

    seed = build_completed_seed([user("task"), calls, answers, model("done"), *in_flight()], directive=DIRECTIVE)

    replay, results = dump(seed.initial_messages[1:3])
    assert [p["functionCall"]["id"] for p in replay["parts"]] == ["c-1", "c-2", "c-3"]
    assert [p["functionResponse"].get("id") for p in results["parts"]] == ["c-2", None, "c-1"]


def test_calls_without_ids_are_paired_with_responses_by_name_as_gemini_sends_them() -> None:
    # Given two id-less calls answered by id-less responses, in the other order, and one more answer by an id
    calls = model({"functionCall": {"name": "read_file", "args": {}}}, {"functionCall": {"name": "glob", "args": {}}})
    answers = user(
        {"functionResponse": {"name": "glob", "response": {"output": "a.py"}}},
        {"functionResponse": {"name": "read_file", "response": {"output": "text"}}},
        response("c-9", "read_file"),
    )

    seed = build_completed_seed([user("task"), calls, answers, model("done"), *in_flight()], directive=DIRECTIVE)

    # Then both calls are answered, and the response whose id names no call is dropped
    replay, results = seed.initial_messages[1:3]
    assert dump([replay]) == dump([calls])
    assert dump([results]) == dump([user(*dump([answers])[0]["parts"][:2])])
    assert openai_pairs_every_call(seed.initial_messages)
    assert gemini_pairs_every_call(seed.initial_messages)


def test_a_call_followed_by_another_model_content_is_unanswered() -> None:
    history = [user("task"), model(call("c-1")), model("done without waiting"), *in_flight()]

    assert dump(build_completed_seed(history, directive=DIRECTIVE).initial_messages) == [
        wire("user", "task"),
        wire("model", "done without waiting"),
    ]


def openai_pairs_every_call(messages: list[Content]) -> bool:
    """The Chat Completions request answers each tool call once, right after it, from a recorded response."""
    request = to_messages("system", messages)
    responses = sum(p.function_response is not None for c in messages for p in c.parts)
    for index, message in enumerate(request):
        ids = [c["id"] for c in message.get("tool_calls") or []]
        following = request[index + 1 : index + 1 + len(ids)]
        if sorted(m.get("tool_call_id", "") for m in following) != sorted(ids):
            return False
    tools = [m for m in request if m["role"] == "tool"]
    return len(tools) == responses and all(NO_RESPONSE_ERROR not in m["content"] for m in tools)


PAIRING_KEYS = ("text", "thought", "functionCall", "functionResponse")


def _for_genai(content: dict[str, Any]) -> dict[str, Any]:
    """The Content with the part keys pairing depends on: the genai types refuse the generator's fake
    signatures (not base64) and values of its unknown keys that happen to be genai fields (`videoMetadata`)."""
    return {**content, "parts": [{k: v for k, v in p.items() if k in PAIRING_KEYS} for p in content["parts"]]}


def gemini_pairs_every_call(messages: list[Content]) -> bool:
    """The Gemini request has as many responses right after each model Content as it has calls, by name."""
    contents = to_contents(load_contents([_for_genai(c) for c in dump_contents(messages)]))
    previous: list[str] = []
    for content in contents:
        parts = content.parts or []
        answered = sorted(p.function_response.name or "" for p in parts if p.function_response is not None)
        if answered != sorted(previous) and (content.role == "user" or previous):
            return False
        previous = sorted(p.function_call.name or "" for p in parts if p.function_call is not None)
    return previous == []


@pytest.mark.parametrize(
    "history",
    [
        [*two_completed_turns(), *in_flight()],
        [user("t"), model(call("c-1"), call("c-2")), user(response("c-2"), response("c-9")), model("ok"), *in_flight()],
        [user("t"), model(text(""), call("c-1")), model("x"), user(response("c-1")), model("ok"), *in_flight()],
        [user("t"), model(call("c-1"), call("c-1")), user(response("c-1"), response("c-1")), model("ok"), *in_flight()],
        [user("t", media()), *tool_round("c-1"), model(text("")), user(response("c-1")), model("ok"), *in_flight()],
    ],
    ids=["well-formed", "missing-and-orphan", "dropped-run", "repeated-id", "orphan-after-invalid"],
)
def test_the_seed_is_a_balanced_request_for_both_provider_adapters(history: list[Content]) -> None:
    messages = build_completed_seed(history, directive=DIRECTIVE).initial_messages

    assert messages and messages[-1].role == "model"
    assert openai_pairs_every_call(messages)
    assert gemini_pairs_every_call(messages)


def test_the_adapter_checks_catch_an_unbalanced_history() -> None:
    unbalanced = [user("t"), model(call("c-1"), call("c-2")), user(response("c-1")), model("ok")]

    assert not openai_pairs_every_call(unbalanced)
    assert not gemini_pairs_every_call(unbalanced)


# ── copies and inputs ─────────────────────────────────────────────────────────────────────────


def test_the_seed_shares_no_object_with_the_parent_history() -> None:
    history = [*two_completed_turns(), *in_flight()]
    before = dump(history)

    seed = build_completed_seed(history, directive=DIRECTIVE)
    seed.initial_messages[1].parts[0].function_call.args["path"] = "changed.py"  # type: ignore[union-attr]
    seed.initial_messages[0].parts.append(seed.initial_messages[0].parts[0])

    assert dump(history) == before
    assert not {id(c) for c in containers(history)} & {id(c) for c in containers(seed.initial_messages)}


def test_mutating_the_wire_seed_leaves_the_parents_wire_dicts_unchanged() -> None:
    raw = dump([*two_completed_turns(), *in_flight()])
    before = json.loads(json.dumps(raw))

    messages, _ = build_completed_seed_wire(raw, directive=DIRECTIVE)
    messages[1]["parts"][0]["functionCall"]["args"]["path"] = "changed.py"
    messages[0]["parts"].clear()

    assert raw == before


def test_wire_dicts_and_contents_give_the_same_seed() -> None:
    history = [*two_completed_turns(), *in_flight()]

    assert build_completed_seed(dump(history), directive=DIRECTIVE) == build_completed_seed(
        history, directive=DIRECTIVE
    )
    assert dump(select_completed_turns(dump(history))) == dump(
        build_completed_seed(history, directive="x").initial_messages
    )


# ── properties over generated parent histories ────────────────────────────────────────────────

PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def _parsed(history: GeneratedHistory) -> list[Content]:
    return parse_history(json.loads(json.dumps(history.raw)))


def _open_turn_start(parsed: list[Content]) -> int:
    if parsed and parsed[-1].role == "model" and all(p.function_call is None for p in parsed[-1].parts):
        return len(parsed)
    real = [i for i, c in enumerate(parsed) if is_real_user_turn(c)]
    return real[-1] if real else len(parsed)


def _reference(parsed: list[Content]) -> list[dict[str, Any]]:
    """The seed before its balance, computed another way: the curated history before the open turn, cut after
    its last model Content without calls (nothing when that leaves only the startup context)."""
    before = curate_history(parsed[: _open_turn_start(parsed)])
    ends = [i for i, c in enumerate(before) if c.role == "model" and all(p.function_call is None for p in c.parts)]
    prefix = dump_contents(before[: ends[-1] + 1] if ends else [])
    return [] if prefix == dump_contents(curate_history(parsed[: startup_context_length(parsed)])) else prefix


def _flat(messages: list[dict[str, Any]], *, paired: bool) -> list[tuple[str, Any]]:
    """(role, part) of every part that is (`paired`) or is not a call or a response."""
    return [
        (c["role"], p)
        for c in messages
        for p in c["parts"]
        if ("functionCall" in p or "functionResponse" in p) == paired
    ]


def _is_subsequence(small: list[Any], large: list[Any]) -> bool:
    items = iter(large)
    return all(any(item == other for other in items) for item in small)


@PROPERTY
@given(history=parent_histories())
def test_the_seed_is_the_curated_history_before_the_open_turn_minus_unpaired_calls(history: GeneratedHistory) -> None:
    parsed = _parsed(history)
    expected = _reference(parsed)

    messages, task_prompt = build_completed_seed_wire(parsed, directive=DIRECTIVE)

    assert _flat(messages, paired=False) == _flat(expected, paired=False)
    assert _is_subsequence(_flat(messages, paired=True), _flat(expected, paired=True))
    if len(_flat(messages, paired=True)) == len(_flat(expected, paired=True)):  # nothing to balance
        assert messages == expected == dump_contents(curate_history(parsed))[: len(messages)]
    assert task_prompt == (fork_directive_text(DIRECTIVE) if messages else DIRECTIVE)


@PROPERTY
@given(history=parent_histories())
def test_nothing_of_the_open_turn_reaches_the_seed(history: GeneratedHistory) -> None:
    parsed = _parsed(history)
    open_ids = {p.function_call.id for c in parsed[_open_turn_start(parsed) :] for p in c.parts if p.function_call}

    messages, _ = build_completed_seed_wire(parsed, directive=DIRECTIVE)

    dumped = json.dumps(messages, ensure_ascii=False)
    assert "<<directive-" not in dumped
    assert not {p["functionCall"]["id"] for c in messages for p in c["parts"] if "functionCall" in p} & open_ids
    assert completed_turns_end(parsed) <= _open_turn_start(parsed)
    assert not messages or (
        messages[-1]["role"] == "model" and all("functionCall" not in p for p in messages[-1]["parts"])
    )


@PROPERTY
@given(history=parent_histories())
def test_every_call_in_the_seed_is_answered_for_both_adapters(history: GeneratedHistory) -> None:
    messages = build_completed_seed(_parsed(history), directive=DIRECTIVE).initial_messages

    assert openai_pairs_every_call(messages)
    assert gemini_pairs_every_call(messages)


@PROPERTY
@given(history=parent_histories())
def test_the_seed_is_a_copy_the_same_from_wire_dicts_and_contents(history: GeneratedHistory) -> None:
    parsed = _parsed(history)
    raw = json.loads(json.dumps(history.raw))

    seed = build_completed_seed(parsed, directive=DIRECTIVE)

    assert seed == build_completed_seed(raw, directive=DIRECTIVE)
    assert raw == history.raw
    assert not {id(c) for c in containers(parsed)} & {id(c) for c in containers(seed.initial_messages)}

"""Property tests of the fork seed over generated parent histories (docs/fork-history.md §2-§7)."""

from __future__ import annotations

import copy
import hashlib
import json
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tests.strategies import FORK_TURNS, GeneratedHistory, parent_histories
from workers.base.codec import decode, digest, encode
from workers.history.messages import Content, dump_contents, parse_history
from workers.history.selection import (
    FORK_ACK_TEXT,
    FORK_BEGIN_PROMPT,
    FORK_PLACEHOLDER_OUTPUT,
    ForkSeed,
    build_fork_seed,
    curate_history,
    fork_directive_text,
    is_real_user_turn,
    is_system_reminder_text,
    startup_context_length,
)

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=_HEALTH)  # the properties
INVARIANT = settings(max_examples=75, deadline=None, suppress_health_check=_HEALTH)  # cheaper extra checks
ANY_TURNS = st.sampled_from([None, "all"]) | FORK_TURNS
Wire = dict[str, Any]


# ── helpers ───────────────────────────────────────────────────────────────────────────────────


def _fresh(raw: list[Wire]) -> list[Wire]:
    """A deep copy of JSON data (faster than `copy.deepcopy`)."""
    return json.loads(json.dumps(raw))


def _parsed(history: GeneratedHistory) -> list[Content]:
    return parse_history(_fresh(history.raw))


def _directive(history: GeneratedHistory) -> str:
    return history.launch_calls[0]["args"]["prompt"] if history.launch_calls else "Summarize the build logs."


def _seed(history: GeneratedHistory, fork_turns: str | None) -> ForkSeed:
    return build_fork_seed(_parsed(history), fork_turns=fork_turns, directive=_directive(history))


def _is_numeric(fork_turns: str | None) -> bool:
    return fork_turns not in (None, "all")


def _prefix_length(history: GeneratedHistory, fork_turns: str | None) -> int:
    return startup_context_length(_parsed(history)) if _is_numeric(fork_turns) else 0


def _numeric_window(parsed: list[Content], turns: int) -> tuple[list[Content], list[Content], int]:
    """(startup prefix, curated window from the N-th most recent real turn, real turns in the curated tail)."""
    prefix = parsed[: startup_context_length(parsed)]
    curated = curate_history(parsed[startup_context_length(parsed, include_summary=True) :])
    real = [i for i, c in enumerate(curated) if is_real_user_turn(c)]
    start = real[-turns] if len(real) >= turns else (real[0] if real else len(curated))
    return prefix, curated[start:], len(real)


def _has_call(content: Wire) -> bool:
    return any("functionCall" in p for p in content.get("parts") or [])


def _calls(content: Wire) -> list[Wire]:
    return [p["functionCall"] for p in content["parts"] if "functionCall" in p]


def _is_reminder_part(part: Wire) -> bool:
    return isinstance(part.get("text"), str) and is_system_reminder_text(part["text"])


def _is_answered_results(content: Wire) -> bool:
    """A user Content the repair keeps: tool responses, maybe with reminders, and nothing else."""
    parts = content["parts"]
    has_response = any("functionResponse" in p for p in parts)
    return has_response and all("functionResponse" in p or _is_reminder_part(p) for p in parts)


def _without_responses(content: Wire) -> Wire:
    return {**content, "parts": [p for p in content["parts"] if "functionResponse" not in p]}


def _responses_only(content: Wire) -> Wire:
    return {**content, "parts": [p for p in content["parts"] if "functionResponse" in p]}


def _redacted(content: Wire) -> Wire:
    redact = lambda p: {**p, "functionCall": {**p["functionCall"], "args": {}}} if "functionCall" in p else p  # noqa: E731
    return {**content, "parts": [redact(p) for p in content["parts"]]}


def _allowed_forms(window: list[Wire], i: int, kept: int, *, replay: bool, strip_first: bool) -> list[Wire]:
    """The forms the window's i-th Content may take in the seed, given `kept` Contents survive the repair."""
    forms = [window[i]]
    if strip_first and i == 0 and window[i]["role"] == "user":
        forms.append(_without_responses(window[i]))  # orphan responses dropped at the window start
    if i == kept - 1:
        if replay:
            return [_redacted(f) for f in forms if f["role"] == "model" and _has_call(f)]
        if window[i]["role"] == "user" and not _is_answered_results(window[i]):
            forms += [_responses_only(f) for f in forms]  # an unanswered prompt dropped, its responses kept
    return forms


def _assert_is_repaired(
    body: list[Wire], window: list[Wire], seed: ForkSeed, directive: str, *, strip_first: bool
) -> None:
    """`body` is `window` up to its repaired end, orphan responses at its start dropped if `strip_first`."""
    replay = seed.task_prompt == FORK_BEGIN_PROMPT
    kept = body
    if replay:
        assert len(body) >= 3
        replayed, placeholder, ack = body[-3:]
        answers = [
            {"functionResponse": {"id": c["id"], "name": c["name"], "response": {"output": FORK_PLACEHOLDER_OUTPUT}}}
            for c in _calls(replayed)
        ]
        assert placeholder == {"role": "user", "parts": [*answers, {"text": fork_directive_text(directive)}]}
        assert ack == {"role": "model", "parts": [{"text": FORK_ACK_TEXT}]}
        kept = body[:-2]
    else:
        assert seed.task_prompt == fork_directive_text(directive)
    assert len(kept) <= len(window)
    for i, content in enumerate(kept):
        assert content in _allowed_forms(window, i, len(kept), replay=replay, strip_first=strip_first), i
    assert all(c["role"] == "user" for c in window[len(kept) :]), "the repair only drops user Contents"


def _containers(obj: object, out: dict[int, object]) -> dict[int, object]:
    """Every mutable object reachable from `obj` (models, their extras, dicts, lists), by id."""
    if isinstance(obj, BaseModel):
        out[id(obj)] = obj
        extra = obj.__pydantic_extra__
        if extra is not None:
            out[id(extra)] = extra
        for value in [*obj.__dict__.values(), *(extra or {}).values()]:
            _containers(value, out)
    elif isinstance(obj, dict):
        out[id(obj)] = obj
        for value in obj.values():
            _containers(value, out)
    elif isinstance(obj, list):
        out[id(obj)] = obj
        for value in obj:
            _containers(value, out)
    return out


def _reordered(value: Any, rng: random.Random) -> Any:
    """The same value with every dict's keys inserted in another order."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        if len(keys) > 1 and keys == list(value):
            keys.reverse()
        return {k: _reordered(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_reordered(v, rng) for v in value]
    return value


# ── the properties ────────────────────────────────────────────────────────────────────


@PROPERTY
@given(history=parent_histories(), fork_turns=ANY_TURNS)
def test_seed_never_ends_with_an_unanswered_call_or_prompt(history: GeneratedHistory, fork_turns: str | None) -> None:
    messages = _seed(history, fork_turns).to_wire()["initial_messages"]
    if len(messages) == _prefix_length(history, fork_turns):
        return  # empty, or only the startup prefix (numeric mode never drops it)
    last = messages[-1]
    assert not _has_call(last) if last["role"] == "model" else _is_answered_results(last)


@PROPERTY
@given(history=parent_histories(), fork_turns=ANY_TURNS)
def test_every_call_in_the_seed_has_exactly_one_response(history: GeneratedHistory, fork_turns: str | None) -> None:
    messages = _seed(history, fork_turns).to_wire()["initial_messages"]
    response_ids = [p["functionResponse"].get("id") for c in messages for p in c["parts"] if "functionResponse" in p]
    for content in messages:
        for call in _calls(content):
            assert response_ids.count(call["id"]) == 1, call["id"]


@PROPERTY
@given(history=parent_histories(), fork_turns=FORK_TURNS)
def test_numeric_seed_is_the_startup_prefix_plus_a_suffix_of_the_curated_window(
    history: GeneratedHistory, fork_turns: str
) -> None:
    # Given the startup prefix and the curated window computed from the public functions
    prefix, window, _ = _numeric_window(_parsed(history), int(fork_turns))
    # When the seed is built
    seed = _seed(history, fork_turns)
    messages = seed.to_wire()["initial_messages"]
    # Then it is that prefix, untouched, then the window up to its repaired end
    assert messages[: len(prefix)] == dump_contents(prefix)
    _assert_is_repaired(messages[len(prefix) :], dump_contents(window), seed, _directive(history), strip_first=True)


@PROPERTY
@given(history=parent_histories(), fork_turns=st.sampled_from([None, "all"]))
def test_all_seed_is_the_curated_history_up_to_its_repaired_end(
    history: GeneratedHistory, fork_turns: str | None
) -> None:
    seed = _seed(history, fork_turns)
    curated = dump_contents(curate_history(_parsed(history)))
    _assert_is_repaired(seed.to_wire()["initial_messages"], curated, seed, _directive(history), strip_first=False)


@PROPERTY
@given(history=parent_histories(), fork_turns=ANY_TURNS, rng=st.integers(0, 2**32 - 1).map(random.Random))
def test_seed_round_trips_through_the_codec_canonically(
    history: GeneratedHistory, fork_turns: str | None, rng: random.Random
) -> None:
    wire = _seed(history, fork_turns).to_wire()
    data = encode(wire)
    assert decode(data) == wire
    assert ForkSeed.from_wire(decode(data)).to_wire() == wire
    assert encode(copy.deepcopy(wire)) == data
    assert encode(_reordered(wire, rng)) == data, "encoding depends on dict insertion order"
    assert digest(data) == digest(encode(_reordered(wire, rng))) == hashlib.blake2b(data, digest_size=32).hexdigest()


_PLAIN = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@INVARIANT
@given(value=st.dictionaries(st.text(max_size=6), _PLAIN, max_size=5), rng=st.integers(0, 2**32 - 1).map(random.Random))
def test_codec_round_trip_is_exact_and_canonical_for_plain_records(value: dict[str, Any], rng: random.Random) -> None:
    data = encode(value)
    assert decode(data) == value
    assert encode(_reordered(value, rng)) == data
    assert len(digest(data)) == 64


# ── further invariants ────────────────────────────────────────────────────────────────────────


@INVARIANT
@given(history=parent_histories(), fork_turns=ANY_TURNS)
def test_sibling_forks_never_see_each_others_directives(history: GeneratedHistory, fork_turns: str | None) -> None:
    launch_ids = {c["id"] for c in history.launch_calls}
    for j, own in enumerate(history.launch_calls):
        directive = own["args"]["prompt"]
        seed = build_fork_seed(_parsed(history), fork_turns=fork_turns, directive=directive)
        wire = seed.to_wire()
        dumped = json.dumps(wire, ensure_ascii=False)
        for i in range(len(history.launch_calls)):
            if i != j:
                assert f"<<directive-{i}>>" not in dumped
        for content in wire["initial_messages"]:
            assert all(c["args"] == {} for c in _calls(content) if c["id"] in launch_ids)
        if seed.task_prompt == FORK_BEGIN_PROMPT:
            assert wire["initial_messages"][-2]["parts"][-1] == {"text": fork_directive_text(directive)}
            assert dumped.count(f"<<directive-{j}>>") == 1
        else:
            assert seed.task_prompt == fork_directive_text(directive)


@INVARIANT
@given(history=parent_histories(), fork_turns=ANY_TURNS)
def test_building_a_seed_leaves_the_parent_history_unchanged(history: GeneratedHistory, fork_turns: str | None) -> None:
    raw_before = _fresh(history.raw)
    build_fork_seed(history.raw, fork_turns=fork_turns, directive=_directive(history))
    assert history.raw == raw_before

    parsed = _parsed(history)
    dump_before = dump_contents(parsed)
    build_fork_seed(parsed, fork_turns=fork_turns, directive=_directive(history))
    assert dump_contents(parsed) == dump_before


@INVARIANT
@given(history=parent_histories(), fork_turns=ANY_TURNS)
def test_seed_shares_no_mutable_object_with_the_parent(history: GeneratedHistory, fork_turns: str | None) -> None:
    parsed = _parsed(history)
    seed = build_fork_seed(parsed, fork_turns=fork_turns, directive=_directive(history))
    parent_objects = _containers(parsed, {})
    seed_objects = _containers(seed.initial_messages, {})
    shared = parent_objects.keys() & seed_objects.keys()
    assert not shared, [seed_objects[i] for i in shared][:3]


@INVARIANT
@given(history=parent_histories(), fork_turns=ANY_TURNS)
def test_seed_is_the_same_from_wire_dicts_and_from_contents(history: GeneratedHistory, fork_turns: str | None) -> None:
    directive = _directive(history)
    from_wire = build_fork_seed(_fresh(history.raw), fork_turns=fork_turns, directive=directive)
    from_contents = build_fork_seed(_parsed(history), fork_turns=fork_turns, directive=directive)
    assert encode(from_wire.to_wire()) == encode(from_contents.to_wire())


@INVARIANT
@given(history=parent_histories())
def test_all_keeps_every_user_part_when_the_launch_survives_curation(history: GeneratedHistory) -> None:
    parsed = _parsed(history)
    curated = dump_contents(curate_history(parsed))
    if not curated or curated[-1]["role"] != "model" or not _has_call(curated[-1]):
        return
    messages = _seed(history, "all").to_wire()["initial_messages"][:-2]  # without placeholder and ack
    user_parts = [p for c in dump_contents(parsed) if c["role"] == "user" for p in c["parts"]]
    assert [p for c in messages if c["role"] == "user" for p in c["parts"]] == user_parts


@INVARIANT
@given(history=parent_histories(), fork_turns=FORK_TURNS)
def test_numeric_seed_holds_min_of_n_and_the_real_turns(history: GeneratedHistory, fork_turns: str) -> None:
    prefix, window, real_turns = _numeric_window(_parsed(history), int(fork_turns))
    seed = _seed(history, fork_turns)
    body = seed.initial_messages[len(prefix) :]
    if seed.task_prompt == FORK_BEGIN_PROMPT:
        body = body[:-2]  # the placeholder's directive text is not a turn of the parent
    # an unanswered real prompt at the window's end is dropped by the repair
    dropped = 1 if window and is_real_user_turn(window[-1]) else 0
    assert sum(is_real_user_turn(c) for c in body) == min(int(fork_turns), real_turns) - dropped
    if body:  # the window starts at a real turn, without the responses to calls made before it
        assert is_real_user_turn(body[0])
        assert all(p.function_response is None for p in body[0].parts)


@INVARIANT
@given(history=parent_histories())
def test_generated_synthetic_prefixes_are_detected(history: GeneratedHistory) -> None:
    parsed = _parsed(history)
    summary = history.summary_length
    after = history.startup_length + 3
    if summary == 3 and len(parsed) > after and parsed[after].role == "model" and _has_call(history.raw[after]):
        summary = 4  # a call right after the attachments belongs to the summary
    assert startup_context_length(parsed) == history.startup_length
    assert startup_context_length(parsed, include_summary=True) == history.startup_length + summary

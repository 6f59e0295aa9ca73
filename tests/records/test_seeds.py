"""The launcher's seed builder: the same chunks as the history pipeline, sharing work between siblings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.factories import model, user
from tests.strategies import FORK_TURNS, GeneratedHistory, parent_histories
from workers.history.completed import build_completed_seed_wire
from workers.history.params import normalize_fork_turns
from workers.history.selection import build_fork_seed_wire
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot
from workers.records.fork import chunk_digest, split_wire
from workers.records.seeds import SeedBuilder, _Selection, _split

EXAMPLE = Path(__file__).resolve().parents[2] / "workers" / "examples" / "parent.json"
TURNS = st.none() | st.just("all") | FORK_TURNS
DIRECTIVES = st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=4)


def snapshot_of(raw: list[dict[str, Any]], session: str = "s-1") -> ParentSnapshot:
    return parse_parent_snapshot({"session_id": session, "history": raw, "tools": [{"name": "read_file"}]})


def expected(snapshot: ParentSnapshot, fork_turns: object, directive: str) -> tuple[list[bytes], int, str]:
    wire, task_prompt = build_fork_seed_wire(snapshot.history, fork_turns=fork_turns, directive=directive)
    return split_wire(wire), len(wire), task_prompt


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(history=parent_histories(), fork_turns=TURNS, directives=DIRECTIVES)
def test_sibling_forks_get_exactly_the_chunks_of_the_history_pipeline(
    history: GeneratedHistory, fork_turns: str | None, directives: list[str]
) -> None:
    # Given one builder and one snapshot, launched from again and again with different directives
    builder = SeedBuilder()
    snapshot = snapshot_of(history.raw)
    for directive in [*directives, directives[0]]:
        # When the builder makes the seed (the first launch fills its cache, the later ones use it)
        seed = builder.build(snapshot, turns=normalize_fork_turns(fork_turns), directive=directive)

        # Then it is byte for byte what split_wire(build_fork_seed_wire(...)) gives, digests included
        chunks, count, task_prompt = expected(snapshot, fork_turns, directive)
        assert seed.chunks == chunks
        assert seed.digests == [chunk_digest(c) for c in chunks]
        assert (seed.count, seed.task_prompt) == (count, task_prompt)


def test_siblings_share_the_body_chunks_and_differ_only_in_the_repaired_end() -> None:
    # Given the example parent, whose history ends with the launching Agent call
    snapshot = parse_parent_snapshot(json.loads(EXAMPLE.read_text()))
    builder = SeedBuilder()

    # When two forks with different directives are built
    one = builder.build(snapshot, directive="Review the lease code.")
    two = builder.build(snapshot, directive="Write the docs.")

    # Then the body chunks are the very same objects (built once), and only the last chunk differs
    assert len(one.chunks) == len(two.chunks) > 1
    assert all(a is b for a, b in zip(one.chunks[:-1], two.chunks[:-1], strict=True))
    assert one.chunks[-1] != two.chunks[-1]
    assert b"Write the docs." in two.chunks[-1]


def test_a_new_snapshot_with_a_reused_id_is_not_served_from_the_cache() -> None:
    # Given a builder that kept at most one snapshot, and two snapshots with different histories
    builder = SeedBuilder(kept=1)
    first = snapshot_of([{"role": "user", "parts": [{"text": "first task"}]}])
    second = snapshot_of([{"role": "user", "parts": [{"text": "second task"}]}], session="s-2")

    # When each is built (the second evicts the first), and the first again
    seeds = [builder.build(s, directive="go") for s in (first, second, first)]

    # Then each seed is its own snapshot's
    assert [s.chunks for s in seeds] == [expected(s, "all", "go")[0] for s in (first, second, first)]
    assert len(builder._selections) == 1


def test_body_chunks_are_reused_only_for_the_selections_own_messages() -> None:
    # Given a selection whose body chunks for its first two messages were built and kept
    snapshot = snapshot_of([{"role": "user", "parts": [{"text": "task"}]}])
    prefix, body = [user("a")], [model("b"), user("c")]
    selection = _Selection(snapshot, tuple(snapshot.history), prefix, body)
    kept = SeedBuilder._body(selection, [*prefix, *body], 2)
    assert selection.bodies == {2: kept}

    # When messages of equal length but another object (and content) come first
    other = [user("changed"), body[0], body[1]]
    chunks, digests = SeedBuilder._body(selection, other, 2)

    # Then their own chunks are built, and the kept ones are reused only for the same objects
    assert (chunks, digests) == _split(other[:2]) != kept
    assert SeedBuilder._body(selection, [*prefix, *body], 2) is kept


def test_a_snapshot_whose_history_list_changed_is_selected_again() -> None:
    # Given the example parent's snapshot, launched from once
    snapshot = parse_parent_snapshot(json.loads(EXAMPLE.read_text()))
    builder = SeedBuilder()
    builder.build(snapshot, directive="first")

    # When its history list gets a message inserted, the seed is built again from the list as it is
    snapshot.history.insert(1, user("an extra turn"))
    inserted = builder.build(snapshot, directive="second")
    assert inserted.chunks == expected(snapshot, "all", "second")[0]

    # and when a message is replaced by another object, again
    snapshot.history[2] = user("a replaced turn")
    replaced = builder.build(snapshot, directive="third")
    assert replaced.chunks == expected(snapshot, "all", "third")[0]


def test_a_snapshot_built_with_keep_false_leaves_nothing_in_the_builder() -> None:
    snapshot = parse_parent_snapshot(json.loads(EXAMPLE.read_text()))
    builder = SeedBuilder()

    seed = builder.build(snapshot, directive="go", keep=False)

    assert seed.chunks == expected(snapshot, "all", "go")[0]
    assert len(builder._selections) == 0


# ── completed-turn forks ──────────────────────────────────────────────────────────────────────


def expected_completed(snapshot: ParentSnapshot, directive: str) -> tuple[list[bytes], int, str]:
    wire, task_prompt = build_completed_seed_wire(snapshot.history, directive=directive)
    return split_wire(wire), len(wire), task_prompt


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(history=parent_histories(), directives=DIRECTIVES, fork_turns=TURNS)
def test_completed_turn_forks_get_exactly_the_chunks_of_the_completed_seed(
    history: GeneratedHistory, directives: list[str], fork_turns: str | None
) -> None:
    # Given one builder and one snapshot, launched from in both seed modes with different directives
    builder = SeedBuilder()
    snapshot = snapshot_of(history.raw)
    for directive in [*directives, directives[0]]:
        # When the builder makes a completed-turn seed (and a fork_turns seed of the same snapshot between them)
        seed = builder.build(snapshot, directive=directive, seed_mode="completed_turns")
        builder.build(snapshot, turns=normalize_fork_turns(fork_turns), directive=directive)

        # Then it is byte for byte what split_wire(build_completed_seed_wire(...)) gives, digests included
        chunks, count, task_prompt = expected_completed(snapshot, directive)
        assert seed.chunks == chunks
        assert seed.digests == [chunk_digest(c) for c in chunks]
        assert (seed.count, seed.task_prompt) == (count, task_prompt)


def test_completed_turn_siblings_share_every_chunk_and_differ_only_in_the_task_prompt() -> None:
    # Given a parent with completed turns, launching from its open turn
    snapshot = snapshot_of(
        [
            {"role": "user", "parts": [{"text": "first task"}]},
            {"role": "model", "parts": [{"text": "done"}]},
            {"role": "user", "parts": [{"text": "second task"}]},
            {"role": "model", "parts": [{"functionCall": {"id": "a-1", "name": "Agent", "args": {"prompt": "x"}}}]},
        ]
    )
    builder = SeedBuilder()

    # When two completed-turn forks are built
    one = builder.build(snapshot, directive="Review.", seed_mode="completed_turns")
    two = builder.build(snapshot, directive="Document.", seed_mode="completed_turns")

    # Then their chunks are equal and only the task prompts differ
    assert one.chunks == two.chunks == expected_completed(snapshot, "Review.")[0]
    assert one.count == 2
    assert "Review." in one.task_prompt and "Document." in two.task_prompt


def test_a_first_turn_completed_fork_has_no_chunks_and_the_bare_directive() -> None:
    snapshot = snapshot_of([{"role": "user", "parts": [{"text": "task"}]}])

    seed = SeedBuilder().build(snapshot, directive="go", seed_mode="completed_turns")

    assert (seed.chunks, seed.digests, seed.count, seed.task_prompt) == ([], [], 0, "go")

"""The parent snapshot: the example parses, and every malformed field is named with the fix."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import workers
from workers.errors import InvalidParentSnapshot
from workers.history.messages import Content
from workers.history.snapshot import ParentSnapshot, load_parent_snapshot, parse_parent_snapshot

PARENT_PATH = Path(workers.__file__).parent / "examples" / "parent.json"


def rejection(data: object) -> InvalidParentSnapshot:
    with pytest.raises(InvalidParentSnapshot) as caught:
        parse_parent_snapshot(data)
    return caught.value


def test_the_shipped_example_parent_parses_with_every_field(parent: dict[str, Any]) -> None:
    snapshot = load_parent_snapshot(PARENT_PATH)

    assert snapshot.session_id == parent["session_id"]
    assert snapshot.system_instruction == parent["system_instruction"]
    assert snapshot.tools == parent["tools"]
    assert (snapshot.model, snapshot.approval_mode, snapshot.cwd, snapshot.depth) == (
        parent["model"],
        parent["approval_mode"],
        parent["cwd"],
        parent["depth"],
    )
    assert [c.to_wire() for c in snapshot.history] == parent["history"]
    assert all(isinstance(c, Content) for c in snapshot.history)
    assert snapshot.history[-1].role == "model"


def test_only_the_session_id_is_required() -> None:
    snapshot = parse_parent_snapshot({"session_id": "s-1"})

    assert snapshot == ParentSnapshot(session_id="s-1")
    assert (snapshot.history, snapshot.tools, snapshot.approval_mode, snapshot.depth) == ([], [], "default", 0)


def test_a_bad_history_entry_is_named_by_its_index(parent: dict[str, Any]) -> None:
    bad = copy.deepcopy(parent)
    bad["history"][5] = {"role": "assistant", "parts": [{"text": "hi"}]}

    error = rejection(bad)

    assert error.field == "history[5]"
    assert "history[5]" in str(error)
    assert "'assistant'" in str(error) and '"user" or "model"' in str(error)
    assert error.cause is not None


@pytest.mark.parametrize(
    ("history", "field"),
    [
        ("not a list", "history"),
        ([{"role": "user", "parts": [{"text": "a"}]}, "text"], "history[1]"),
        ([{"parts": []}], "history[0]"),
        ([{"role": "user", "parts": "hello"}], "history[0]"),
        ([{"role": "user", "parts": [{"text": 5}]}], "history[0]"),
    ],
    ids=["not-a-list", "not-an-object", "no-role", "parts-not-a-list", "text-not-a-string"],
)
def test_every_kind_of_bad_history_is_refused_naming_where(history: object, field: str) -> None:
    error = rejection({"session_id": "s-1", "history": history})

    assert error.field == field
    assert field in str(error)


@pytest.mark.parametrize(
    ("spoil", "field", "hint"),
    [
        ({"approval_mode": "always"}, "approval_mode", '"plan", "default", "auto-edit", "yolo"'),
        ({"session_id": None}, "session_id", "without braces or spaces"),
        ({"session_id": ""}, "session_id", "without braces or spaces"),
        ({"session_id": "a b"}, "session_id", "without braces or spaces"),
        ({"session_id": "{s}"}, "session_id", "without braces or spaces"),
        ({"tools": {"name": "grep"}}, "tools", "function declarations"),
        ({"tools": [{"name": "grep"}, "read_file"]}, "tools[1]", "function declarations"),
        ({"depth": -1}, "depth", "0 for a top-level session"),
        ({"depth": "one"}, "depth", "0 for a top-level session"),
        ({"colour": "blue"}, "colour", "Extra inputs are not permitted"),
    ],
    ids=[
        "approval-mode",
        "session-null",
        "session-empty",
        "session-space",
        "session-braces",
        "tools-object",
        "tool-not-object",
        "depth-negative",
        "depth-string",
        "unknown-field",
    ],
)
def test_a_malformed_field_is_named_with_what_to_send(
    spoil: dict[str, Any], field: str, hint: str, parent: dict[str, Any]
) -> None:
    error = rejection({**parent, **spoil})

    assert error.field == field
    assert f"field {field!r}" in str(error)
    assert hint in str(error)


def test_a_missing_session_id_is_named() -> None:
    error = rejection({"history": []})

    assert error.field == "session_id"
    assert "Field required" in str(error)


@pytest.mark.parametrize("data", [[], "parent", None, 3])
def test_a_snapshot_that_is_not_an_object_is_refused(data: object) -> None:
    error = rejection(data)

    assert "expected a JSON object" in str(error)
    assert error.field is None


def test_a_snapshot_file_that_is_missing_or_not_json_is_refused_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    broken = tmp_path / "broken.json"
    broken.write_text('{"session_id": "s-1",\n  "history": [}')

    with pytest.raises(InvalidParentSnapshot, match="cannot read parent snapshot") as not_found:
        load_parent_snapshot(missing)
    with pytest.raises(InvalidParentSnapshot, match="is not JSON") as not_json:
        load_parent_snapshot(broken)

    assert str(missing) in str(not_found.value)
    assert str(broken) in str(not_json.value) and "line 2" in str(not_json.value)


def test_an_invalid_snapshot_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "parent.json"
    path.write_text(json.dumps({"session_id": "s-1", "approval_mode": "sometimes"}))

    with pytest.raises(InvalidParentSnapshot) as caught:
        load_parent_snapshot(path)

    assert str(path) in str(caught.value)
    assert caught.value.field == "approval_mode"


def test_a_parsed_snapshot_is_frozen(parent: dict[str, Any]) -> None:
    snapshot = parse_parent_snapshot(parent)

    with pytest.raises(ValueError, match="frozen"):
        snapshot.depth = 3  # type: ignore[misc]


# ── bounds ────────────────────────────────────────────────────────────────────────────────────


def nested(levels: int, leaf: Any = "x") -> Any:
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def test_a_snapshot_file_nested_past_what_json_parses_is_refused_naming_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text('{"session_id": "s-1", "history": ' + "[" * 200_000 + "]" * 200_000 + "}")

    with pytest.raises(InvalidParentSnapshot, match="nested more than 100 levels deep") as caught:
        load_parent_snapshot(path)

    assert str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b'{"session_id": "caf\xe9"}', "is not UTF-8 text (byte 0xe9 at offset 19); save it as UTF-8"),
        (
            b'{"session_id": "s", "depth": ' + b"9" * 5000 + b"}",
            "holds a number of more than 4,300 digits; write it with fewer digits",
        ),
    ],
    ids=["latin-1", "5000-digit-number"],
)
def test_a_snapshot_file_that_cannot_be_read_as_json_names_the_file_and_the_fix(
    tmp_path: Path, data: bytes, problem: str
) -> None:
    path = tmp_path / "parent.json"
    path.write_bytes(data)

    with pytest.raises(InvalidParentSnapshot) as caught:
        load_parent_snapshot(path)

    assert str(caught.value) == f"parent snapshot {str(path)!r} {problem}"


def test_depth_must_be_an_integer_not_a_string_of_one() -> None:
    error = rejection({"session_id": "s-1", "depth": "0"})

    assert error.field == "depth"
    assert "valid integer" in str(error)


def test_a_history_message_one_level_past_the_bound_is_refused_and_one_at_it_is_kept() -> None:
    # the Content, its parts, the part and its functionCall are 4 levels; args holds the rest
    def message(levels: int) -> dict[str, Any]:
        return {"role": "model", "parts": [{"functionCall": {"name": "f", "args": nested(levels - 4)}}]}

    kept = parse_parent_snapshot({"session_id": "s-1", "history": [message(100)]})
    error = rejection({"session_id": "s-1", "history": [message(100), message(101)]})

    assert len(kept.history) == 1
    assert error.field == "history[1]"
    assert "history[1] is nested more than 100 levels deep" in str(error)


def test_a_snapshot_built_directly_is_bounded_like_a_parsed_one() -> None:
    deep = Content.model_validate({"role": "model", "parts": [{"functionCall": {"name": "f", "args": nested(300)}}]})

    with pytest.raises(InvalidParentSnapshot) as from_contents:
        ParentSnapshot(session_id="s-1", history=[Content(role="user"), deep])
    with pytest.raises(InvalidParentSnapshot) as from_wire:
        ParentSnapshot(session_id="s-1", history=[deep.to_wire()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="nested more than 100 levels"):
        ParentSnapshot(session_id="s-1", tools=[nested(120)])

    assert (from_contents.value.field, from_wire.value.field) == ("history[1]", "history[0]")
    assert ParentSnapshot(session_id="s-1", history=[deep.model_copy(update={"parts": []})]).history[0].parts == []


@pytest.mark.parametrize(
    ("spoil", "field", "where"),
    [
        ({"history": [{"role": "user", "parts": [{"text": "\ud800"}]}]}, "history[0]", "history[0].parts[0].text"),
        ({"system_instruction": "rules \udcff"}, "system_instruction", "field 'system_instruction'"),
        ({"tools": [{"name": "t", "parameters": {"x\ud800": {}}}]}, "tools[0]", "field 'tools[0].parameters[key 0]'"),
        ({"session_id": "s-\udcff"}, "session_id", "field 'session_id'"),
        ({"cwd": "/srv/\udcff"}, "cwd", "field 'cwd'"),
    ],
    ids=["history-text", "system-instruction", "tool-key", "session-id", "cwd"],
)
def test_a_string_that_is_not_valid_unicode_is_refused_naming_where_it_is(
    spoil: dict[str, Any], field: str, where: str
) -> None:
    error = rejection({"session_id": "s-1", **spoil})

    assert error.field == field
    assert f"{where} is not valid Unicode text: character" in str(error) and "send UTF-8 text" in str(error)


def test_a_snapshot_built_directly_from_contents_is_checked_for_text_that_is_not_valid_unicode() -> None:
    bad = Content.model_validate({"role": "user", "parts": [{"text": "ok"}, {"text": "\udfff"}]})

    with pytest.raises(InvalidParentSnapshot, match=r"history\[1\]\.parts\[1\]\.text is not valid Unicode"):
        ParentSnapshot(session_id="s-1", history=[Content(role="user"), bad])

"""Subagent definitions: the file format, its errors, the built-ins, the folder that overrides them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.errors import InvalidAgentDefinition
from workers.subagents.definitions import (
    EXPLORE_PROMPT,
    MAX_DEFINITION_BYTES,
    CatalogCache,
    built_in_catalog,
    load_catalog,
    parse_definition,
)

REVIEWER = """---
name: code-reviewer
description: Reviews a change for bugs and style.
tools: [read_file, grep_search]
model: gpt-4.1
max_turns: 12
color: blue
---
You are a meticulous code reviewer.

Report bugs first.
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_definition_file_gives_its_name_description_tools_model_turns_and_body_as_system_prompt() -> None:
    definition = parse_definition(REVIEWER, source="code-reviewer.md")
    assert definition.name == "code-reviewer"
    assert definition.description == "Reviews a change for bugs and style."
    assert definition.tools == ("read_file", "grep_search")
    assert definition.model == "gpt-4.1"
    assert definition.max_turns == 12
    assert definition.system_prompt == "You are a meticulous code reviewer.\n\nReport bugs first."
    assert definition.source == "code-reviewer.md"


def test_tools_may_be_one_comma_separated_string_and_model_inherit_means_the_parents() -> None:
    text = "---\nname: a\ndescription: d\ntools: read_file, glob\nmodel: inherit\n---\nbody\n"
    definition = parse_definition(text, source="a.md")
    assert definition.tools == ("read_file", "glob")
    assert definition.model is None


def test_omitted_tools_mean_every_tool_but_the_agent_tool() -> None:
    definition = parse_definition("---\nname: a\ndescription: d\n---\nbody\n", source="a.md")
    assert definition.tools is None


@pytest.mark.parametrize(
    ("text", "field", "fix"),
    [
        ("name: a\ndescription: d\n", "front matter", "start with a line `---`"),
        ("---\nname: a\ndescription: d\nbody\n", "front matter", "no closing `---`"),
        ("---\nname: [a\n---\nbody\n", "front matter", "not valid YAML"),
        ("---\n- a\n---\nbody\n", "front matter", "mapping"),
        ("---\ndescription: d\n---\nbody\n", "name", "`name` is required"),
        ("---\nname: a\n---\nbody\n", "description", "`description` is required"),
        ("---\nname: a b\ndescription: d\n---\nbody\n", "name", "letters, digits"),
        ("---\nname: Fork\ndescription: d\n---\nbody\n", "name", "reserved"),
        ("---\nname: a\ndescription: d\ntools: 3\n---\nbody\n", "tools", "list of at most"),
        ("---\nname: a\ndescription: d\ntools: [' x']\n---\nbody\n", "tools", "not a tool name"),
        ("---\nname: a\ndescription: d\ntools: ['*', read_file]\n---\nbody\n", "tools", "cannot be combined"),
        ("---\nname: a\ndescription: d\nmodel: 7\n---\nbody\n", "model", "model name or `inherit`"),
        ("---\nname: a\ndescription: d\nmax_turns: 0\n---\nbody\n", "max_turns", "whole number"),
        ("---\nname: a\ndescription: d\nmax_turns: true\n---\nbody\n", "max_turns", "whole number"),
        ("---\nname: a\ndescription: d\ntool: [read_file]\n---\nbody\n", "tool", "unknown field"),
        ("---\nname: a\ndescription: d\n---\n  \n", "body", "body"),
    ],
)
def test_a_bad_definition_names_the_file_the_field_and_the_fix(text: str, field: str, fix: str) -> None:
    with pytest.raises(InvalidAgentDefinition) as caught:
        parse_definition(text, source="bad.md")
    assert caught.value.path == "bad.md"
    assert caught.value.field == field
    assert str(caught.value).startswith("subagent definition bad.md: ")
    assert fix in str(caught.value)


def test_the_built_ins_are_general_purpose_with_the_parents_prompt_and_a_read_only_explore() -> None:
    catalog = built_in_catalog()
    general = catalog.find(None)
    assert general is not None and general.name == "general-purpose"
    assert general.system_prompt is None and general.tools == ("*",)  # today's behaviour: the parent's everything
    explore = catalog.find("explore")  # any case
    assert explore is not None and explore.system_prompt == EXPLORE_PROMPT
    assert explore.tools == ("read_file", "list_directory", "glob", "grep_search")
    assert catalog.names() == ["Explore", "general-purpose"]
    assert catalog.find("reviewer") is None


def test_a_folder_adds_definitions_and_overrides_a_built_in_of_the_same_name(tmp_path: Path) -> None:
    write(tmp_path, "code-reviewer.md", REVIEWER)
    write(tmp_path, "explore.md", "---\nname: Explore\ndescription: ours\ntools: [read_file]\n---\nOur explorer.\n")
    write(tmp_path, "notes.txt", "not a definition")
    catalog = load_catalog(tmp_path)
    assert catalog.names() == ["code-reviewer", "Explore", "general-purpose"]
    explore = catalog.find("Explore")
    assert explore is not None and explore.system_prompt == "Our explorer." and explore.source == "explore.md"
    assert [d["name"] for d in catalog.listing()] == ["code-reviewer", "Explore", "general-purpose"]


def test_two_files_defining_one_name_are_refused_naming_both(tmp_path: Path) -> None:
    write(tmp_path, "a.md", REVIEWER)
    write(tmp_path, "b.md", REVIEWER.replace("code-reviewer", "Code-Reviewer"))
    with pytest.raises(InvalidAgentDefinition, match=r"b\.md: `name` Code-Reviewer is also defined by a\.md"):
        load_catalog(tmp_path)


def test_an_oversized_file_and_a_missing_folder_are_refused(tmp_path: Path) -> None:
    write(tmp_path, "big.md", REVIEWER + "x" * MAX_DEFINITION_BYTES)
    with pytest.raises(InvalidAgentDefinition, match=r"big\.md: larger than 256 KiB") as caught:
        load_catalog(tmp_path)
    assert caught.value.field == "file"
    with pytest.raises(InvalidAgentDefinition, match="cannot list it") as caught:
        load_catalog(tmp_path / "missing")
    assert caught.value.field == "agents_dir"


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    (tmp_path / "latin.md").write_bytes(REVIEWER.encode("utf-8") + b"\xff\xfe")
    with pytest.raises(InvalidAgentDefinition, match="not UTF-8"):
        load_catalog(tmp_path)


def test_yaml_tags_that_build_python_objects_are_refused(tmp_path: Path) -> None:
    text = "---\nname: a\ndescription: !!python/object/apply:os.getcwd []\n---\nbody\n"
    with pytest.raises(InvalidAgentDefinition, match="not valid YAML"):
        parse_definition(text, source="evil.md")


def test_the_cache_reads_the_folder_again_when_a_file_changes(tmp_path: Path) -> None:
    path = write(tmp_path, "code-reviewer.md", REVIEWER)
    cache = CatalogCache(tmp_path)
    first = cache.get()
    assert cache.get() is first  # unchanged: not read again
    path.write_text(REVIEWER.replace("max_turns: 12", "max_turns: 13"), encoding="utf-8")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    reviewer = cache.get().find("code-reviewer")
    assert reviewer is not None and reviewer.max_turns == 13
    write(tmp_path, "broken.md", "no front matter")
    with pytest.raises(InvalidAgentDefinition, match=r"broken\.md"):
        cache.get()


def test_without_a_folder_the_cache_holds_the_built_ins() -> None:
    assert CatalogCache(None).get().names() == ["Explore", "general-purpose"]


def test_a_teammate_asked_for_as_a_fork_is_a_general_purpose_subagent() -> None:
    found = built_in_catalog().find("Fork")
    assert found is not None and found.name == "general-purpose"


def test_a_yaml_alias_bomb_is_refused_at_once_without_expanding_it() -> None:
    # nine levels of nine aliases: a billion strings if anything expanded it (its repr, a copy, a walk)
    levels = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    text = "---\nname: bomb\ndescription: [" + ", ".join(levels) + "]\n---\nbody\n"
    with pytest.raises(InvalidAgentDefinition, match=r"`description` is required .* got a list of 10 entries"):
        parse_definition(text, source="bomb.md")

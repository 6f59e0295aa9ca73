"""`forkq launch`: what it prints, and bad input that exits 2 with one line naming the field, writing nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from broker_config.settings import Settings
from tests.cli_support import PARENT, PROMPT, Run, launch, parent_file
from workers.history.params import MSG_FORK_TURNS_VALUE


def test_launch_json_prints_the_fork_id_and_its_status(forkq: Run) -> None:
    code, out, err = forkq(
        "launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork", "--fork-turns", "3", "--json"
    )

    assert (code, err) == (0, "")
    printed = json.loads(out)
    assert set(printed) == {"fork_id", "status"}
    assert printed["status"] == "queued"
    assert printed["fork_id"].startswith("f-")


def test_launch_prints_just_the_fork_id_without_json(forkq: Run) -> None:
    fork_id = launch(forkq, "--fork-turns", "all")

    code, out, _ = forkq("status", fork_id)
    assert code == 0
    assert out.startswith(f"{fork_id} queued attempt=0")


def test_an_invalid_fork_turns_exits_2_with_the_validation_message_and_writes_nothing(
    forkq: Run, redis_client: redis.Redis, forkq_env: Settings
) -> None:
    code, out, err = forkq(
        "launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork", "--fork-turns", "0"
    )

    assert (code, out) == (2, "")
    assert err == f"forkq launch: {MSG_FORK_TURNS_VALUE}\n"
    assert redis_client.dbsize() == 0


def test_an_invalid_parent_file_exits_2_naming_the_field(forkq: Run, tmp_path: Path, redis_client: redis.Redis) -> None:
    bad = tmp_path / "parent.json"
    bad.write_text(json.dumps({"session_id": "s-1", "approval_mode": "sometimes"}))

    code, _, err = forkq("launch", "--parent", str(bad), "--prompt", PROMPT)

    assert code == 2
    assert "approval_mode" in err and str(bad) in err
    assert redis_client.dbsize() == 0


# ── bad input at launch: exit 2, one line naming the field, nothing written ───────────────────


def nested(levels: int, leaf: Any = "x") -> Any:
    """A value `levels` objects deep, built without recursion."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def deep_history_parent(tmp_path: Path) -> str:
    history = json.loads(Path(PARENT).read_text(encoding="utf-8"))["history"]
    deep_call = {"role": "model", "parts": [{"functionCall": {"name": "read_file", "args": nested(600)}}]}
    return parent_file(tmp_path, history=[*history[:-1], deep_call, history[-1]])


def written(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


FORK_ARGS = ["--prompt", PROMPT, "--subagent-type", "fork"]
HISTORY = json.loads(Path(PARENT).read_text(encoding="utf-8"))["history"]
SURROGATE_CALL = {"role": "model", "parts": [{"functionCall": {"name": "read_file", "args": {"\udcff": 1}}}]}
DEEP_TOOL = {"name": "deep", "description": "d", "parameters": nested(300, {"type": "object"})}
LATIN1 = '{"session_id": "s-1", "cwd": "/tmp/caf\xe9"}'.encode("latin-1")
DEEP_JSON = ('{"session_id": "s-1", "tools": ' + "[" * 200_000 + "]" * 200_000 + "}").encode()

# each bad input of a launch: (launch arguments built in a temporary directory, what the message must name)
BAD_LAUNCHES: dict[str, Callable[[Path], tuple[list[str], str]]] = {
    "parent-not-utf8": lambda d: (["--parent", written(d / "latin1.json", LATIN1), *FORK_ARGS], "UTF-8"),
    "json-200000-deep": lambda d: (
        ["--parent", written(d / "deep.json", DEEP_JSON), *FORK_ARGS],
        "nested more than 100 levels",
    ),
    "history-600-deep": lambda d: (["--parent", deep_history_parent(d), *FORK_ARGS], "history[43]"),
    "fork-turns-5000-digits": lambda d: (["--parent", PARENT, *FORK_ARGS, "--fork-turns", "9" * 5000], "fork_turns"),
    "max-wall-s-nan": lambda d: (["--parent", PARENT, *FORK_ARGS, "--max-wall-s", "nan"], "max_wall_s"),
    "max-wall-s-inf": lambda d: (["--parent", PARENT, *FORK_ARGS, "--max-wall-s", "inf"], "max_wall_s"),
    "depth-string": lambda d: (["--parent", parent_file(d, depth="0"), *FORK_ARGS], "depth"),
    "number-5000-digits": lambda d: (
        ["--parent", written(d / "n.json", b'{"session_id": "s-1", "depth": ' + b"1" * 5000 + b"}"), *FORK_ARGS],
        "4,300 digits",
    ),
    "tool-schema-300-deep": lambda d: (["--parent", parent_file(d, tools=[DEEP_TOOL]), *FORK_ARGS], "tools[0]"),
    "output-schema-300-deep": lambda d: (
        ["--parent", PARENT, *FORK_ARGS, "--output-schema", written(d / "s.json", json.dumps(DEEP_TOOL).encode())],
        "output_schema",
    ),
    "fork-tools-200000-deep": lambda d: (
        ["--parent", PARENT, *FORK_ARGS, "--fork-tools", "[" * 200_000 + "]" * 200_000],
        "--fork-tools",
    ),
    # a byte that is not UTF-8 on the command line reaches Python as a lone surrogate (surrogateescape),
    # and so does a "\ud800" escape without its pair in a JSON file: neither can be stored as UTF-8
    "prompt-byte-not-utf8": lambda d: (
        ["--parent", PARENT, "--prompt", "bad \udcff byte", "--subagent-type", "fork"],
        'Parameter "prompt" is not valid Unicode text: character 4 is a lone surrogate (U+DCFF, the byte 0xff',
    ),
    "description-byte-not-utf8": lambda d: (
        ["--parent", PARENT, *FORK_ARGS, "--description", "caf\udce9"],
        'Parameter "description"',
    ),
    "fork-tools-byte-not-utf8": lambda d: (
        ["--parent", PARENT, *FORK_ARGS, "--fork-tools", "read_file,gr\udcffp"],
        'Parameter "fork_tools" entry 1',
    ),
    "history-text-lone-surrogate": lambda d: (
        ["--parent", parent_file(d, history=[{"role": "user", "parts": [{"text": "\ud800"}]}]), *FORK_ARGS],
        "history[0].parts[0].text is not valid Unicode text: character 0 is a lone surrogate (U+D800",
    ),
    "history-args-key-lone-surrogate": lambda d: (
        ["--parent", parent_file(d, history=[*HISTORY[:-1], SURROGATE_CALL, HISTORY[-1]]), *FORK_ARGS],
        f"history[{len(HISTORY) - 1}].parts[0].functionCall.args[key 0]",
    ),
    "tool-declaration-lone-surrogate": lambda d: (
        ["--parent", parent_file(d, tools=[{"name": "t", "description": "\udfff"}]), *FORK_ARGS],
        "field 'tools[0].description' is not valid Unicode text",
    ),
    "system-instruction-lone-surrogate": lambda d: (
        ["--parent", parent_file(d, system_instruction={"parts": [{"text": "\ud800"}]}), *FORK_ARGS],
        "field 'system_instruction.parts[0].text' is not valid Unicode text",
    ),
    "cwd-byte-not-utf8": lambda d: (
        ["--parent", parent_file(d, cwd="/srv/caf\udce9"), *FORK_ARGS],
        "field 'cwd' is not valid Unicode text: character 8",
    ),
    "model-lone-surrogate": lambda d: (
        ["--parent", parent_file(d, model="gpt\ud800"), *FORK_ARGS],
        "field 'model' is not valid Unicode text",
    ),
    "max-tokens-negative": lambda d: (
        ["--parent", PARENT, *FORK_ARGS, "--max-tokens", "-5"],
        "max_tokens must be a positive whole number of tokens",
    ),
    "max-tokens-zero": lambda d: (["--parent", PARENT, *FORK_ARGS, "--max-tokens", "0"], "max_tokens"),
    "output-schema-lone-surrogate": lambda d: (
        ["--parent", PARENT, *FORK_ARGS, "--output-schema", written(d / "s.json", b'{"title": "\\ud800"}')],
        "output_schema.title is not valid Unicode text",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LAUNCHES))
def test_bad_launch_input_exits_2_with_one_line_naming_the_field_and_writes_nothing(
    forkq: Run, tmp_path: Path, redis_client: redis.Redis, case: str
) -> None:
    argv, named = BAD_LAUNCHES[case](tmp_path)

    code, out, err = forkq("launch", *argv)

    assert (code, out) == (2, ""), err
    assert err.startswith("forkq launch: ") and err.count("\n") == 1, err
    assert named in err
    assert redis_client.dbsize() == 0


def test_a_tool_schema_at_the_nesting_limit_is_accepted(forkq: Run, tmp_path: Path) -> None:
    # 99 levels under the declaration object: 100 in all, the documented bound
    tool = {"name": "deep", "description": "d", "parameters": nested(98, {"type": "object"})}

    code, out, err = forkq("launch", "--parent", parent_file(tmp_path, tools=[tool]), "--prompt", PROMPT)

    assert code == 0, err
    assert out.startswith("f-")


# ── subagents: definitions, seed modes, persona, tool filter, max_depth, providers ─────────────


def test_agents_lists_the_built_ins_and_the_folders_definitions_in_text_and_json(
    forkq: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tester.md").write_text(
        "---\nname: tester\ndescription: Writes tests.\ntools: read_file, write_file\n---\nYou write tests.\n"
    )
    monkeypatch.setenv("FORKQ_AGENTS_DIR", str(tmp_path))

    code, out, err = forkq("agents", "--json")
    assert (code, err) == (0, "")
    listed = {a["name"]: a for a in json.loads(out)}
    assert list(listed) == ["Explore", "general-purpose", "tester"]
    assert listed["tester"]["tools"] == ["read_file", "write_file"] and listed["tester"]["source"] == "tester.md"
    assert listed["general-purpose"]["system_prompt"] is None

    code, out, _ = forkq("agents")
    assert code == 0
    assert "tester (tester.md): Writes tests." in out and "tools: read_file, write_file" in out


def test_agents_exits_2_naming_a_malformed_file(forkq: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.md").write_text("---\nname: bad\n---\nbody\n")
    monkeypatch.setenv("FORKQ_AGENTS_DIR", str(tmp_path))
    code, out, err = forkq("agents", "--json")
    assert (code, out) == (2, "")
    assert err.startswith("forkq agents: subagent definition bad.md: `description` is required")


def test_providers_lists_spawn_and_fork_with_each_seed_modes_capabilities(forkq: Run) -> None:
    code, out, _ = forkq("providers", "--json")
    assert code == 0
    providers = {p["name"]: p for p in json.loads(out)}
    assert set(providers) == {"spawn", "fork"}
    assert providers["fork"]["seedModes"]["fork_turns"]["persona"] is False
    code, out, _ = forkq("providers")
    assert "seed_mode completed_turns: outputSchema=yes, depthLimit=yes, toolFilter=yes, persona=yes" in out


def test_launch_takes_seed_mode_persona_tool_filter_and_max_depth(forkq: Run, tmp_path: Path) -> None:
    persona = tmp_path / "persona.md"
    persona.write_text("You write the PR description.\n", encoding="utf-8")
    fork_id = launch(
        forkq,
        "--seed-mode",
        "completed-turns",
        "--persona",
        str(persona),
        "--tool-filter",
        "read_file,glob",
        "--max-depth",
        "1",
    )

    code, out, _ = forkq("inspect", fork_id, "--json")
    assert code == 0
    record = json.loads(out)
    assert record["seed_mode"] == "completed_turns" and record["persona"] is True
    assert record["system_instruction"] == "You write the PR description.\n"
    assert [t["name"] for t in record["tools"]] == ["read_file", "glob"]
    assert record["tool_filter"] == ["read_file", "glob"] and record["max_depth"] == 1
    assert record["approval_mode"] == "default"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--persona", "PERSONA"), 'persona is not available for forks with seed_mode "fork_turns"'),
        (("--tool-filter", "read_file"), 'tool_filter is not available for forks with seed_mode "fork_turns"'),
        (
            ("--seed-mode", "completed-turns", "--fork-turns", "2"),
            'Parameter "fork_turns" cannot be used with seed_mode',
        ),
        (("--persona", "MISSING"), "cannot read it"),
    ],
)
def test_launch_refuses_what_the_fork_mode_lacks_with_exit_2_and_writes_nothing(
    forkq: Run, tmp_path: Path, redis_client: redis.Redis, extra: tuple[str, ...], message: str
) -> None:
    persona = tmp_path / "persona.md"
    persona.write_text("You are someone else.", encoding="utf-8")
    argv = [str(persona) if a == "PERSONA" else str(tmp_path / "missing") if a == "MISSING" else a for a in extra]
    code, out, err = forkq("launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork", *argv)
    assert (code, out) == (2, "")
    assert message in err
    assert redis_client.dbsize() == 0


# ── conversations: send ───────────────────────────────────────────────────────────────────────


def test_send_gives_a_queued_fork_a_message_by_id_by_file_and_to_a_teammate_by_name(forkq: Run, tmp_path: Path) -> None:
    fork_id = launch(forkq)
    code, out, err = forkq("send", fork_id, "Also the tests.", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == {"fork_id": fork_id, "outcome": "queued", "status": "queued", "waiting": 1}
    message = tmp_path / "msg.txt"
    message.write_text("From a file.", encoding="utf-8")
    code, out, _ = forkq("send", fork_id, "--file", str(message))
    assert code == 0 and "in its inbox (2 waiting)" in out

    session = json.loads(Path(PARENT).read_text(encoding="utf-8"))["session_id"]
    code, out, err = forkq("launch", "--parent", PARENT, "--prompt", PROMPT, "--name", "ann")
    assert code == 0, err
    teammate = out.strip()
    code, out, _ = forkq("send", "--session", session, "--to", "ann", "Hello ann.", "--json")
    assert code == 0 and json.loads(out)["fork_id"] == teammate


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "name the fork"),
        (("FORK",), "give the message once"),
        (("FORK", "a", "b"), "give the message once"),
        (("--to", "ann", "hi"), "--to and --session go together"),
        (("FORK", ""), "the message is empty"),
    ],
)
def test_send_with_bad_arguments_exits_2_naming_the_problem(
    forkq: Run, redis_client: redis.Redis, argv: tuple[str, ...], message: str
) -> None:
    fork_id = launch(forkq)
    code, out, err = forkq("send", *[fork_id if a == "FORK" else a for a in argv])
    assert (code, out) == (2, "")
    assert message in err
    assert redis_client.llen(f"forkq-test:{{{fork_id}}}:inbox") == 0


def test_send_to_a_cancelled_fork_exits_2_saying_why(forkq: Run) -> None:
    fork_id = launch(forkq)
    assert forkq("cancel", fork_id)[0] == 0
    code, out, err = forkq("send", fork_id, "hello?")
    assert (code, out) == (2, "")
    assert f"fork {fork_id} cancelled, so it takes no more messages" in err


def test_a_snapshot_over_the_bounds_exits_2_naming_the_largest_folders_and_the_fix_and_writes_nothing(
    forkq: Run, tmp_path: Path, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a parent's tree whose `data/` folder holds most of its bytes, and a 4 KB bound
    tree = tmp_path / "proj"
    (tree / "data").mkdir(parents=True)
    (tree / "data" / "dump.bin").write_bytes(b"\0" * 6000)
    (tree / "main.py").write_text("print()\n", encoding="utf-8")
    monkeypatch.setenv("FORKQ_WORKSPACE_MAX_BYTES", "4096")

    # When a snapshot fork is launched from it
    code, out, err = forkq("launch", "--parent", parent_file(tmp_path, cwd=str(tree)), "--prompt", PROMPT)

    # Then it exits 2, naming the folder, the bound and the fix, and Redis holds nothing
    assert (code, out) == (2, "")
    assert "data" in err and "FORKQ_WORKSPACE_MAX_BYTES" in err and ".forkqignore" in err and "shared" in err, err
    assert redis_client.dbsize() == 0


def test_a_shared_launch_outside_the_shared_roots_exits_2_and_writes_nothing(
    forkq: Run, tmp_path: Path, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORKQ_SHARED_ROOTS", str(tmp_path / "shared"))
    argv = ["launch", "--parent", parent_file(tmp_path, cwd="/etc"), "--prompt", PROMPT, "--workspace", "shared"]
    code, _, err = forkq(*argv)
    assert code == 2 and "FORKQ_SHARED_ROOTS" in err
    assert redis_client.dbsize() == 0


def test_changes_and_apply_of_a_shared_fork_say_it_has_no_snapshot(forkq: Run, tmp_path: Path) -> None:
    fork_id = launch(forkq, "--fork-turns", "1", "--workspace", "shared")
    for command in ("changes", "apply"):
        code, _, err = forkq(command, fork_id)
        assert code == 1 and "no snapshot workspace" in err, err


@pytest.mark.parametrize("argv", [["--no-network"], ["--network", "false"]])
def test_launch_records_a_workspace_cut_off_the_network(forkq: Run, argv: list[str]) -> None:
    fork_id = launch(forkq, "--fork-turns", "1", *argv)
    code, out, _ = forkq("inspect", fork_id, "--json")
    assert code == 0 and json.loads(out)["workspace"]["network"] is False


def test_a_network_option_that_is_not_true_or_false_exits_2(forkq: Run) -> None:
    with pytest.raises(SystemExit) as exited:
        forkq("launch", "--parent", PARENT, "--prompt", PROMPT, "--network", "maybe")
    assert exited.value.code == 2

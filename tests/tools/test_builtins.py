"""The built-in tools' declarations, and the tools installed distributions add (workers/tools/builtins.py)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from tests.tools_support import error, run
from workers.tools.builtins import ENTRY_POINT_GROUP, load_tools
from workers.tools.registry import ToolRegistry


def test_the_builtins_are_declared_with_their_flags(registry: ToolRegistry) -> None:
    flags = {name: (t.mutating, t.idempotent, t.edit) for name, t in registry.tools.items()}
    assert flags == {
        "read_file": (False, True, False),
        "list_directory": (False, True, False),
        "glob": (False, True, False),
        "grep_search": (False, True, False),
        "write_file": (True, True, True),
        "edit": (True, False, True),
        "run_shell_command": (True, False, False),
    }
    for tool in registry.tools.values():
        declaration = tool.declaration
        assert declaration["name"] == tool.name and declaration["description"]
        assert declaration["parameters"]["additionalProperties"] is False


PLUGIN = """
from workers.tools import Tool

def _effect(args, ctx):
    with open(args["target"], "a", encoding="utf-8") as out:
        out.write("ran\\n")
    return "effect"

SCHEMA = {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"],
          "additionalProperties": False}

def tools():
    return [Tool("plugin_effect", "Appends a line.", SCHEMA, _effect, mutating=True)]

BROKEN = Tool("plugin_broken", "Bad schema.", {"type": "objekt"}, _effect)
"""


def test_entry_point_tools_are_loaded_and_validated_like_builtins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: an installed distribution declaring a good and a broken tool in the forkq.tools group
    module = f"forkq_plugin_{uuid.uuid4().hex}"
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{module}.py").write_text(PLUGIN, encoding="utf-8")
    dist = site / f"{module}-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.0\n", encoding="utf-8")
    entries = f"[{ENTRY_POINT_GROUP}]\ngood = {module}:tools\nbroken = {module}:BROKEN\n"
    (dist / "entry_points.txt").write_text(entries, encoding="utf-8")
    monkeypatch.syspath_prepend(str(site))
    target = tmp_path / "effects.txt"

    # When: the worker loads its tools
    with caplog.at_level(logging.ERROR, logger="forkq.tools"):
        registry = load_tools()

    # Then: the good tool is there beside the built-ins, validated; the broken one was logged and skipped
    assert {"plugin_effect", "read_file", "run_shell_command"} <= set(registry.tools)
    assert "plugin_broken" not in registry.tools
    assert "plugin_broken" in caplog.text and "not a valid JSON schema" in caplog.text
    assert "'target' is a required property" in error(run(registry, tmp_path, "plugin_effect"))
    assert "was unexpected" in error(run(registry, tmp_path, "plugin_effect", target=str(target), extra=1))
    assert not target.exists()
    assert run(registry, tmp_path, "plugin_effect", target=str(target)) == {"output": "effect"}
    assert target.read_text(encoding="utf-8") == "ran\n"

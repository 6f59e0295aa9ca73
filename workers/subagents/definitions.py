"""Subagent definitions: Markdown files with YAML front matter, the built-ins, and the folder that overrides them.

A definition names a `subagent_type`. Its front matter holds `name` and `description` (required),
`tools` (a list of tool names, or one comma-separated string; omitted: every tool of the parent but
the Agent tool; `"*"`: every tool, the Agent tool included), `model` (omitted or `inherit`: the
parent's) and `max_turns`; its body is the system prompt (the persona). Keys that other agents keep
for their own user interfaces (`color`) are passed over; any other key is refused, so a misspelt
`tool:` never silently grants every tool.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from workers.base.limits import MAX_LAUNCH_TURNS, shown
from workers.errors import InvalidAgentDefinition

MAX_DEFINITION_BYTES: Final = 256 * 1024  # one definition file
MAX_DEFINITIONS: Final = 1000  # files one folder may hold
MAX_TOOLS: Final = 1000  # names in one `tools` list
NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
FIELDS: Final = ("name", "description", "tools", "model", "max_turns")
PASSED_OVER: Final = ("color",)  # other agents' display settings, meaningless here
ALL_TOOLS: Final = "*"
BUILT_IN: Final = "built-in"
GENERAL_PURPOSE: Final = "general-purpose"

EXPLORE_PROMPT: Final = """\
You are Explore, a read-only agent that finds its way around a codebase and answers questions about it.
- You cannot change anything: you have no tool that writes files or runs commands, and you must not
  ask for one. Read, list, glob and search instead.
- Search broadly first (glob for file names, grep for symbols and strings), then read the files that
  matter. Prefer several targeted searches over reading whole trees.
- Your final message is all the caller sees: answer the question directly, cite the files and line
  numbers your answer rests on, and say what you could not find."""


class AgentDefinition(BaseModel):
    """One subagent type: its description, persona, tools, model and turn limit, and where it was read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    system_prompt: str | None = None  # None: the parent's system instruction (the built-in general-purpose)
    tools: tuple[str, ...] | None = None  # None: every tool but the Agent tool; ("*",): every tool
    model: str | None = None  # None: the parent's
    max_turns: int | None = None
    source: str = BUILT_IN  # "built-in", or the file's name in FORKQ_AGENTS_DIR

    def listing(self) -> dict[str, Any]:
        """The definition as `forkq agents --json` lists it."""
        return {
            "name": self.name,
            "description": self.description,
            "tools": None if self.tools is None else list(self.tools),
            "model": self.model,
            "max_turns": self.max_turns,
            "source": self.source,
            "system_prompt": self.system_prompt,
        }


BUILT_INS: Final = (
    AgentDefinition(
        name=GENERAL_PURPOSE,
        description="General-purpose agent for researching complex questions, searching code and carrying out "
        "multi-step tasks. It runs with the parent's system prompt, tools and model.",
        tools=(ALL_TOOLS,),
    ),
    AgentDefinition(
        name="Explore",
        description="Fast read-only agent for exploring a codebase: finds files, searches code, reads it and "
        "answers questions about it. It cannot change anything.",
        system_prompt=EXPLORE_PROMPT,
        tools=("read_file", "list_directory", "glob", "grep_search"),
    ),
)


def parse_definition(text: str, *, source: str) -> AgentDefinition:
    """A definition from a file's text: `---`, YAML front matter, `---`, then the body (the system prompt).

    Raises:
        InvalidAgentDefinition: the text is not one, naming the field and the fix.
    """
    front, body = _split_front_matter(text, source)
    meta = _load_yaml(front, source)
    for key in meta:
        if key not in FIELDS and key not in PASSED_OVER:
            field = key[:60] if isinstance(key, str) else _shown(key)
            raise _bad(source, field, f"unknown field {_shown(key)}; a definition takes {', '.join(FIELDS)}")
    prompt = body.strip()
    if not prompt:
        raise _bad(source, "body", "the body (the subagent's system prompt) is empty; write it below the front matter")
    return AgentDefinition(
        name=_name(meta, source),
        description=_text(meta, "description", source),
        system_prompt=prompt,
        tools=_tools(meta.get("tools"), source),
        model=_model(meta.get("model"), source),
        max_turns=_max_turns(meta.get("max_turns"), source),
        source=source,
    )


def _shown(value: object) -> str:
    """A front-matter value for a message: a list or mapping by its size only (YAML aliases can make a small
    file hold a structure whose repr would never end)."""
    if isinstance(value, list | dict):
        return f"a {'list' if isinstance(value, list) else 'mapping'} of {len(value)} entries"
    return shown(value)


def _bad(source: str, field: str, problem: str) -> InvalidAgentDefinition:
    return InvalidAgentDefinition(f"subagent definition {source}: {problem}", path=source, field=field)


def _split_front_matter(text: str, source: str) -> tuple[str, str]:
    lines = text.lstrip("\ufeff").splitlines(keepends=True)
    if not lines or lines[0].strip() != "---":
        raise _bad(source, "front matter", "it must start with a line `---`, the YAML front matter, then `---`")
    for index, line in enumerate(lines[1:], start=1):
        if line.strip() == "---":
            return "".join(lines[1:index]), "".join(lines[index + 1 :])
    raise _bad(source, "front matter", "the front matter has no closing `---` line")


def _load_yaml(front: str, source: str) -> dict[str, Any]:
    import yaml  # noqa: PLC0415  (only where definitions are read: `forkq status` never loads it)

    try:
        meta = yaml.safe_load(front)
    except yaml.YAMLError as exc:
        raise _bad(source, "front matter", f"the front matter is not valid YAML ({exc}); fix its syntax") from exc
    if not isinstance(meta, dict):
        raise _bad(source, "front matter", "the front matter must be a mapping of fields such as `name: reviewer`")
    return meta


def _text(meta: Mapping[str, Any], field: str, source: str) -> str:
    value = meta.get(field)
    if not isinstance(value, str) or not value.strip():
        raise _bad(source, field, f"`{field}` is required and must be a non-empty string, got {_shown(value)}")
    return value.strip()


def _name(meta: Mapping[str, Any], source: str) -> str:
    name = _text(meta, "name", source)
    if not NAME_RE.fullmatch(name):
        raise _bad(
            source,
            "name",
            f"`name` {_shown(name)} must be 1-64 letters, digits, '_', '.', ':', '-' starting with a "
            "letter or digit, such as `code-reviewer`",
        )
    if name.lower() == "fork":
        raise _bad(source, "name", '`name` "fork" is reserved for forks of the parent; choose another name')
    return name


def _tools(value: object, source: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, list) or len(names) > MAX_TOOLS:
        raise _bad(source, "tools", f"`tools` must be a list of at most {MAX_TOOLS} tool names, got {_shown(value)}")
    for name in names:
        if not isinstance(name, str) or not name or name != name.strip() or len(name) > 200:
            raise _bad(source, "tools", f"`tools` entry {_shown(name)} is not a tool name; list names like read_file")
    if ALL_TOOLS in names and len(names) > 1:
        raise _bad(source, "tools", '`tools` "*" means every tool; it cannot be combined with names')
    return tuple(dict.fromkeys(names))


def _model(value: object, source: str) -> str | None:
    if value is None or value == "inherit":
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise _bad(source, "model", f"`model` must be a model name or `inherit`, got {_shown(value)}")
    return value.strip()


def _max_turns(value: object, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_LAUNCH_TURNS:
        raise _bad(
            source,
            "max_turns",
            f"`max_turns` must be a whole number from 1 to {MAX_LAUNCH_TURNS:,}, got {_shown(value)}",
        )
    return value


@dataclass(frozen=True)
class Catalog:
    """The definitions a launcher knows: the built-ins, overridden by the folder's files of the same name."""

    definitions: Mapping[str, AgentDefinition]  # by name, lower case

    def find(self, subagent_type: str | None) -> AgentDefinition | None:
        """The definition of a `subagent_type` (any case), or None if there is none.

        None, and `fork` (a named teammate asked for as a fork, which never inherits history), are general-purpose.
        """
        wanted = (subagent_type or GENERAL_PURPOSE).lower()
        return self.definitions.get(GENERAL_PURPOSE if wanted == "fork" else wanted)

    def names(self) -> list[str]:
        """The known types, sorted."""
        return sorted((d.name for d in self.definitions.values()), key=str.lower)

    def listing(self) -> list[dict[str, Any]]:
        """Every definition, as `forkq agents --json` lists them."""
        return [self.definitions[name.lower()].listing() for name in self.names()]


def built_in_catalog() -> Catalog:
    """The built-ins alone (no folder configured)."""
    return Catalog({d.name.lower(): d for d in BUILT_INS})


def load_catalog(folder: Path | None) -> Catalog:
    """The built-ins and every `*.md` of `folder` (a file overrides the built-in of the same name).

    Raises:
        InvalidAgentDefinition: the folder cannot be read, or a file is malformed, or two files define one name.
    """
    definitions = {d.name.lower(): d for d in BUILT_INS}
    if folder is None:
        return Catalog(definitions)
    seen: dict[str, str] = {}
    for path in _definition_files(folder):
        definition = parse_definition(_read(path), source=path.name)
        key = definition.name.lower()
        if key in seen:
            raise _bad(path.name, "name", f"`name` {definition.name} is also defined by {seen[key]}; rename one")
        seen[key] = path.name
        definitions[key] = definition
    return Catalog(definitions)


def _definition_files(folder: Path) -> list[Path]:
    try:
        files = sorted(p for p in folder.iterdir() if p.suffix == ".md" and p.is_file())
    except OSError as exc:
        raise InvalidAgentDefinition(
            f"FORKQ_AGENTS_DIR {folder}: cannot list it ({exc.strerror}); point it at a readable folder of *.md "
            "files, or unset it",
            path=str(folder),
            field="agents_dir",
        ) from exc
    if len(files) > MAX_DEFINITIONS:
        raise InvalidAgentDefinition(
            f"FORKQ_AGENTS_DIR {folder}: {len(files):,} definition files, more than {MAX_DEFINITIONS:,}",
            path=str(folder),
            field="agents_dir",
        )
    return files


def _read(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_DEFINITION_BYTES + 1)
    except OSError as exc:
        raise _bad(path.name, "file", f"cannot read it ({exc.strerror}); check its permissions") from exc
    if len(data) > MAX_DEFINITION_BYTES:
        raise _bad(path.name, "file", f"larger than {MAX_DEFINITION_BYTES // 1024} KiB; shorten its system prompt")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(path.name, "file", "not UTF-8 text; save it as UTF-8") from exc


class CatalogCache:
    """A folder's catalog, read again only when a file in it changed (names, sizes, modification times).

    Thread-safe. A launcher asks it at every launch, so an edited definition applies to the next launch.
    """

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._seen: tuple[tuple[str, int, int], ...] | None = None
        self._catalog = built_in_catalog()

    def get(self) -> Catalog:
        """The current catalog.

        Raises:
            InvalidAgentDefinition: as `load_catalog`.
        """
        if self.folder is None:
            return self._catalog
        marks = _marks(self.folder)
        with self._lock:
            if marks is not None and marks == self._seen:
                return self._catalog
        catalog = load_catalog(self.folder)
        with self._lock:
            self._catalog, self._seen = catalog, marks
        return catalog


def _marks(folder: Path) -> tuple[tuple[str, int, int], ...] | None:
    try:
        with os.scandir(folder) as entries:
            found = [(e.name, e.stat()) for e in entries if e.name.endswith(".md")]
    except OSError:
        return None  # load_catalog reports it
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in found))

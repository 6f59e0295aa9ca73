"""The Agent tool's parameters: validation in the contract's order (docs/fork-history.md §4), and their schema."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ModelWrapValidatorHandler,
    ValidationInfo,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from workers.base.limits import shown, text_problem
from workers.errors import InvalidAgentParams

FORK_TYPE: Final = "fork"
FORK_TURNS_PATTERN: Final = "^[1-9][0-9]*$"
_FORK_TURNS_RE: Final = re.compile(r"[1-9][0-9]*")  # fullmatch: `$` would accept a trailing newline

MSG_FORK_TURNS_VALUE: Final = 'Parameter "fork_turns" must be "all" or a positive integer string such as "3".'
FORK_TURNS_MAX_DIGITS: Final = 20  # more turns than any history holds; bounds what int() is asked to convert
MSG_FORK_TURNS_DIGITS: Final = (
    f'Parameter "fork_turns" has more than {FORK_TURNS_MAX_DIGITS} digits; use "all", or a positive integer string '
    f'of at most {FORK_TURNS_MAX_DIGITS} digits such as "3".'
)
MSG_FORK_TURNS_NOT_FORK: Final = 'Parameter "fork_turns" can only be used with subagent_type "fork".'
MSG_FORK_TURNS_TEAMMATE: Final = 'Parameter "fork_turns" cannot be used when spawning a named teammate.'
MSG_MODEL_FORK: Final = 'Parameter "model" cannot be used with subagent_type "fork".'
MSG_FORK_TOOLS_NOT_FORK: Final = 'Parameter "fork_tools" can only be used with subagent_type "fork".'
MSG_FORK_TOOLS_TEAMMATE: Final = 'Parameter "fork_tools" cannot be used when spawning a named teammate.'
MSG_FORK_TOOLS_LIST: Final = (
    'Parameter "fork_tools" must be an array of non-empty tool names without surrounding whitespace.'
)
# a launch's approval policy for calls that need a person's decision: both the launcher and the loop read it
ApprovalPolicy = Literal["deny", "park"]  # what a call that needs approval gets: a denial, or the fork parks
APPROVAL_POLICIES: Final[tuple[ApprovalPolicy, ...]] = get_args(ApprovalPolicy)


def depth_error(limit: int) -> str:
    """The answer to an Agent call past the nesting limit (the loop's), and a launch's reason (the client's)."""
    return (
        f"Error: Nesting depth limit reached (max {limit}). Complete this task directly with your own tools "
        "instead of spawning another sub-agent."
    )


MSG_FORK_TOOLS_STAR: Final = (
    'Parameter "fork_tools" does not accept "*"; omit it to allow every otherwise-executable inherited tool.'
)
MSG_FORK_TOOLS_WILDCARD: Final = (
    'Parameter "fork_tools" wildcard entries must be "mcp__*" or a trailing MCP tool-prefix pattern such as '
    '"mcp__github__read_*".'
)

_STRING_PARAMS: Final = ("subagent_type", "name", "model")
MAX_CHARS: Final = {"description": 1000, "prompt": 1_000_000, "subagent_type": 200, "name": 200, "model": 200}
MAX_FORK_TOOLS: Final = 1000  # entries of a `fork_tools` list, each at most MAX_CHARS["name"] characters
KNOWN_PARAMS: Final = (
    "description",
    "prompt",
    "subagent_type",
    "name",
    "fork_turns",
    "fork_tools",
    "model",
    "run_in_background",
)

ForkTurns = Literal["all"] | int
AGENT_CALL: Final = "agent_call"  # validation context: the data is an Agent call's arguments, where null is given
AGENT_CALL_CONTEXT: Final = {AGENT_CALL: True}


class AgentParams(BaseModel):
    """A valid Agent tool call: every instance has passed the contract (docs/fork-history.md §4), once.

    `validate_agent_params(raw)` checks an Agent call's arguments as the parent's model sent them (a key
    given as null counts as given); `AgentParams(**fields)` checks the same rules with None meaning omitted.
    Either raises `InvalidAgentParams` naming the first rule broken. `fork_turns` is kept as given (None:
    omitted), and `turns` is its normalized value. Its JSON schema is the Agent tool's own
    (`agent_tool_schema`). `model_construct` skips the contract: use it only for values that passed it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = 1
    description: str
    prompt: str
    subagent_type: str | None = None
    name: str | None = None
    fork_turns: str | None = None
    fork_tools: tuple[str, ...] | None = None  # execution allowlist (forks only); () means no tool may run
    model: str | None = None
    run_in_background: bool | None = None
    # `fork_turns` normalized by the contract's check: "all" or the positive number of turns (never dumped)
    turns: ForkTurns = Field("all", exclude=True)

    @model_validator(mode="wrap")
    @classmethod
    def _contract(cls, data: Any, handler: ModelWrapValidatorHandler[AgentParams], info: ValidationInfo) -> AgentParams:
        if isinstance(data, AgentParams) or not isinstance(data, Mapping):  # not a call: pydantic's own type error
            return handler(data)
        if not (info.context or {}).get(AGENT_CALL):  # Python's keywords: None is a keyword left out
            data = {name: value for name, value in data.items() if value is not None}
        return handler(_checked_fields(data))

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return agent_tool_schema()

    @property
    def is_fork(self) -> bool:
        """A fork inherits history; a named teammate never does, whatever its type."""
        return _is_fork_type(self.subagent_type) and self.name is None


def _is_fork_type(subagent_type: object) -> bool:
    return isinstance(subagent_type, str) and subagent_type.lower() == FORK_TYPE


def normalize_fork_turns(value: object) -> ForkTurns:
    """`"all"` or N for a valid `fork_turns`; None (omitted) means `"all"`.

    Raises:
        InvalidAgentParams: anything but `"all"` or a string of a positive integer without sign,
            spaces or leading zeros.
    """
    if value is None or (isinstance(value, str) and value == "all"):
        return "all"
    if isinstance(value, str) and _FORK_TURNS_RE.fullmatch(value):
        if len(value) > FORK_TURNS_MAX_DIGITS:  # int() refuses 4,300 digits and more, with a ValueError
            raise InvalidAgentParams(MSG_FORK_TURNS_DIGITS, field="fork_turns")
        return int(value)
    raise InvalidAgentParams(MSG_FORK_TURNS_VALUE, field="fork_turns")


def _require_text(raw: Mapping[str, Any], field: str) -> str:
    value = raw.get(field)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if field not in raw else f"got {shown(value)}"
        raise InvalidAgentParams(
            f'Parameter "{field}" is required and must be a non-empty string ({got}).', field=field
        )
    _check_length(field, value)
    return value


def _check_length(field: str, value: str) -> None:
    """At most MAX_CHARS[field] characters, and valid Unicode (a lone surrogate cannot be stored as UTF-8)."""
    if len(value) > MAX_CHARS[field]:
        raise InvalidAgentParams(
            f'Parameter "{field}" is {len(value):,} characters long; at most {MAX_CHARS[field]:,} are accepted: '
            "shorten it.",
            field=field,
        )
    problem = text_problem(f'Parameter "{field}"', value)
    if problem is not None:
        raise InvalidAgentParams(f"{problem}.", field=field)


def _check_fork_turns(raw: Mapping[str, Any]) -> ForkTurns:
    """`fork_turns` normalized (`"all"` when omitted), once it is known to be valid for this call."""
    if "fork_turns" not in raw:
        return "all"
    if raw["fork_turns"] is None:  # present counts as given: null is not "omitted"
        raise InvalidAgentParams(MSG_FORK_TURNS_VALUE, field="fork_turns")
    turns = normalize_fork_turns(raw["fork_turns"])
    if not _is_fork_type(raw.get("subagent_type")):
        raise InvalidAgentParams(MSG_FORK_TURNS_NOT_FORK, field="fork_turns")
    if "name" in raw:
        raise InvalidAgentParams(MSG_FORK_TURNS_TEAMMATE, field="fork_turns")
    return turns


def is_valid_tool_pattern(name: str) -> bool:
    """An exact tool name, `mcp__*`, or a trailing MCP tool-prefix pattern (`mcp__server__read_*`)."""
    if "*" not in name or name == "mcp__*":
        return True
    if not name.startswith("mcp__") or not name.endswith("*") or "*" in name[:-1]:
        return False
    return name[len("mcp__") : -1].rfind("__") > 0


def _check_fork_tools(raw: Mapping[str, Any]) -> tuple[str, ...] | None:
    if "fork_tools" not in raw:
        return None
    if not _is_fork_type(raw.get("subagent_type")):
        raise InvalidAgentParams(MSG_FORK_TOOLS_NOT_FORK, field="fork_tools")
    if "name" in raw:
        raise InvalidAgentParams(MSG_FORK_TOOLS_TEAMMATE, field="fork_tools")
    tools = raw["fork_tools"]
    if not isinstance(tools, list | tuple) or any(
        not isinstance(t, str) or not t.strip() or t.strip() != t for t in tools
    ):
        raise InvalidAgentParams(MSG_FORK_TOOLS_LIST, field="fork_tools")
    if len(tools) > MAX_FORK_TOOLS or any(len(t) > MAX_CHARS["name"] for t in tools):
        raise InvalidAgentParams(
            f'Parameter "fork_tools" accepts at most {MAX_FORK_TOOLS} names of at most {MAX_CHARS["name"]} '
            f"characters; got {len(tools)} names, the longest of {max(map(len, tools))}.",
            field="fork_tools",
        )
    for index, tool in enumerate(tools):
        problem = text_problem(f'Parameter "fork_tools" entry {index}', tool)
        if problem is not None:
            raise InvalidAgentParams(f"{problem}.", field="fork_tools")
    if "*" in tools:
        raise InvalidAgentParams(MSG_FORK_TOOLS_STAR, field="fork_tools")
    if not all(is_valid_tool_pattern(t) for t in tools):
        raise InvalidAgentParams(MSG_FORK_TOOLS_WILDCARD, field="fork_tools")
    return tuple(tools)


def tool_allowed(name: str, allowlist: tuple[str, ...] | list[str]) -> bool:
    """Whether `name` matches an entry of a `fork_tools` allowlist (exact, or an `mcp__` prefix pattern)."""
    return any(name == entry or (entry.endswith("*") and name.startswith(entry[:-1])) for entry in allowlist)


AGENT_TOOL_NAMES: Final = ("agent",)  # besides any declared tool taking `prompt` and `subagent_type`


def is_agent_tool(name: str | None, declaration: Mapping[str, Any] | None = None) -> bool:
    """The Agent tool: named `agent` (any case), or declared with the parameters `prompt` and `subagent_type`
    (`Task` and the like are recognized by their parameters, not their name)."""
    if not name:
        return False
    if name.lower() in AGENT_TOOL_NAMES:
        return True
    declared = declaration or {}
    params = declared.get("parameters") or declared.get("parametersJsonSchema")
    props = params.get("properties", {}) if isinstance(params, Mapping) else {}
    return isinstance(props, Mapping) and "prompt" in props and "subagent_type" in props


def _check_types(raw: Mapping[str, Any]) -> None:
    for field in _STRING_PARAMS:
        if field in raw and raw[field] is not None and not isinstance(raw[field], str):
            raise InvalidAgentParams(
                f'Parameter "{field}" must be a string, got {type(raw[field]).__name__}.', field=field
            )
        if isinstance(raw.get(field), str):
            _check_length(field, raw[field])
    background = raw.get("run_in_background")
    if background is not None and not isinstance(background, bool):
        raise InvalidAgentParams(
            f'Parameter "run_in_background" must be true or false, got {shown(background)}.', field="run_in_background"
        )
    unknown = sorted(str(k) for k in raw if k not in KNOWN_PARAMS)
    if unknown:
        raise InvalidAgentParams(
            f'Unknown parameter "{unknown[0][:60]}"; the Agent tool accepts: {", ".join(KNOWN_PARAMS)}.',
            field=unknown[0][:200],
        )


def validate_agent_params(raw: Mapping[str, Any]) -> AgentParams:
    """Validate an Agent tool call's parameters, in the order of docs/fork-history.md §4 (`AgentParams.model_validate`).

    description and prompt first, then the three `fork_turns` checks (value, fork only, not with a
    teammate name), the `fork_tools` checks (fork only, not with a teammate name, a list of exact names or
    MCP patterns), then `model` (a fork runs on the parent's model), then types and unknown keys.

    Raises:
        InvalidAgentParams: the first rule broken, with its message (`MSG_*`) and `.field`.
    """
    if not isinstance(raw, Mapping):
        raise InvalidAgentParams(
            f"The Agent tool's parameters must be an object, got {type(raw).__name__}.", field=None
        )
    return AgentParams.model_validate(raw, context=AGENT_CALL_CONTEXT)


def _checked_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of an `AgentParams` for the Agent call `raw`, once it keeps every rule of the contract.

    Raises:
        InvalidAgentParams: the first rule broken (see `validate_agent_params`).
    """
    description = _require_text(raw, "description")
    prompt = _require_text(raw, "prompt")
    turns = _check_fork_turns(raw)
    fork_tools = _check_fork_tools(raw)
    if "model" in raw and _is_fork_type(raw.get("subagent_type")):
        raise InvalidAgentParams(MSG_MODEL_FORK, field="model")
    _check_types(raw)
    return {
        "description": description,
        "prompt": prompt,
        "subagent_type": raw.get("subagent_type"),
        "name": raw["name"] if "name" in raw and raw["name"] is not None else ("" if "name" in raw else None),
        "fork_turns": raw.get("fork_turns"),
        "fork_tools": fork_tools,
        "model": raw.get("model"),
        "run_in_background": raw.get("run_in_background"),
        "turns": turns,
    }


# ── seed modes ────────────────────────────────────────────────────────────────────────────────

# how a fork's seed is chosen: `fork_turns` (the Agent parameter decides: all, or the last N turns, with the
# launching call replayed) or `completed_turns` (every completed turn, nothing of the in-flight one)
SeedMode = Literal["fork_turns", "completed_turns"]
SEED_MODES: Final[tuple[SeedMode, ...]] = get_args(SeedMode)
_SEED_MODE_SPELLINGS: Final[dict[str, SeedMode]] = {
    **{mode: mode for mode in SEED_MODES},
    **{mode.replace("_", "-"): mode for mode in SEED_MODES},  # the CLI's spelling
}
MSG_SEED_MODE_NOT_FORK: Final = 'seed_mode "completed_turns" applies only to subagent_type "fork".'
MSG_SEED_MODE_TEAMMATE: Final = 'seed_mode "completed_turns" cannot be used when spawning a named teammate.'
MSG_SEED_MODE_FORK_TURNS: Final = (
    'Parameter "fork_turns" cannot be used with seed_mode "completed_turns"; the completed-turn fork always '
    "inherits the parent's completed turns."
)
MSG_SEED_MODE_FORK_TOOLS: Final = (
    'Parameter "fork_tools" applies to fork_turns forks; a completed-turn fork takes the launch option '
    "tool_filter instead."
)


def normalize_seed_mode(value: object) -> SeedMode:
    """The seed mode `value` names (CLI spellings `fork-turns`, `completed-turns` too); None means `fork_turns`.

    Raises:
        InvalidAgentParams: any other value (`.field` is `seed_mode`).
    """
    if value is None:
        return "fork_turns"
    mode = _SEED_MODE_SPELLINGS.get(value) if isinstance(value, str) else None
    if mode is None:
        raise InvalidAgentParams(
            'seed_mode must be "fork_turns" or "completed_turns" (the CLI spellings "fork-turns" and '
            f'"completed-turns" are accepted too), got {shown(value)}.',
            field="seed_mode",
        )
    return mode


def check_seed_mode(seed_mode: object, agent: AgentParams) -> SeedMode:
    """The launch's seed mode, normalized, once it is known to fit the Agent call `agent`.

    Raises:
        InvalidAgentParams: an unknown mode (`.field` `seed_mode`); `completed_turns` for anything but a fork
            (`seed_mode`), or with `fork_turns` or `fork_tools` given (that parameter's field).
    """
    mode = normalize_seed_mode(seed_mode)
    if mode != "completed_turns":
        return mode
    if not _is_fork_type(agent.subagent_type):
        raise InvalidAgentParams(MSG_SEED_MODE_NOT_FORK, field="seed_mode")
    if agent.name is not None:
        raise InvalidAgentParams(MSG_SEED_MODE_TEAMMATE, field="seed_mode")
    if agent.fork_turns is not None:
        raise InvalidAgentParams(MSG_SEED_MODE_FORK_TURNS, field="fork_turns")
    if agent.fork_tools is not None:
        raise InvalidAgentParams(MSG_SEED_MODE_FORK_TOOLS, field="fork_tools")
    return mode


def agent_tool_schema() -> dict[str, Any]:
    """The JSON schema of the Agent tool's parameters, as the parent advertises it to its model."""
    return {
        "type": "object",
        "properties": {
            "description": {"type": "string", "description": "A short (3-5 word) summary of the task."},
            "prompt": {"type": "string", "description": "The task for the agent to perform: its directive."},
            "subagent_type": {
                "type": "string",
                "description": 'The kind of agent. "fork" starts a copy of you that inherits this conversation; '
                "any other type starts a fresh subagent with no history.",
            },
            "name": {"type": "string", "description": "Spawn a named teammate (never inherits history)."},
            "fork_turns": {
                "oneOf": [
                    {"type": "string", "const": "all"},
                    {"type": "string", "pattern": FORK_TURNS_PATTERN},
                ],
                "description": 'How much of this conversation a fork inherits: "all" (the default when omitted) '
                'or the last N user turns as a positive integer string such as "3". Only valid with '
                'subagent_type "fork", never with name.',
            },
            "fork_tools": {
                "type": "array",
                "items": {"type": "string"},
                "description": 'Only with subagent_type "fork": the tools the fork may execute (exact names, '
                '"mcp__*" or an MCP prefix pattern such as "mcp__github__read_*"). Its declarations stay '
                "unchanged; [] lets it run no tool. Omit to allow every inherited tool.",
            },
            "model": {"type": "string", "description": "Model for a regular subagent; forks use the parent's."},
            "run_in_background": {"type": "boolean", "description": "Return at once and notify when done."},
        },
        "required": ["description", "prompt"],
        "additionalProperties": False,
    }

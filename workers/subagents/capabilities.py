"""The subagent providers (`spawn`, `fork`), the capabilities each advertises, and the check that enforces them.

`spawn` starts a regular subagent (or a named teammate) from its definition; `fork` starts a child
seeded with the parent's history, in one of two seed modes. A launch asking for a capability its
provider (or seed mode) lacks is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from workers.errors import InvalidAgentParams

# capability names as the providers advertise them (camelCase, as the source documents spell them)
CAPABILITIES: Final = ("outputSchema", "depthLimit", "toolFilter", "persona")
OPTION_OF: Final = {
    "outputSchema": "output_schema",
    "depthLimit": "max_depth",
    "toolFilter": "tool_filter",
    "persona": "persona",
}

SPAWN: Final = {"outputSchema": True, "depthLimit": True, "toolFilter": True, "persona": True}
SEED_MODES: Final[dict[str, dict[str, bool]]] = {
    # the parent's system prompt and declarations byte for byte (prompt-cache parity): no persona, and
    # `fork_tools` (an Agent parameter) is its execution allowlist instead of a filter of declarations
    "fork_turns": {"outputSchema": True, "depthLimit": True, "toolFilter": False, "persona": False},
    "completed_turns": {"outputSchema": True, "depthLimit": True, "toolFilter": True, "persona": True},
}
WHY_NOT: Final = {
    ("fork_turns", "persona"): "a fork_turns fork keeps the parent's system prompt byte for byte (prompt-cache "
    'parity); use seed_mode "completed_turns" or a regular subagent for a persona',
    ("fork_turns", "toolFilter"): "a fork_turns fork keeps the parent's declarations byte for byte; limit what it "
    'runs with the Agent parameter "fork_tools", or use seed_mode "completed_turns"',
}


def providers() -> list[dict[str, Any]]:
    """Every provider with its capabilities; `fork` also lists what each seed mode supports."""
    fork = {name: any(mode[name] for mode in SEED_MODES.values()) for name in CAPABILITIES}
    return [
        {"name": "spawn", "capabilities": dict(SPAWN)},
        {"name": "fork", "capabilities": fork, "seedModes": {mode: dict(caps) for mode, caps in SEED_MODES.items()}},
    ]


def check_capabilities(provider: str, seed_mode: str | None, asked: Iterable[str]) -> None:
    """Refuse a launch that asks `provider` (in `seed_mode`) for a capability it lacks.

    Raises:
        InvalidAgentParams: naming the option, the provider and what to do instead (`.field` is the option).
    """
    caps = SPAWN if provider == "spawn" else SEED_MODES[seed_mode or "fork_turns"]
    for capability in asked:
        if caps.get(capability):
            continue
        option = OPTION_OF[capability]
        where = "regular subagents" if provider == "spawn" else f'forks with seed_mode "{seed_mode or "fork_turns"}"'
        why = WHY_NOT.get((seed_mode or "fork_turns", capability), "it is not supported there")
        raise InvalidAgentParams(f"{option} is not available for {where}: {why}.", field=option)

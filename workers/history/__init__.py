"""The pure conversation core: messages, launch parameters, parent snapshots, history selection, output schemas.

Nothing here does I/O: no Redis, no Celery, no model SDK. The names the fork-history contract uses
are importable from here (`build_fork_seed`, `select_fork_history`, `curate_history`, ...), and so are the
completed-turn fork's (`build_completed_seed`, `select_completed_turns`, ...).
"""

from workers.history.completed import (
    build_completed_seed,
    build_completed_seed_wire,
    completed_task_prompt,
    completed_turns_end,
    select_completed_parts,
    select_completed_turns,
)
from workers.history.messages import Content, parse_history
from workers.history.params import (
    SEED_MODES,
    AgentParams,
    SeedMode,
    check_seed_mode,
    normalize_seed_mode,
    validate_agent_params,
)
from workers.history.selection import (
    ForkSeed,
    build_fork_seed,
    build_fork_seed_wire,
    curate_history,
    is_real_user_turn,
    select_fork_history,
    startup_context_length,
)

__all__ = [
    "SEED_MODES",
    "AgentParams",
    "Content",
    "ForkSeed",
    "SeedMode",
    "build_completed_seed",
    "build_completed_seed_wire",
    "build_fork_seed",
    "build_fork_seed_wire",
    "check_seed_mode",
    "completed_task_prompt",
    "completed_turns_end",
    "curate_history",
    "is_real_user_turn",
    "normalize_seed_mode",
    "parse_history",
    "select_completed_parts",
    "select_completed_turns",
    "select_fork_history",
    "startup_context_length",
    "validate_agent_params",
]

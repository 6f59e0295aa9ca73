"""The pure conversation core: messages, launch parameters, parent snapshots, history selection, output schemas.

Nothing here does I/O: no Redis, no Celery, no model SDK. The names the fork-history contract uses
are importable from here: `build_fork_seed`, `ForkSeed`, `parse_history`, `validate_agent_params`.
"""

from workers.history.messages import Content, parse_history
from workers.history.params import AgentParams, validate_agent_params
from workers.history.selection import ForkSeed, build_fork_seed

__all__ = ["AgentParams", "Content", "ForkSeed", "build_fork_seed", "parse_history", "validate_agent_params"]

"""The tools a fork runs: the registry, the built-in coding tools and their confinement.

No Redis, no Celery: a tool sees only its `ToolContext`. A deployer's tool plugin (the `forkq.tools`
entry point group) imports what it needs from here: `from workers.tools import Tool, ToolContext, ToolError`.
"""

from workers.tools.builtins import builtin_tools, load_tools
from workers.tools.registry import Tool, ToolContext, ToolError, ToolRegistry, never_cancelled, resolve_inside

__all__ = [
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolRegistry",
    "builtin_tools",
    "load_tools",
    "never_cancelled",
    "resolve_inside",
]

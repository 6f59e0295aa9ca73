"""The stable import path of the Agent call's validation that the fork-history contract names.

The code lives in `workers.history.params`; nothing inside forkq imports this module.
"""

from workers.history.params import AgentParams, validate_agent_params

__all__ = ["AgentParams", "validate_agent_params"]

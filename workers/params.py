"""The stable import path of the Agent call's validation that the fork-history contract names.

The code lives in `workers.history.params` (the `MSG_*` error texts, `validate_agent_params`, ...);
this module re-exports its whole public surface for outside callers, and nothing inside forkq imports it.
"""

from workers.history.params import *  # noqa: F403

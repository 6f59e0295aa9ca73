"""The stable import path of the message model that the fork-history contract names (`parse_history`).

The model lives in `workers.history.messages`; this module re-exports its whole public surface for
outside callers, and nothing inside forkq imports it.
"""

from workers.history.messages import *  # noqa: F403

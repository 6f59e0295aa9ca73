"""What stands before every model call: a budget that may stop the fork, an admission that may make it wait.

The loop calls `enter` just before a model call and `leave` right after it (with the provider's usage, or
None when the call failed). A guard may block in `enter` (waiting for a concurrency slot, a rate window or
a shared cooldown) and returns the seconds it waited, which the loop does not count against the fork's
wall-clock limit; or it may raise `Stopped` (a budget reached), before anything is spent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.providers import ModelRequest, TokenUsage


class CallGuard(Protocol):
    """One check before a model call, and its settlement after."""

    def enter(self, request: ModelRequest) -> float:
        """Block until the call may go out; the seconds waited. May raise `Stopped`."""
        ...

    def leave(self, request: ModelRequest, usage: TokenUsage | None) -> None:
        """The call ended: `usage` as the provider reported it, or None when it failed."""
        ...


class Unguarded:
    """No budget, no admission: every call goes out at once."""

    def enter(self, request: ModelRequest) -> float:
        """Nothing to wait for."""
        return 0.0

    def leave(self, request: ModelRequest, usage: TokenUsage | None) -> None:
        """Nothing to settle."""


UNGUARDED = Unguarded()


@dataclass(frozen=True)
class Guards:
    """Several guards in order: entered first to last, left last to first.

    A guard that raises in `enter` leaves the ones entered before it (with no usage), so a slot taken
    by an earlier guard is never held by a call that does not go out.
    """

    guards: Sequence[CallGuard]

    def enter(self, request: ModelRequest) -> float:
        """Enter each guard in turn; the seconds waited in all of them."""
        waited = 0.0
        entered: list[CallGuard] = []
        try:
            for guard in self.guards:
                waited += guard.enter(request)
                entered.append(guard)
        except BaseException:
            for guard in reversed(entered):
                guard.leave(request, None)
            raise
        return waited

    def leave(self, request: ModelRequest, usage: TokenUsage | None) -> None:
        """Leave each guard, last first."""
        for guard in reversed(self.guards):
            guard.leave(request, usage)

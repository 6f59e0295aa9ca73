"""The loop's stop at a token budget: `BudgetReached`, raised by the worker's budget guard before a model call."""

from __future__ import annotations

from workers.loop.child import Stopped, StopReason
from workers.records.budget import BudgetKind, budget_detail


class BudgetReached(Stopped):
    """The fork reached a token budget before its next model call: it parks `paused`, reason `budget_reached`."""

    def __init__(self, kind: BudgetKind, *, fork_id: str, session: str, used: int, limit: int) -> None:
        super().__init__(StopReason.BUDGET_REACHED)
        self.kind = kind
        self.fork_id = fork_id
        self.session = session
        self.used = used
        self.limit = limit

    def detail(self) -> str:
        """The human account: which budget, used, limit, and what raises it."""
        return budget_detail(self.kind, fork_id=self.fork_id, session=self.session, used=self.used, limit=self.limit)

"""The seam before every model call: guards entered in order, left in reverse, and undone when one refuses."""

from __future__ import annotations

import pytest

from workers.loop.guard import UNGUARDED, Guards
from workers.providers import ModelRequest, TokenUsage


class Recording:
    """A guard that records what happens to it, waits `wait` seconds, and refuses when told to."""

    def __init__(self, name: str, log: list[str], *, wait: float = 0.0, refuse: bool = False) -> None:
        self.name, self.log, self.wait, self.refuse = name, log, wait, refuse

    def enter(self, request: ModelRequest) -> float:
        if self.refuse:
            self.log.append(f"refuse {self.name}")
            raise RuntimeError(f"{self.name} refused")
        self.log.append(f"enter {self.name}")
        return self.wait

    def leave(self, request: ModelRequest, usage: TokenUsage | None) -> None:
        self.log.append(f"leave {self.name} {'-' if usage is None else usage.input_tokens}")


REQUEST = ModelRequest(fork_id="f-1", step=0, model="m", system_instruction=None, messages=[], tools=[])


def test_guards_are_entered_in_order_and_left_in_reverse_with_the_usage() -> None:
    log: list[str] = []
    guards = Guards([Recording("budget", log, wait=0.5), Recording("admission", log, wait=1.25)])
    assert guards.enter(REQUEST) == 1.75
    guards.leave(REQUEST, TokenUsage(input_tokens=7, output_tokens=1))
    assert log == ["enter budget", "enter admission", "leave admission 7", "leave budget 7"]


def test_a_guard_that_refuses_undoes_the_ones_entered_before_it() -> None:
    log: list[str] = []
    guards = Guards([Recording("admission", log), Recording("budget", log, refuse=True), Recording("x", log)])
    with pytest.raises(RuntimeError, match="budget refused"):
        guards.enter(REQUEST)
    assert log == ["enter admission", "refuse budget", "leave admission -"]


def test_unguarded_calls_wait_for_nothing() -> None:
    assert UNGUARDED.enter(REQUEST) == 0.0
    UNGUARDED.leave(REQUEST, None)

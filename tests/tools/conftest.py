"""Fixtures of the tool tests only: the built-in registry, and a FIFO that blocks whoever opens it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tools_support import unblock
from workers.tools.builtins import builtin_tools
from workers.tools.registry import ToolRegistry


@pytest.fixture
def registry() -> ToolRegistry:
    """The built-in tools' registry."""
    return builtin_tools()


@pytest.fixture
def fifo(work: Path) -> Iterator[Path]:
    """A FIFO named `pipe` in the working directory, with no writer."""
    path = work / "pipe"
    os.mkfifo(path)
    yield path
    unblock(path)

"""The shape the house style asks of the code, read from its syntax: short functions, and words compared as types.

A function over 60 lines fails, and so does a status, outcome or script-reply word compared as a string
literal (`status == "running"`, `word in ("failed", "cancelled")`) outside the module that defines its enum:
such a word is read into its enum once, where it crosses a boundary, and compared as a member everywhere else.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.loop.child import StopReason
from workers.records.fork import Status
from workers.service.outcome import Outcome
from workers.store.replies import Decision, Refused, Revival, SendReply, Written

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "workers").rglob("*.py"), *(ROOT / "broker_config").rglob("*.py")])
MAX_FUNCTION_LINES = 60
WORDS = {
    m.value for enum in (Status, Outcome, StopReason, Written, Refused, Revival, SendReply, Decision) for m in enum
}
# the modules that define the enums: the one place each word is written as a string
ENUM_MODULES = {
    "workers/records/fork.py",
    "workers/service/outcome.py",
    "workers/loop/child.py",
    "workers/store/replies.py",
}
# the same letters as a word of ours, meaning something else
NOT_OURS = {("workers/api/problems.py", "'missing'"): "pydantic's error type of an absent field"}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def long_functions(source: str, name: str) -> list[str]:
    """`name:function (N lines)` for every function of `source` longer than the limit."""
    found = []
    for node in _functions(ast.parse(source)):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
            found.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def _literals(node: ast.expr) -> Iterator[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _literals(element)


def word_comparisons(source: str, name: str) -> list[str]:
    """`name:line word` for every comparison of a value against a vocabulary word written as a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [f"{name}:{node.lineno} {word!r}" for word in _literals(operand) if word in WORDS]
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue):
            found += [f"{name}:{node.pattern.lineno} {w!r}" for w in _literals(node.pattern.value) if w in WORDS]
    return found


@pytest.mark.parametrize("path", SOURCES, ids=_relative)
def test_no_function_is_longer_than_sixty_lines(path: Path) -> None:
    assert long_functions(path.read_text(encoding="utf-8"), _relative(path)) == []


@pytest.mark.parametrize("path", [p for p in SOURCES if _relative(p) not in ENUM_MODULES], ids=_relative)
def test_no_status_outcome_or_reply_word_is_compared_as_a_string(path: Path) -> None:
    found = word_comparisons(path.read_text(encoding="utf-8"), _relative(path))
    assert [f for f in found if (_relative(path), f.split(" ", 1)[1]) not in NOT_OURS] == []


def test_the_checks_find_what_they_look_for() -> None:
    # Given a long function and string comparisons of each form the check reads
    long = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    compared = (
        "if status == 'running': pass\n"
        "if word in ('failed', 'cancelled'): pass\n"
        "match reason:\n    case 'shutdown': pass\n"
        "if kind == 'missing': pass\n"
    )
    # Then each is found, and a word of no vocabulary is not
    assert long_functions(long, "m.py") == ["m.py:1 f (61 lines)"]
    assert word_comparisons(compared, "m.py") == [
        "m.py:1 'running'",
        "m.py:2 'failed'",
        "m.py:2 'cancelled'",
        "m.py:4 'shutdown'",
        "m.py:5 'missing'",
    ]
    assert word_comparisons("if name == 'read_file': pass\n", "m.py") == []

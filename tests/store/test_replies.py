"""The words Lua scripts answer and store: Python enums, spelled in the scripts only as their constants."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from workers.errors import RecordDecodeError
from workers.records.fork import Status
from workers.store import lease_scripts
from workers.store.replies import (
    Decision,
    Refused,
    Revival,
    SendReply,
    Written,
    fenced_reply,
    revival_reply,
    word_of,
)
from workers.store.script_parts import WORDS, lua_script, words_prelude

ROOT = Path(__file__).resolve().parents[2]
LUA_HINTS = ("redis.call", "ARGV[", "KEYS[")
_LITERAL = re.compile(r"'([^'\n]*)'")
# an event's type (`'type', 'finished'`) is the events' vocabulary, and a hash field (`HINCRBY', KEYS[1], 'lost'`)
# is a name in the key schema: neither is a status or a reply
_NOT_A_WORD = re.compile(r"('type',|KEYS\[\d+\],)\s*$")


def lua_sources() -> list[tuple[str, int, str]]:
    """(module, line, text) of every string constant in workers/ that is Lua script text."""
    found = []
    for path in sorted((ROOT / "workers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
            if any(hint in text for hint in LUA_HINTS):
                found.append((str(path.relative_to(ROOT)), node.lineno, text))
    return found


def quoted_words(text: str) -> list[str]:
    """The status and reply words `text` spells as quoted Lua literals (outside an event's type)."""
    words = set(WORDS.values())
    return [
        m.group(1) for m in _LITERAL.finditer(text) if m.group(1) in words and not _NOT_A_WORD.search(text[: m.start()])
    ]


def test_no_lua_script_spells_a_status_or_reply_word_as_a_literal() -> None:
    # Given every Lua text in workers/ (the store's scripts and their shared parts)
    sources = lua_sources()
    assert len(sources) >= 20, "the scan found too few Lua scripts: did they move, or change how they are written?"

    # Then none quotes a word of the enums: each names its constant, which `lua_script` declares from the enums
    spelled = [f"{module}:{line}: {word!r}" for module, line, text in sources for word in quoted_words(text)]
    assert spelled == [], "write the word's constant (e.g. QUEUED for 'queued') instead:\n" + "\n".join(spelled)


def test_the_scan_catches_a_quoted_status_word_but_not_an_event_type_or_a_hash_field() -> None:
    text = "if status ~= 'running' then return 'stale' end\nredis.call('XADD', k, 'type', 'finished', 'data', d)"
    text += "\nredis.call('HINCRBY', KEYS[1], 'lost', 1)"

    assert quoted_words(text) == ["running", "stale"]


def test_a_script_declares_each_word_constant_it_names_from_the_enums() -> None:
    script = lua_script("if redis.call('GET', KEYS[1]) == QUEUED then return CLAIMED end\nreturn STALE\n")

    assert script.startswith("local QUEUED = 'queued'\nlocal CLAIMED = 'claimed'\nlocal STALE = 'stale'\n")
    assert "local RUNNING" not in script  # a constant the script does not name is not declared
    assert words_prelude("return 'QUEUED' -- RUNNING") == ""  # in a string or a comment it is not a name
    assert lease_scripts.CLAIM.startswith("local QUEUED = 'queued'\n")


def test_a_word_vocabularies_share_has_one_value_and_a_reply_one_meaning() -> None:
    # (one constant per name is checked as `script_parts` builds its words: it raises on a clash)
    # a word two vocabularies share is the same value under the same name
    assert Decision.QUEUED.value == SendReply.QUEUED.value == Status.QUEUED.value
    # a fenced write's or the sweeper's reply has one meaning: its vocabularies share no word
    for kinds in ((Written, Refused, Status), (Revival, Refused, Status)):
        values = [m.value for kind in kinds for m in kind]
        assert len(values) == len(set(values)), kinds


def test_a_script_reply_reads_as_its_enum_and_an_unknown_word_names_the_script() -> None:
    assert fenced_reply(b"mail", script="append", fork_id="f-1") is Written.MAIL
    assert fenced_reply(b"cancelled", script="append", fork_id="f-1") is Status.CANCELLED
    assert fenced_reply("stale", script="append", fork_id="f-1") is Refused.STALE
    assert revival_reply(b"grace", fork_id="f-1") is Revival.GRACE
    assert revival_reply(b"failed", fork_id="f-1") is Status.FAILED
    assert word_of(SendReply, b"full", script="send", fork_id="f-1") is SendReply.FULL

    with pytest.raises(RecordDecodeError, match="fork f-1: the send script answered 'inbox', expected one of"):
        word_of(SendReply, b"inbox", script="send", fork_id="f-1")
    with pytest.raises(RecordDecodeError, match="the append script answered 'bogus'"):
        fenced_reply(b"bogus", script="append", fork_id="f-1")


def test_a_decision_reads_its_outcome_from_the_fork_status_after_it() -> None:
    assert Decision.after(Status.QUEUED) is Decision.QUEUED
    assert Decision.after(Status.AWAITING_APPROVAL) is Decision.RECORDED

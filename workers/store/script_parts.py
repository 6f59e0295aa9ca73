"""The pieces every Lua script of the store shares: Redis time, the cap of a fork's event stream, and its words.

A fork's event stream is written by the launch, the worker's fenced writes, the sweeper, cancel,
resume and approve/deny. Every one of those appends trims the stream to about `EVENTS_MAXLEN`
entries (`XADD ... MAXLEN ~`), so a fork that runs for days keeps a bounded stream: `script`
builds each script, fills in the cap and refuses a script with an append that is not capped.

A script never spells a status or a reply word itself: it names the word's Lua constant (`QUEUED`, `STALE`),
and `lua_script` starts the script with a `local` for each constant it names, made from the Python enums
(`workers.store.replies.LUA_WORDS`). So the words Redis holds and the words Python compares are one set of
values; a test (test_replies.py) fails on a status or reply word quoted in a script.
"""

from __future__ import annotations

import re
from typing import Final

from workers.store.replies import LUA_WORDS

# the newest events a fork's stream keeps (approximately: Redis trims whole nodes, `~`)
EVENTS_MAXLEN: Final = 10_000
# `now`: Redis's clock in Unix milliseconds; never a worker's or a client's clock
NOW: Final = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
# what a script writes for the cap; `lua_script` replaces it with EVENTS_MAXLEN
CAP: Final = "'MAXLEN', '~', @MAXLEN@"


def _constants() -> dict[str, str]:
    """Each word's Lua constant (its enum member's name) and value; one name, one value across the enums."""
    constants: dict[str, str] = {}
    for kind in LUA_WORDS:
        for member in kind:
            if constants.setdefault(member.name, member.value) != member.value:
                raise ValueError(
                    f"Lua word constant {member.name} is {constants[member.name]!r} in one enum and "
                    f"{member.value!r} in {kind.__name__}: give one of them another name"
                )
    return constants


# the status and reply words a script may name, by constant name (`workers.store.replies`)
WORDS: Final = _constants()
_QUOTED = re.compile(r"'[^']*'|--[^\n]*")
_NAME = re.compile(r"\b[A-Z][A-Z_]*\b")


def words_prelude(text: str) -> str:
    """The `local` declarations of the word constants `text` names (outside its quoted strings and comments)."""
    named = set(_NAME.findall(_QUOTED.sub("", text)))
    return "".join(f"local {name} = '{value}'\n" for name, value in WORDS.items() if name in named)


_XADD = re.compile(r"redis\.call\('XADD', ([^,]+), ")
_CAPPED = f"'MAXLEN', '~', {EVENTS_MAXLEN}, '*', "


def lua_script(*parts: str) -> str:
    """One Lua script from its parts, with every event append capped at EVENTS_MAXLEN and the word constants
    it names declared first.

    Raises:
        ValueError: an `XADD` of the script does not start with the cap (`CAP`), naming the append.
    """
    body = "".join(parts).replace("@MAXLEN@", str(EVENTS_MAXLEN))
    text = words_prelude(body) + body
    for append in _XADD.finditer(text):
        if not text.startswith(_CAPPED, append.end()):
            line = text[append.start() : text.find("\n", append.start())]
            raise ValueError(f"uncapped event append {line!r}: write it as redis.call('XADD', key, {CAP}, '*', ...)")
    return text

"""The pieces every Lua script of the store shares: Redis time, and the cap of a fork's event stream.

A fork's event stream is written by the launch, the worker's fenced writes, the sweeper, cancel,
resume and approve/deny. Every one of those appends trims the stream to about `EVENTS_MAXLEN`
entries (`XADD ... MAXLEN ~`), so a fork that runs for days keeps a bounded stream: `script`
builds each script, fills in the cap and refuses a script with an append that is not capped.
"""

from __future__ import annotations

import re
from typing import Final

# the newest events a fork's stream keeps (approximately: Redis trims whole nodes, `~`)
EVENTS_MAXLEN: Final = 10_000
# `now`: Redis's clock in Unix milliseconds; never a worker's or a client's clock
NOW: Final = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
# what a script writes for the cap; `lua_script` replaces it with EVENTS_MAXLEN
CAP: Final = "'MAXLEN', '~', @MAXLEN@"

_XADD = re.compile(r"redis\.call\('XADD', ([^,]+), ")
_CAPPED = f"'MAXLEN', '~', {EVENTS_MAXLEN}, '*', "


def lua_script(*parts: str) -> str:
    """One Lua script from its parts, with every event append capped at EVENTS_MAXLEN.

    Raises:
        ValueError: an `XADD` of the script does not start with the cap (`CAP`), naming the append.
    """
    text = "".join(parts).replace("@MAXLEN@", str(EVENTS_MAXLEN))
    for append in _XADD.finditer(text):
        if not text.startswith(_CAPPED, append.end()):
            line = text[append.start() : text.find("\n", append.start())]
            raise ValueError(f"uncapped event append {line!r}: write it as redis.call('XADD', key, {CAP}, '*', ...)")
    return text

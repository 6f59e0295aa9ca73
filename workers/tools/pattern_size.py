"""The size of a regular expression once compiled, estimated before it is compiled.

`regex.compile` copies the body of a counted repeat `n` times while it holds the GIL, so a pattern
of a few characters can stall a worker: `((a{200}){200}){200}` held the GIL 6.5 s and
`(((a{100}){100}){100}){100}` grew a process to 24 GB. `grep_search` refuses a pattern whose
estimate exceeds GREP_MAX_PATTERN_SIZE before it compiles it (either of its two compiles).
"""

from __future__ import annotations

import regex

GREP_MAX_PATTERN_SIZE = 10_000  # counted repeats expanded (`(a{100}){100}` is 10,000): about 10 ms to compile

_QUANTIFIER = regex.compile(r"\{(\d*)(?:,(\d*))?\}")


def _escape_end(pattern: str, at: int) -> int:
    """The index after the escape at `pattern[at]` (a backslash); `\\p{..}` and `\\N{..}` are one escape."""
    if pattern[at + 1 : at + 2] in ("p", "P", "N") and pattern[at + 2 : at + 3] == "{":
        close = pattern.find("}", at + 3)
        return len(pattern) if close < 0 else close + 1
    return at + 2


def _atom_end(pattern: str, at: int) -> int:
    """The index after the one-character atom, escape or character class at `pattern[at]`."""
    if pattern[at] == "\\":
        return _escape_end(pattern, at)
    if pattern[at] != "[":
        return at + 1
    i = at + 1
    i += pattern[i : i + 1] == "^"
    i += pattern[i : i + 1] == "]"  # a `]` first is a member of the class
    while i < len(pattern) and pattern[i] != "]":
        i = _escape_end(pattern, i) if pattern[i] == "\\" else i + 1
    return i + 1


def _repeat_count(quantifier: regex.Match[str]) -> int:
    lower, upper = quantifier.group(1), quantifier.group(2)
    return max(int(lower or 0), int(upper) if upper else 0, 1)


def expanded_size(pattern: str) -> int:
    """An upper bound of the pattern's size with its counted repeats expanded (`(ab{10}){10}` → 120).

    `regex.compile` copies the body of a counted repeat `n` times while it holds the GIL:
    `((a{200}){200}){200}` took 6.5 s and deeper nesting ran out of memory. A group counts the sum
    of its alternatives and a repeat `{m,n}` its larger bound, so the estimate is never too low.
    """
    frames = [[0, 0]]  # per open group: [its size so far, the size of its last atom]
    i = 0
    while i < len(pattern):
        frame, char = frames[-1], pattern[i]
        quantifier = _QUANTIFIER.match(pattern, i) if char == "{" and frame[1] else None
        if quantifier is not None:
            count = _repeat_count(quantifier)
            frame[0] += frame[1] * (count - 1)
            frame[1] *= count
            i = quantifier.end()
            if frame[0] > GREP_MAX_PATTERN_SIZE:  # a group holds at least its members: the whole is larger
                return frame[0]
            continue
        if char in "*+?|":
            frame[1] = 0 if char == "|" else frame[1]
            i += 1
            continue
        if char == "(":
            frames.append([0, 0])
            i += 1
            continue
        if char == ")" and len(frames) > 1:
            atom = frames.pop()[0] + 1
            frame, i = frames[-1], i + 1
        else:
            atom, i = 1, _atom_end(pattern, i)
        frame[0] += atom
        frame[1] = atom
    return sum(frame[0] for frame in frames)

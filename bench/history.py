"""Benchmark: build_fork_seed + encode + digest against the floor F (msgpack + BLAKE2b of plain dicts).

Run: `python bench/history.py [--sizes 1000 20000] [--repeat 3]`. Prints one table per history size.
The floor F is what any implementation must at least do to ship an `all` fork: serialize the
parent's history as plain dicts with `msgpack.packb` and hash it with BLAKE2b.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack

from workers.base import codec
from workers.history.messages import parse_history
from workers.history.selection import build_fork_seed

_WORDS = ("fork", "worker", "redis", "lease", "journal", "model", "tool", "def", "return", "self", "=", "\n")
_CORPUS = " ".join(random.Random(1).choice(_WORDS) for _ in range(40_000))
TOOLS = ("read_file", "grep_search", "run_shell_command", "list_directory", "edit")


def _text(rnd: random.Random, low: int, high: int) -> str:
    size = rnd.randint(low, high)
    start = rnd.randrange(len(_CORPUS) - high)
    return _CORPUS[start : start + size]


def make_history(messages: int, seed: int = 7) -> list[dict[str, Any]]:
    """A realistic parent history: prompts 200–2,000 chars, tool outputs 1–20 KB, ~40% tool calls."""
    rnd = random.Random(seed)
    history: list[dict[str, Any]] = [
        {"role": "user", "parts": [{"text": "<system-reminder>\n" + _text(rnd, 800, 1500) + "\n</system-reminder>"}]}
    ]
    call = 0
    while len(history) < messages - 1:
        history.append({"role": "user", "parts": [{"text": _text(rnd, 200, 2000)}]})
        for _ in range(rnd.randint(1, 4)):
            if len(history) >= messages - 3:
                break
            call += 1
            name = rnd.choice(TOOLS)
            history.append(
                {
                    "role": "model",
                    "parts": [
                        {"text": _text(rnd, 20, 200)},
                        {"functionCall": {"id": f"call-{call}", "name": name, "args": {"path": f"src/m{call}.py"}}},
                    ],
                }
            )
            history.append(
                {
                    "role": "user",
                    "parts": [
                        {
                            "functionResponse": {
                                "id": f"call-{call}",
                                "name": name,
                                "response": {"output": _text(rnd, 1000, 20000)},
                            }
                        }
                    ],
                }
            )
        if len(history) < messages - 1:
            history.append({"role": "model", "parts": [{"text": _text(rnd, 100, 1500)}]})
    history.append(
        {
            "role": "model",
            "parts": [
                {"text": "Launching forks."},
                {
                    "functionCall": {
                        "id": "agent-1",
                        "name": "Agent",
                        "args": {"prompt": "sibling A", "subagent_type": "fork"},
                    }
                },
                {
                    "functionCall": {
                        "id": "agent-2",
                        "name": "Agent",
                        "args": {"prompt": "sibling B", "subagent_type": "fork"},
                    }
                },
            ],
        }
    )
    return history


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    """Median wall time of `repeat` runs, in seconds."""
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(size: int, repeat: int) -> None:
    raw = make_history(size)
    history = parse_history(raw)
    packed = msgpack.packb(raw)

    def floor() -> None:
        hashlib.blake2b(msgpack.packb(raw), digest_size=32).hexdigest()

    def ship(turns: str | None) -> Callable[[], None]:
        def go() -> None:
            seed = build_fork_seed(history, fork_turns=turns, directive="Review the lease code.")
            codec.encode_with_digest(seed.to_wire())

        return go

    def seed_only(turns: str | None) -> Callable[[], None]:
        return lambda: build_fork_seed(history, fork_turns=turns, directive="Review the lease code.")

    floor_s = best_of(repeat, floor)
    rows = [("floor F: msgpack.packb + BLAKE2b (plain dicts)", floor_s, None)]
    for label, turns, target in (("all", None, 3.0), ('"3"', "3", 1.0)):
        rows.append((f"build_fork_seed {label}", best_of(repeat, seed_only(turns)), None))
        rows.append((f"build_fork_seed {label} + encode + digest", best_of(repeat, ship(turns)), target))
    print(f"\nparent history: {size:,} messages, {len(packed) / 1e6:.1f} MB as msgpack (median of {repeat})")
    print(f"{'step':<52} {'ms':>9} {'× F':>7} {'target':>8}")
    for label, secs, target in rows:
        verdict = "" if target is None else f"≤{target:.0f}× {'ok' if secs <= target * floor_s else 'MISS'}"
        print(f"{label:<52} {secs * 1e3:>9.1f} {secs / floor_s:>7.2f} {verdict:>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 20000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for size in args.sizes:
        run(size, args.repeat)


if __name__ == "__main__":
    main()

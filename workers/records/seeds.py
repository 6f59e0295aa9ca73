"""The launcher's seed builder: a fork's seed as stored chunks, reusing what sibling forks share.

A parent often launches several forks from one snapshot, with different directives. The selected
history (`workers.history.selection.select_fork_parts`) and the chunks of every message before the repaired
end (`workers.records.fork.split_body`) do not depend on the directive, so `SeedBuilder` keeps them per
snapshot object and `fork_turns`, and each launch only repairs, encodes and hashes the last three
messages. A kept chunk is used only when the messages of this launch before its repaired end are the
very Content objects it was built from (Contents are never changed in place), so the chunks are
always byte-identical to `split_wire(build_fork_seed_wire(...))`; `tests/records/test_seeds.py` checks it.

A completed-turn fork (`seed_mode="completed_turns"`, `workers.history.completed`) has no repaired end: its
messages do not depend on the directive at all, so they are kept per snapshot the same way, and its chunks
are byte-identical to `split_wire(build_completed_seed_wire(...))`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workers.base import codec
from workers.history.completed import completed_task_prompt, select_completed_parts
from workers.history.messages import Content, dump_contents
from workers.history.params import ForkTurns, SeedMode
from workers.history.selection import repair_fork_end, select_turns
from workers.history.snapshot import ParentSnapshot
from workers.records.fork import TAIL_MESSAGES, chunk_digest, split_body, tail_chunk

SNAPSHOTS_KEPT = 4  # snapshots whose selections a builder keeps (the last ones used)
COMPLETED = "completed_turns"  # the cache key of a completed-turn selection; `fork_turns` keys are "all" or digits
_Select = Callable[[tuple[Content, ...]], tuple[list[Content], list[Content]]]  # history → (kept prefix, body)


@dataclass(frozen=True)
class SeedChunks:
    """A fork's seed as the launcher stores it: chunk bytes, their digests, message count, task prompt."""

    chunks: list[bytes]
    digests: list[bytes]
    count: int
    task_prompt: str


@dataclass
class _Selection:
    """One snapshot's selection for one `fork_turns` (or the completed turns), and the body chunks built from it
    (by message count)."""

    snapshot: ParentSnapshot  # held, so that its id (the cache key) stays its own while kept
    history: tuple[Content, ...]  # the snapshot's messages when selected: a list edited since is not served
    prefix: list[Content]
    body: list[Content]
    bodies: dict[int, tuple[list[bytes], list[bytes]]] = field(default_factory=dict)

    @property
    def messages(self) -> list[Content]:
        """The selected messages before repair."""
        return [*self.prefix, *self.body]


class SeedBuilder:
    """Fork seeds as chunks, sharing the directive-independent work between launches of one snapshot.

    Thread-safe: the cache is guarded by a lock; the work is done outside it.
    """

    def __init__(self, kept: int = SNAPSHOTS_KEPT) -> None:
        self._kept = kept
        self._selections: OrderedDict[tuple[int, str], _Selection] = OrderedDict()
        self._lock = threading.Lock()

    def build(
        self,
        snapshot: ParentSnapshot,
        *,
        directive: str,
        turns: ForkTurns = "all",
        seed_mode: SeedMode = "fork_turns",
        keep: bool = True,
    ) -> SeedChunks:
        """The seed of a fork of `snapshot`: the chunks of `build_fork_seed_wire(snapshot.history, ...)` for
        `turns` (`AgentParams.turns`), or of `build_completed_seed_wire(snapshot.history, ...)` for
        `seed_mode="completed_turns"` (`turns` unused). Both were checked with the launch (`plan_launch`).

        `keep=False` for a snapshot nobody can pass again (the client parsed it from a dict): nothing is kept.
        """
        if seed_mode == "completed_turns":
            selection = self._selection(snapshot, COMPLETED, keep, _completed_parts)
            return self._chunks(selection, selection.body, completed_task_prompt(selection.body, directive))
        selection = self._selection(snapshot, str(turns), keep, lambda history: select_turns(history, turns))
        repaired, task_prompt = repair_fork_end(selection.body, directive)
        return self._chunks(selection, [*selection.prefix, *repaired], task_prompt)

    def _chunks(self, selection: _Selection, messages: list[Content], task_prompt: str) -> SeedChunks:
        """The seed made of `messages`: body chunks shared through `selection`, the last three on their own."""
        body_end = max(0, len(messages) - TAIL_MESSAGES)
        chunks, digests = self._body(selection, messages, body_end)
        tail = tail_chunk([codec.encode(m) for m in dump_contents(messages[body_end:])])
        return SeedChunks(
            chunks=[*chunks, *tail],
            digests=[*digests, *map(chunk_digest, tail)],
            count=len(messages),
            task_prompt=task_prompt,
        )

    def _selection(self, snapshot: ParentSnapshot, mode: str, keep: bool, select: _Select) -> _Selection:
        """The selection of `snapshot` for `mode` (kept, or made by `select` from its history and kept if `keep`)."""
        key = (id(snapshot), mode)
        with self._lock:
            found = self._selections.get(key)
            if found is not None and found.snapshot is snapshot and _same_messages(snapshot.history, found.history):
                self._selections.move_to_end(key)
                return found
        history = tuple(snapshot.history)
        prefix, body = select(history)
        selection = _Selection(snapshot, history, prefix, body)
        if not keep:
            return selection
        with self._lock:
            self._selections[key] = selection
            self._selections.move_to_end(key)
            snapshots = {k[0] for k in self._selections}
            while len(snapshots) > self._kept:
                oldest = next(iter(self._selections))[0]
                for k in [k for k in self._selections if k[0] == oldest]:
                    del self._selections[k]
                snapshots.discard(oldest)
        return selection

    @staticmethod
    def _body(selection: _Selection, messages: Sequence[Content], end: int) -> tuple[list[bytes], list[bytes]]:
        """The chunks (and digests) of `messages[:end]`: kept ones if they are the selection's own objects."""
        selected = selection.messages
        if end > len(selected) or any(a is not b for a, b in zip(messages[:end], selected, strict=False)):
            return _split(messages[:end])  # the repair changed an earlier message: nothing to share
        kept = selection.bodies.get(end)
        if kept is None:
            kept = selection.bodies[end] = _split(messages[:end])
        return kept


def _completed_parts(history: tuple[Content, ...]) -> tuple[list[Content], list[Content]]:
    """A completed-turn selection in the shape of `select_fork_parts`'s: no kept prefix, every message the body."""
    return [], select_completed_parts(history)


def _same_messages(current: Sequence[Content], kept: Sequence[Content]) -> bool:
    """True if `current` holds the very Content objects `kept` does (a message added, removed or replaced
    in the snapshot's list since shows); Contents themselves are never changed in place."""
    return len(current) == len(kept) and all(a is b for a, b in zip(current, kept, strict=True))


def _split(messages: Sequence[Content]) -> tuple[list[bytes], list[bytes]]:
    chunks = split_body([codec.encode(m) for m in dump_contents(messages)])
    return chunks, [chunk_digest(c) for c in chunks]

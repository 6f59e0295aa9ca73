"""A fork's loop state, and how a revived run rebuilds it: the journal's fold over the fork's seed.

The live loop and a revived run share one function, `Conversation.apply` (`workers.records.conversation`):
the live loop builds each entry, journals it, then applies that same entry to its state; a revival folds
`apply` over the stored journal (`replay`), strictly (a journal the loop could not have written is
refused). So the state after any live step is, by construction, the state a replay of its journal
rebuilds, and a revived fork's next model request is identical to the one the dead worker would have made.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.history.selection import ForkSeed
from workers.records.conversation import Conversation
from workers.records.journal import JournalEntry


def replay(seed: ForkSeed, entries: Iterable[JournalEntry], *, fork_id: str | None = None) -> Conversation:
    """Rebuild a fork's state from its seed and its journal entries (in order).

    Raises:
        RecordDecodeError: the entries are not a journal the loop writes (a model response while calls
            wait for their results, a call answered twice or never made); `fork_id` names the fork.
    """
    return Conversation.start(seed, fork_id=fork_id).fold(entries)

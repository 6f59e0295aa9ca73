"""Python's cyclic garbage collector, paused while code builds many small objects that form no cycles."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector meanwhile, and resume it after if it ran before.

    Bulk work that allocates many tracked containers sets off collections that scan the whole heap, which in a
    process holding a large one costs more than the work. Nothing is lost when what is built has no cycles;
    concurrent callers at worst leave the collector on.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

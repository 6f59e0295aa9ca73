"""Handler threads kept for reuse: an idle thread takes the next call, a new one starts only when none is idle.

Starting a thread costs its caller about five times the CPU of handing work to one that waits; with
a thousand forks stepping at once on one interpreter that CPU queues behind the GIL. The pool is
elastic and unbounded: a thread running a call, even one its caller abandoned, is not idle, so a
stuck handler keeps its thread and never delays another call. A thread idle for `idle_s` ends.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable

IDLE_THREAD_S = 30.0  # an idle handler thread ends after this long without a call


class HandlerThreads:
    """Threads that run handler calls, started on demand and ended when idle (one set per registry)."""

    def __init__(self, name: str = "forkq-tool", idle_s: float = IDLE_THREAD_S) -> None:
        self.name = name
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a call, less the calls already handed to them

    def submit(self, call: Callable[[], None]) -> None:
        """Run `call` on an idle thread, or on a new one when none is idle."""
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
                self._calls.put(call)
                return
        threading.Thread(target=self._serve, args=(call,), name=self.name, daemon=True).start()

    def idle(self) -> int:
        """Threads waiting for a call."""
        with self._lock:
            return self._idle

    def _serve(self, call: Callable[[], None] | None) -> None:
        while call is not None:
            # a fresh context per call, as a new thread would have: one call's context variables never leak
            contextvars.Context().run(call)
            call = self._next()

    def _next(self) -> Callable[[], None] | None:
        """The next call handed to this thread, or None when it should end (idle too long)."""
        with self._lock:
            self._idle += 1
        try:
            return self._calls.get(timeout=self.idle_s)
        except queue.Empty:
            pass
        with self._lock:
            # a call handed over between the timeout and the lock is this thread's to run
            try:
                return self._calls.get_nowait()
            except queue.Empty:
                self._idle -= 1
                return None

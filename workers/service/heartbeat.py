"""The worker heartbeat file: the worker's consumer loop rewrites it; `forkq check --worker` reads its age.

The beat is a timer of the worker's own event loop (the loop that fetches jobs and acks them), not a
thread of its own: it stops when that loop is stuck, when the worker loses its broker and is
reconnecting, or when the process is gone, which is what a liveness probe must notice. A file (not a
Redis key) because the probe runs in the worker's pod or container and must answer for that worker.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

log = logging.getLogger("forkq.worker")

STALE_BEATS: Final = 3  # a heartbeat older than this many intervals means the worker is not alive


def write_heartbeat(path: Path, hostname: str) -> None:
    """Replace the file atomically with who beat; its modification time is the beat."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"hostname": hostname, "pid": os.getpid(), "at": time.time()}), encoding="utf-8")
    os.replace(tmp, path)


def heartbeat_problem(path: Path, interval_s: float, now: float | None = None) -> str | None:
    """Why the heartbeat at `path` shows no live worker (with the fix), or None when it is fresh."""
    limit = STALE_BEATS * interval_s
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return (
            f"no worker heartbeat at {path}: no worker has started here, or it writes elsewhere; "
            "start `forkq worker` with the same FORKQ_HEARTBEAT_FILE (and allow it time to start)"
        )
    except OSError as exc:
        return f"worker heartbeat {path} is unreadable ({exc}); fix FORKQ_HEARTBEAT_FILE or its permissions"
    if age > limit:
        who = _writer(path)
        return (
            f"worker heartbeat {path}{who} is {age:.0f} s old, over {limit:g} s ({STALE_BEATS} × FORKQ_HEARTBEAT_S): "
            "the worker stopped, its event loop is stuck, or it lost its broker; read its log and restart it"
        )
    return None


def _writer(path: Path) -> str:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return f" (written by {data['hostname']}, pid {data['pid']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


@dataclass
class Heartbeat:
    """Rewrites the heartbeat file every `interval_s` on a Celery timer (the worker's event loop)."""

    path: Path
    interval_s: float
    hostname: str
    _entry: Any = field(default=None, init=False)

    def start(self, timer: Any) -> None:
        """Beat now (the process started), then on every tick of `timer` (`call_repeatedly`)."""
        self.beat()
        self._entry = timer.call_repeatedly(self.interval_s, self.beat)

    def beat(self) -> None:
        """Write the file; a failure is logged, never raised into the worker's loop."""
        try:
            write_heartbeat(self.path, self.hostname)
        except OSError as exc:
            log.warning("worker heartbeat %s not written: %s; `forkq check --worker` will fail", self.path, exc)

    def stop(self) -> None:
        """Stop beating (the file stays and ages: a stopped worker is not alive)."""
        if self._entry is not None:
            self._entry.cancel()
            self._entry = None

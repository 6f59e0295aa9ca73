"""What a worker does with one fork job: verify, claim, replay, run the loop, finish or release."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field

from broker_config.settings import Settings
from workers.child import ChildLoop, Stopped
from workers.errors import ForkqError, LeaseLost, RecordIntegrityError
from workers.journal import JournalEntry
from workers.keys import Keys
from workers.lease import Claim, LeaseKeeper, Leases
from workers.providers import ModelProvider
from workers.providers.routing import ProviderRouter
from workers.records import ForkResult, Status
from workers.store import ForkStore
from workers.tools import ToolRegistry, load_tools

log = logging.getLogger("forkq.worker")

Requeue = Callable[[str, str, int], None]  # fork id, digest, attempt


class RunForkJob(BaseModel):
    """The payload of a `run_fork` job, validated before anything runs."""

    model_config = ConfigDict(strict=True, extra="forbid")

    fork_id: str = Field(min_length=1, max_length=128)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    seed_chunks: list[bytes] | None = None


@dataclass
class WorkerRuntime:
    """Per-process worker resources, built lazily (after a prefork child starts) and thread-safe."""

    settings: Settings
    requeue: Requeue | None = None  # set by make_app: enqueue a released fork again
    stopping: threading.Event = field(default_factory=threading.Event)  # set on worker shutdown

    @cached_property
    def redis(self) -> redis.Redis:
        """One client (one connection pool) per process."""
        return redis.Redis.from_url(self.settings.redis_url, health_check_interval=30)

    @cached_property
    def store(self) -> ForkStore:
        """The fork store over this process's client."""
        return ForkStore(self.redis, Keys(self.settings.namespace), ttl_s=self.settings.record_ttl_s)

    @cached_property
    def leases(self) -> Leases:
        """Claims and fenced writes."""
        return Leases(
            self.redis,
            Keys(self.settings.namespace),
            ttl_ms=int(self.settings.lease_ttl_s * 1000),
            retention_s=self.settings.record_ttl_s,
        )

    @cached_property
    def keeper(self) -> LeaseKeeper:
        """The process's heartbeat."""
        return LeaseKeeper(self.leases, interval_s=self.settings.heartbeat_s)

    @cached_property
    def provider(self) -> ModelProvider:
        """The model provider forks of this worker use: a router choosing one per request by model name."""
        return ProviderRouter(self.settings)

    @cached_property
    def tools(self) -> ToolRegistry:
        """The tools this worker can execute: built-ins and the `forkq.tools` entry points."""
        return load_tools()


@dataclass(frozen=True)
class FencedJournal:
    """The journal writer of one claim."""

    leases: Leases
    claim: Claim

    def append(self, entry: JournalEntry) -> None:
        """Append under the claim's epoch (LeaseLost when refused)."""
        self.leases.append(self.claim, entry)


def new_owner() -> str:
    """A unique owner token for one claim: host, pid, thread and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}:{uuid.uuid4().hex[:12]}"


def run_fork_job(runtime: WorkerRuntime, job: RunForkJob) -> str:
    """Run one delivery of a fork job; returns what happened (`succeeded`, `duplicate:<status>`, ...).

    A delivery whose digest is not the fork's launch digest is refused without touching the fork;
    a stored record that no longer matches its digest fails the fork; a delivery for a fork that is
    not queued (running under a live lease, finished, cancelled) is a no-op.
    """
    fid = job.fork_id
    state = runtime.store.state(fid)
    if state.digest and job.digest != state.digest:
        raise RecordIntegrityError(
            f"fork {fid}: job digest {job.digest[:12]}… is not the launch digest {state.digest[:12]}…; "
            "the job message was altered or belongs to another fork",
            fork_id=fid,
        )
    claim = runtime.leases.claim(fid, new_owner())
    if isinstance(claim, str):
        log.info("fork %s: delivery ignored, fork is %s", fid, claim)
        return f"duplicate:{claim}"
    lost = runtime.keeper.hold(claim)
    try:
        return _run_claimed(runtime, job, claim, lost)
    except LeaseLost as exc:
        log.warning("%s", exc)
        return "lease_lost"
    finally:
        runtime.keeper.drop(claim)


def _run_claimed(runtime: WorkerRuntime, job: RunForkJob, claim: Claim, lost: threading.Event) -> str:
    fid = job.fork_id
    try:
        record = runtime.store.get_record(fid, job.digest)
        seed = runtime.store.load_seed(record, job.seed_chunks)
        entries = runtime.leases.journal(fid)
    except (ForkqError, redis.RedisError) as exc:
        runtime.leases.finish(claim, ForkResult(fork_id=fid, status=Status.FAILED, error=str(exc)))
        raise

    missing = _check_tool_surface(runtime, claim, record.tools, entries)
    if missing:
        reason = (
            f"declared tool(s) {', '.join(missing)} not available on this worker; the fork was started "
            "with them and does not run with a different tool surface: install them and `forkq resume`"
        )
        runtime.leases.pause(claim, reason)
        return "paused"

    def stop_reason() -> str | None:
        if lost.is_set():
            return "lease_lost"
        if runtime.stopping.is_set():
            return "shutdown"
        return "cancelled" if runtime.store.is_cancelled(fid) else None

    loop = ChildLoop(
        record=record,
        seed=seed,
        provider=runtime.provider,
        tools=runtime.tools,
        journal=FencedJournal(runtime.leases, claim),
        emit=lambda kind, data: _emit(runtime, fid, kind, data),
        stop_reason=stop_reason,
        entries=entries,
        max_turns=runtime.settings.max_turns,
    )
    try:
        result = loop.run()
    except Stopped as stop:
        return _stopped(runtime, job, claim, stop.reason)
    except (LeaseLost, redis.RedisError):
        raise
    except Exception as exc:  # a provider or loop failure ends the fork as failed, with the reason
        log.exception("fork %s: attempt %d failed", fid, claim.attempt)
        result = ForkResult(fork_id=fid, status=Status.FAILED, error=f"{type(exc).__name__}: {exc}")
    runtime.leases.finish(claim, result)
    return result.status.value


def _check_tool_surface(
    runtime: WorkerRuntime, claim: Claim, declared: list[dict[str, Any]], entries: list[JournalEntry]
) -> list[str]:
    """Record the executable tool surface on the first run; on a revival, the tools now missing."""
    surface = sorted({str(d.get("name")) for d in declared if runtime.tools.get(d.get("name"))})
    recorded = next((e.tools for e in entries if e.kind == "surface"), None)
    if recorded is None:
        entry = JournalEntry(seq=len(entries), step=0, kind="surface", tools=surface)
        runtime.leases.append(claim, entry)
        entries.append(entry)
        return []
    return sorted(set(recorded) - set(surface))


def _stopped(runtime: WorkerRuntime, job: RunForkJob, claim: Claim, reason: str) -> str:
    if reason == "shutdown":  # checkpointed by the journal: hand the fork to another worker now
        runtime.leases.release(claim, "worker shutdown")
        if runtime.requeue is not None:
            runtime.requeue(job.fork_id, job.digest, claim.attempt + 1)
        return "released"
    return reason


def _emit(runtime: WorkerRuntime, fork_id: str, kind: str, data: dict[str, Any]) -> None:
    runtime.store.add_event(fork_id, kind, data)

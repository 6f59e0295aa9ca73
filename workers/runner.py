"""What a worker does with one fork job: verify, claim, load the seed, run the loop, finish."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field

from broker_config.settings import Settings
from workers.child import ChildLoop
from workers.errors import ForkqError, RecordIntegrityError
from workers.keys import Keys
from workers.providers import ModelProvider
from workers.providers.scripted import ScriptedProvider, load_script
from workers.records import ForkResult, Status
from workers.store import ForkStore
from workers.tools import ToolRegistry, builtin_tools

log = logging.getLogger("forkq.worker")


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

    @cached_property
    def redis(self) -> redis.Redis:
        """One client (one connection pool) per process."""
        return redis.Redis.from_url(self.settings.redis_url, health_check_interval=30)

    @cached_property
    def store(self) -> ForkStore:
        """The fork store over this process's client."""
        return ForkStore(self.redis, Keys(self.settings.namespace), ttl_s=self.settings.record_ttl_s)

    @cached_property
    def provider(self) -> ModelProvider:
        """The model provider forks of this worker use."""
        script = load_script(self.settings.script) if self.settings.script else None
        return ScriptedProvider(script)

    @cached_property
    def tools(self) -> ToolRegistry:
        """The tools this worker can execute."""
        return builtin_tools()


def new_owner() -> str:
    """A unique owner token for one claim: host, pid, thread and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}:{uuid.uuid4().hex[:12]}"


def run_fork_job(runtime: WorkerRuntime, job: RunForkJob) -> str:
    """Run one delivery of a fork job; returns what happened (`succeeded`, `duplicate:<status>`, ...).

    A delivery whose digest is not the fork's launch digest is refused without touching the fork;
    a stored record that no longer matches its digest fails the fork; a delivery for a fork that is
    not queued (running elsewhere, finished, cancelled) is a no-op.
    """
    store = runtime.store
    fid = job.fork_id
    state = store.state(fid)
    if state.digest and job.digest != state.digest:
        raise RecordIntegrityError(
            f"fork {fid}: job digest {job.digest[:12]}… is not the launch digest {state.digest[:12]}…; "
            "the job message was altered or belongs to another fork",
            fork_id=fid,
        )
    owner = new_owner()
    claimed, attempt = store.claim(fid, owner)
    if claimed != "claimed":
        log.info("fork %s: delivery ignored, fork is %s", fid, claimed)
        return f"duplicate:{claimed}"
    try:
        record = store.get_record(fid, job.digest)
        seed = store.load_seed(record, job.seed_chunks)
    except (ForkqError, redis.RedisError) as exc:
        store.finish(ForkResult(fork_id=fid, status=Status.FAILED, error=str(exc)), owner)
        raise
    loop = ChildLoop(
        record=record,
        seed=seed,
        provider=runtime.provider,
        tools=runtime.tools,
        emit=lambda kind, data: _emit(store, fid, kind, data),
        cancelled=lambda: store.is_cancelled(fid),
        max_turns=runtime.settings.max_turns,
    )
    try:
        result = loop.run()
    except Exception as exc:  # a provider or loop failure ends the fork as failed, with the reason
        log.exception("fork %s: attempt %d failed", fid, attempt)
        result = ForkResult(fork_id=fid, status=Status.FAILED, error=f"{type(exc).__name__}: {exc}")
    if not store.finish(result, owner):
        log.info("fork %s: result of attempt %d discarded, the fork is no longer ours", fid, attempt)
        return f"discarded:{store.state(fid).status.value}"
    return result.status.value


def _emit(store: ForkStore, fork_id: str, kind: str, data: dict[str, Any]) -> None:
    store.add_event(fork_id, kind, data)

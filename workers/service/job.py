"""A `run_fork` job: its validated payload, and what a first run reads from it before its claim."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker_config.celery import INLINE_JOB_MAX_BYTES
from workers.base import codec
from workers.base.keys import FORK_ID_RE
from workers.errors import RecordDecodeError, RecordIntegrityError
from workers.history.selection import ForkSeed
from workers.loop.child import PrimedCall, first_model_call
from workers.records.fork import BootstrapRecord, Declarations
from workers.records.journal import EntryKind, JournalEntry, RequestDigests
from workers.store.claims import FirstWrite
from workers.store.forks import ForkStore
from workers.tools.registry import ToolRegistry

log = logging.getLogger("forkq.worker")

# far above any inline seed a client sends (FORKQ_INLINE_SEED_MAX_BYTES is at most a few hundred KB
# in practice); larger jobs are hostile or broken and are refused before anything runs
MAX_INLINE_JOB_BYTES: Final = INLINE_JOB_MAX_BYTES  # the broker's checks size the envelope by it


class RunForkJob(BaseModel):
    """The payload of a `run_fork` job, validated before anything runs."""

    model_config = ConfigDict(strict=True, extra="forbid")

    fork_id: str = Field(min_length=1, max_length=128)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    seed_chunks: list[bytes] | None = None  # inline: the context chunk, then the seed's chunks
    record: bytes | None = Field(None, max_length=MAX_INLINE_JOB_BYTES)  # inline: the stored record bytes

    @field_validator("fork_id")
    @classmethod
    def _an_id(cls, fork_id: str) -> str:
        # the id names Redis keys: an id the key schema refuses is a malformed job, not a crash in the task
        if not FORK_ID_RE.fullmatch(fork_id):
            raise ValueError(
                f"fork id {fork_id[:140]!r} is not a fork id: expected 1-128 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit (as `f-<hex>`, or `<id>.<step>.<index>` for nested subagents)"
            )
        return fork_id

    @field_validator("seed_chunks")
    @classmethod
    def _bounded(cls, chunks: list[bytes] | None) -> list[bytes] | None:
        size = sum(map(len, chunks or []))
        if size > MAX_INLINE_JOB_BYTES:
            raise ValueError(f"inline chunks of {size:,} bytes exceed {MAX_INLINE_JOB_BYTES:,}: an oversized job")
        return chunks


@dataclass(frozen=True, slots=True)
class FirstStep:
    """A first run's inputs, read from the job before the claim, and what its claim writes with them."""

    record: BootstrapRecord
    seed: ForkSeed
    write: FirstWrite  # the record bytes, the surface entry, the first `model_call` event's data
    call: PrimedCall  # the first model call, whose digest the loop uses rather than computing it again


def first_step(
    job: RunForkJob, *, store: ForkStore, declarations: Declarations, digests: RequestDigests, tools: ToolRegistry
) -> FirstStep | None:
    """From a job that carries its record: record, seed, and what a first claim writes before the first
    model call (the surface entry and the `model_call` event data); None without a usable record.

    The record is used only if it hashes to the job digest, which the claim checks against the launch
    digest before it writes anything; any problem leaves the work to the usual path after the claim.
    """
    if job.record is None or codec.digest(job.record) != job.digest:
        return None
    try:
        record, seed = load_inputs(store, job, job.record)
        declared = declarations.of(record)
        surface = JournalEntry(seq=0, step=0, kind=EntryKind.SURFACE, tools=executable(tools, declared))
        call = first_model_call(record, seed, digests, declared)
        return FirstStep(record, seed, FirstWrite(job.record, surface, call.event()), call)
    except Exception as exc:  # nothing is claimed yet: the usual path reports it (as the fork's failure)
        log.warning("fork %s: inputs not prepared before the claim (%s); reading them after it", job.fork_id, exc)
        return None


def load_inputs(store: ForkStore, job: RunForkJob, data: bytes) -> tuple[BootstrapRecord, ForkSeed]:
    """Record and seed from the job's inline chunks; if they do not match the record, from Redis.

    A corrupted job must not fail an intact fork: the chunks in Redis are the source of truth.
    """
    if job.seed_chunks:
        try:
            return store.load_inputs(job.fork_id, data, job.digest, job.seed_chunks)
        except (RecordIntegrityError, RecordDecodeError) as exc:
            log.warning("fork %s: inline chunks refused (%s); reading them from Redis", job.fork_id, exc)
    return store.load_inputs(job.fork_id, data, job.digest)


def executable(tools: ToolRegistry, declared: list[dict[str, Any]]) -> list[str]:
    """The declared tools this worker can execute."""
    return sorted({str(d.get("name")) for d in declared if tools.get(d.get("name"))})

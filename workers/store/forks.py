"""Redis access for forks: launch writes, records, state, progress events, results and cancellation.

Claims, leases and every write made while a fork runs are in `workers/store/lease.py`.

Multi-key changes of one fork run as Lua scripts (`workers/store/fork_scripts.py`) over keys that share the
fork's hash tag, so each is atomic; timestamps come from Redis `TIME`, never from worker clocks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import redis
from redis.commands.core import Script

from workers.base.keys import Keys, session_named
from workers.errors import (
    InvalidApproval,
    RecordDecodeError,
    RecordExistsError,
    RecordIntegrityError,
    SessionCancelled,
)
from workers.history.selection import ForkSeed
from workers.records.fork import (
    BootstrapRecord,
    ChunkCache,
    ForkResult,
    ForkState,
    HeldChunks,
    Status,
    chunk_digest,
    join_seed,
)
from workers.records.journal import EntryKind, JournalEntry
from workers.store import dead_letters, fork_scripts, reads
from workers.store.pipelined import ScriptCall, run_scripts
from workers.store.replies import Decision, Refused, SendReply, Written, fenced_reply, word_of

if TYPE_CHECKING:  # types only: the store keeps dead letters and queues jobs without loading kombu or Celery
    from workers.broker.connection import Rejected
    from workers.broker.envelope import QueuedJob

    # and reads no event models until it reads or writes an event: `forkq status` starts without them
    from workers.records.events import StreamEvent

WAIT_TIMEOUT_MS: Final = 1000
KNOWN_CHUNKS_MAX: Final = 4096  # chunk keys a client remembers writing, so that it does not send them again
DECISION_GRACE_MS: Final = 30_000  # a decided fork's job not confirmed enqueued by then is re-enqueued by a sweeper

log = logging.getLogger("forkq.store")

DECIDE_ATTEMPTS: Final = 5
DECIDED: Final = frozenset(d.value for d in Decision)


@dataclass(frozen=True, slots=True)
class Cancel:
    """What one cancel of `ForkStore.cancel_many` found: the fork's status before and after it (None: no such fork),
    and its attempt (its Flower task id is `<fork id>.<attempt>`)."""

    before: Status | None
    after: Status | None
    attempt: int

    @property
    def newly(self) -> bool:
        """This cancel ended the fork (it had not ended before)."""
        return self.before is not None and not self.before.terminal and self.after is Status.CANCELLED


class ForkStore:
    """One fork store per process: a Redis client (with its connection pool) and the key schema."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int, chunk_cache: ChunkCache | None = None) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.chunk_cache = chunk_cache  # workers: chunks decoded once per process (verified reads without Redis)
        self._launch = client.register_script(fork_scripts.LAUNCH)
        self._put_chunks = client.register_script(fork_scripts.PUT_CHUNKS)
        self._cancel = client.register_script(fork_scripts.CANCEL)
        self._resume = client.register_script(fork_scripts.RESUME)
        self._decide = client.register_script(fork_scripts.DECIDE)
        self._send = client.register_script(fork_scripts.SEND)
        self._claim_name = client.register_script(fork_scripts.CLAIM_NAME)
        self._replicas: int | None = None  # learned on the first launch
        self._known: OrderedDict[str, None] = OrderedDict()  # chunk keys this store wrote, most recent last
        self._known_lock = threading.Lock()

    # ── launch ────────────────────────────────────────────────────────────────────────────────

    def _known_chunk(self, key: str) -> bool:
        with self._known_lock:
            if key not in self._known:
                return False
            self._known.move_to_end(key)
            return True

    def _remember_chunks(self, keys: Sequence[str]) -> None:
        with self._known_lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > KNOWN_CHUNKS_MAX:
                self._known.popitem(last=False)

    def put_launch(
        self,
        record: BootstrapRecord,
        record_bytes: bytes,
        digest_hex: str,
        seed_chunks: Sequence[bytes] = (),
        *,
        job: QueuedJob | None = None,
    ) -> bool:
        """Write the chunks (context and seed), then atomically the record (write-once), the queued
        state and the first event, and `job` onto the broker's queue: one round trip (two when a chunk this
        store wrote before is gone). True if `job` was queued; without one, or when a chunk was gone, the
        caller sends the job.

        `job` goes to this store's Redis, so only a broker on the same server may pass one (`workers.broker.envelope`).

        A chunk this store wrote before is not sent again: its TTL is refreshed, and if it is gone
        (expired, deleted) it is written again, before the caller enqueues the job. `seed_chunks` are
        the chunks the record names (`record.seed_chunks` holds their digests, which name their keys).

        Raises:
            RecordExistsError: a different record already exists under this fork id.
            RecordIntegrityError: the number of seed chunks is not the number the record names.
            SessionCancelled: the record's parent session was cancelled moments ago (its tombstone exists);
                nothing was written.
        """
        from workers.records.events import QueuedData  # noqa: PLC0415 (see the TYPE_CHECKING imports)

        fid = record.fork_id
        session = record.parent_session
        data = QueuedData(kind=record.kind, digest=digest_hex, messages=record.message_count).to_json()
        chunks, chunk_keys = self._launch_chunks(record, seed_chunks)
        sent = [b"" if self._known_chunk(key) else chunk for key, chunk in zip(chunk_keys, chunks, strict=True)]
        tombstone = self.keys.session_cancelled(session)
        keys = [self.keys.bootstrap(fid), self.keys.state(fid), self.keys.events(fid), self.keys.session_forks(session)]
        keys.append(tombstone)
        args: list[Any] = [record_bytes, self.ttl_s, record.kind, record.description, digest_hex, data, fid]
        args.append(record.tenant or "")  # the state's `tenant` ('' for `default`)
        if job is not None:
            keys += [job.queue_key, *(key for key, chunk in zip(chunk_keys, sent, strict=True) if not chunk)]
            args += [job.item, job.event_channel, job.event]
        gone, (outcome, queued) = self._scripts(
            (self._put_chunks, [tombstone, *chunk_keys], [self.ttl_s, *sent]), (self._launch, keys, args)
        )
        reply = fenced_reply(outcome, script="launch", fork_id=fid)
        if reply is Refused.CONFLICT:
            raise RecordExistsError(
                f"fork {fid}: a different bootstrap record already exists; fork ids must be unique per launch",
                fork_id=fid,
                key=self.keys.bootstrap(fid),
            )
        if reply is Refused.SESSION_CANCELLED:
            raise SessionCancelled(session_named(session), int(queued), fork_id=fid)
        if gone:  # expired or deleted since this store wrote them: write them again before the job is enqueued
            again = [int(i) - 1 for i in gone]
            rewrite = [tombstone, *(chunk_keys[i] for i in again)]
            self._scripts((self._put_chunks, rewrite, [self.ttl_s, *(chunks[i] for i in again)]))
        self._remember_chunks(chunk_keys)
        self._wait_for_replicas(fid)
        return bool(queued)

    def _launch_chunks(self, record: BootstrapRecord, seed_chunks: Sequence[bytes]) -> tuple[list[bytes], list[str]]:
        """A launch's chunks (context, seed index, seed) and their keys.

        Raises:
            RecordIntegrityError: the number of seed chunks is not the number the record names.
        """
        fid = record.fork_id
        context = record.context_blob()
        index = record.seed_index_blob() if seed_chunks else None
        chunks = [context, *([index] if index is not None else []), *seed_chunks]
        if seed_chunks and len(seed_chunks) != len(record.seed_chunks):
            raise RecordIntegrityError(
                f"fork {fid}: {len(seed_chunks)} seed chunks given, the record names {len(record.seed_chunks)}; "
                "pass the chunks the record was built from, in its order",
                fork_id=fid,
            )
        # the record names its seed chunks by their digests (`ForkClient.launch` built both): no second hash
        digests = [chunk_digest(context), *([chunk_digest(index)] if index is not None else [])]
        digests += record.seed_chunks if seed_chunks else ()
        return chunks, [self.keys.chunk(record.parent_session, d.hex()) for d in digests]

    def _scripts(self, *calls: tuple[Script, list[str], list[Any]]) -> list[Any]:
        """Run scripts in one pipelined round trip (`workers.store.pipelined.run_scripts`)."""
        return run_scripts(self.client, [ScriptCall(*call) for call in calls])

    def _wait_for_replicas(self, fork_id: str) -> None:
        """With replicas, acknowledge a launch only once they have the record too (`WAIT`)."""
        if self._replicas is None:
            info = self.client.info("replication")
            self._replicas = int(info.get("connected_slaves", 0))
        if self._replicas:
            acked = int(self.client.wait(self._replicas, WAIT_TIMEOUT_MS))
            if acked < self._replicas:
                log.warning(
                    "fork %s: %d of %d replicas acknowledged the record within %d ms",
                    fork_id,
                    acked,
                    self._replicas,
                    WAIT_TIMEOUT_MS,
                )

    def dead_letter(self, task_id: str | None, reason: str, *, item: Rejected | None = None) -> None:
        """Keep a refused job's id and reason, or a refused queue item's (`workers.store.dead_letters`)."""
        dead_letters.dead_letter(self.client, self.keys, task_id, reason, item=item)

    # ── worker side ───────────────────────────────────────────────────────────────────────────

    def _record_bytes(self, fork_id: str) -> bytes:
        data = cast(bytes | None, self.client.get(self.keys.bootstrap(fork_id)))
        if data is None:
            raise reads.no_record(fork_id)
        return data

    def _chunks(self, parent_session: str, digests: Sequence[bytes]) -> list[bytes]:
        """Chunks by digest in one MGET; a missing one comes back empty (and fails its digest check)."""
        fetched = self.client.mget([self.keys.chunk(parent_session, d.hex()) for d in digests]) if digests else []
        return [c if isinstance(c, bytes) else b"" for c in fetched]

    def get_record(self, fork_id: str, digest_hex: str | None) -> BootstrapRecord:
        """The bootstrap record with its context, verified against `digest_hex` when given (`reads.record`)."""
        return reads.run(self.client, reads.record(self.keys, fork_id, digest_hex))

    def read_inputs(self, fork_id: str, digest_hex: str | None) -> tuple[BootstrapRecord, ForkSeed]:
        """Record and seed of a fork, read from Redis and verified (two round trips)."""
        return self.load_inputs(fork_id, self._record_bytes(fork_id), digest_hex)

    def load_inputs(
        self, fork_id: str, data: bytes, digest_hex: str | None, inline: Sequence[bytes] | None = None
    ) -> tuple[BootstrapRecord, ForkSeed]:
        """Record and seed from stored record bytes, with the job's inline chunks (context first, then
        the seed's) or, without them, the chunks read from Redis in one round trip; all verified.
        Chunks the store's chunk cache holds are neither read nor decoded again.
        """
        if inline:
            record = BootstrapRecord.decode(
                data, fork_id=fork_id, context=inline[0], expected_digest=digest_hex, cache=self.chunk_cache
            )
            return record, join_seed(record, inline[1:], self.chunk_cache)
        named = BootstrapRecord.chunk_refs(data, fork_id=fork_id)
        chunks, cache = self._uncached_chunks(named.parent_session, named.refs)
        index = chunks[1] if named.indexed else b""
        record = BootstrapRecord.decode(
            data, fork_id=fork_id, context=chunks[0], index=index, expected_digest=digest_hex, cache=cache
        )
        if named.indexed:  # the seed chunks are known now: a second read, of those the cache lacks
            chunks, cache = self._uncached_chunks(named.parent_session, [b"", *record.seed_chunks])
        return record, join_seed(record, chunks[1:], cache)

    def _uncached_chunks(self, parent_session: str, refs: Sequence[bytes]) -> tuple[list[bytes], HeldChunks | None]:
        """The chunks named by `refs` from Redis in one MGET, except those the chunk cache holds (left empty,
        and held for this read), and what it holds. An empty ref stands for a chunk not wanted."""
        held = self.chunk_cache.hold(refs) if self.chunk_cache is not None else None
        missing = [i for i, ref in enumerate(refs) if ref and (held is None or ref not in held)]
        chunks = [b""] * len(refs)
        for i, chunk in zip(missing, self._chunks(parent_session, [refs[i] for i in missing]), strict=True):
            chunks[i] = chunk
        return chunks, held

    def load_seed(self, record: BootstrapRecord, chunks: Sequence[bytes] | None = None) -> ForkSeed:
        """The record's seed, from given chunks or from Redis, every chunk verified."""
        if chunks is None:
            chunks = self._chunks(record.parent_session, record.seed_chunks)
        return join_seed(record, chunks)

    # ── parent side ───────────────────────────────────────────────────────────────────────────

    def state(self, fork_id: str) -> ForkState:
        """The fork's current state (ForkNotFound if there is none)."""
        return reads.run(self.client, reads.state(self.keys, fork_id))

    def journal(self, fork_id: str) -> list[JournalEntry]:
        """Every journal entry of the fork, in order."""
        return reads.run(self.client, reads.journal(self.keys, fork_id))

    def result(self, fork_id: str) -> ForkResult | None:
        """The final result, or None while the fork has not ended."""
        return reads.run(self.client, reads.result(self.keys, fork_id))

    def ended(self, fork_id: str, *, deadline: float | None) -> ForkResult | ForkState:
        """The result once the fork has ended, waiting until `deadline`; else its state (`reads.ended`)."""
        return reads.run(self.client, reads.ended(self.keys, fork_id, deadline=deadline))

    def session_forks(self, parent_session: str, *, limit: int) -> list[reads.SessionFork]:
        """The newest `limit` forks launched from a parent session that are still in Redis, newest first."""
        return reads.run(self.client, reads.session_forks(self.keys, parent_session, limit=limit))

    def cancel(self, fork_id: str) -> Status:
        """Cancel a fork that has not ended; returns the status it has afterwards.

        The cancelled result keeps what the fork used: tokens, model calls and tool uses from its
        journal, and its time since the first start (time parked not counted). The journal is read
        and tallied here; the script adds what was appended since, so it holds the scripting work.

        Raises:
            ForkNotFound: the fork does not exist.
        """
        return self._cancel_tallied(fork_id, cast(list[bytes], self.client.lrange(self.keys.journal(fork_id), 0, -1)))

    def _cancel_tallied(self, fork_id: str, journal: list[bytes]) -> Status:
        """Cancel with the usage of `journal`, the entries read so far; the script tallies the ones after them."""
        keys, args = self._cancel_call(fork_id, journal)
        reply = self._cancel(keys=keys, args=args)
        if reply == Refused.MISSING.value.encode():
            raise reads.not_found(fork_id)
        return word_of(Status, reply, script="cancel", fork_id=fork_id)

    def _cancel_call(self, fork_id: str, journal: list[bytes]) -> tuple[list[str], list[Any]]:
        """The cancel script's keys and arguments, with the usage of `journal` (the entries read so far)."""
        from workers.records.conversation import journal_usage  # noqa: PLC0415  (a cancel only: not to read a state)

        usage, k = journal_usage(journal, fork_id), self.keys
        counted = [len(journal), usage.input_tokens, usage.output_tokens, usage.model_calls, usage.tool_uses]
        counted.append(usage.cached_input_tokens)  # ARGV[8], after the counts the script always took
        keys = [k.state(fork_id), k.events(fork_id), k.result(fork_id), k.bootstrap(fork_id), k.journal(fork_id)]
        return keys, [fork_id, self.ttl_s, *counted]

    def cancel_many(self, fork_ids: Sequence[str]) -> dict[str, Cancel]:
        """Cancel forks that have not ended, each as `cancel` does, in three pipelined round trips for them all:
        their states, the journals of those not ended, the cancel scripts. What each cancel found and left."""
        pipe = self.client.pipeline(transaction=False)
        for fid in fork_ids:
            pipe.hmget(self.keys.state(fid), "status", "attempt")
        states = cast(list[list[bytes | None]], pipe.execute())
        outcomes: dict[str, Cancel] = {}
        for fid, (status, attempt) in zip(fork_ids, states, strict=True):
            before = None if status is None else word_of(Status, status, script="status", fork_id=fid)
            outcomes[fid] = Cancel(before=before, after=before, attempt=int(attempt or 0))
        live = [fid for fid, found in outcomes.items() if found.before is not None and not found.before.terminal]
        if not live:
            return outcomes
        pipe = self.client.pipeline(transaction=False)
        for fid in live:
            pipe.lrange(self.keys.journal(fid), 0, -1)
        journals = cast(list[list[bytes]], pipe.execute())
        calls = [(self._cancel, *self._cancel_call(fid, journal)) for fid, journal in zip(live, journals, strict=True)]
        for fid, reply in zip(live, self._scripts(*calls), strict=True):
            gone = reply == Refused.MISSING.value.encode()
            after = None if gone else word_of(Status, reply, script="cancel", fork_id=fid)
            outcomes[fid] = dataclasses.replace(outcomes[fid], after=after)
        return outcomes

    def resume(self, fork_id: str) -> bool:
        """Put a paused fork back in the queue state; True when it was paused."""
        reply = self._resume(keys=[self.keys.state(fork_id), self.keys.events(fork_id)])
        return fenced_reply(reply, script="resume", fork_id=fork_id) is Written.RESUMED

    def decide(
        self, fork_id: str, call_id: str, decision: str, reason: str | None = None, *, by: Decider | None = None
    ) -> Decision:
        """Record a person's `approve`/`deny` of a parked call, and who made it (`by`); `queued` when it was the last
        one undecided.

        Otherwise `recorded` (other calls still wait). Raises ForkNotFound; InvalidApproval when
        the fork is not awaiting approval or has no such pending call.
        """
        from workers.records.events import DecisionData, decision_event  # noqa: PLC0415 (see TYPE_CHECKING)

        verdict: Literal["approve", "deny"] = "approve" if decision == "approve" else "deny"
        for _ in range(DECIDE_ATTEMPTS):  # the journal length can only change under us if a decision races
            state = self.state(fork_id)
            call = next((p for p in state.pending_approval if p.call_id == call_id), None)
            if state.status is not Status.AWAITING_APPROVAL or call is None:
                raise InvalidApproval(_approval_refusal(state, call_id), fork_id=fork_id)
            seq = self.client.llen(self.keys.journal(fork_id))
            entry = JournalEntry(
                seq=seq,
                step=call.step,
                kind=EntryKind.APPROVAL,
                call_index=call.index,
                call_id=call_id,
                name=call.name,
                decision=verdict,
                reason=reason or None,
                decided_by=None if by is None else by.who,
                decided_tenant=None if by is None else by.tenant,
                decided_ms=None if by is None else int(time.time() * 1000),
            )
            event = decision_event(verdict, DecisionData(call_id=call_id, name=call.name, reason=reason))
            outcome = self._decide(
                keys=[
                    self.keys.state(fork_id),
                    self.keys.journal(fork_id),
                    self.keys.events(fork_id),
                    self.keys.running,
                ],
                args=[call_id, entry.encode(), seq, *event.encoded(), DECISION_GRACE_MS, fork_id],
            )
            word = cast(bytes, outcome).decode()
            if word != Refused.SEQ:
                if word in DECIDED:
                    return Decision(word)
                raise InvalidApproval(_approval_refusal(self.state(fork_id), call_id), fork_id=fork_id)
        raise InvalidApproval(f"fork {fork_id}: decisions raced {DECIDE_ATTEMPTS} times; try again", fork_id=fork_id)

    def teammate(self, parent_session: str, name: str) -> str | None:
        """The fork id of the last teammate launched as `name` from the session, or None."""
        entry = self.teammate_entry(parent_session, name)
        return None if entry is None else entry.split(" ", 1)[0]

    def teammate_entry(self, parent_session: str, name: str) -> str | None:
        """The names hash's entry for `name`: `<fork id> <launch ms>`, or None."""
        found = self.client.hget(self.keys.session_names(parent_session), name)
        return None if found is None else cast(bytes, found).decode()

    def claim_name(self, parent_session: str, name: str, fork_id: str, *, expected: str | None) -> bool:
        """Map `name` to `fork_id` (with the time, for a launch that never completed) if the entry is still
        `expected` (None: no entry).

        Raises:
            SessionCancelled: the session was cancelled moments ago (its tombstone exists); nothing was written.
        """
        keys = [self.keys.session_names(parent_session), self.keys.session_cancelled(parent_session)]
        entry = f"{fork_id} {int(time.time() * 1000)}"
        reply = self._claim_name(keys=keys, args=[name, expected or "", entry, self.ttl_s])
        if isinstance(reply, bytes):  # the session's tombstone: it was cancelled moments ago
            raise SessionCancelled(session_named(parent_session), int(reply), fork_id=fork_id)
        return bool(reply)

    def send(self, fork_id: str, text: str, *, inbox_limit: int) -> tuple[SendReply, int]:
        """Give the fork a message: (`queued` in its inbox or `continued`, messages waiting); the reply is otherwise
        why not: `missing`, `failed`, `cancelled`, `full`. A `continued` fork's job is the caller's to send.

        Raises:
            SessionCancelled: the fork had succeeded, and its session was cancelled moments ago: it is not
                continued, and nothing was written.
        """
        keys = [
            self.keys.state(fork_id),
            self.keys.inbox(fork_id),
            self.keys.events(fork_id),
            self.keys.running,
            self.keys.result(fork_id),
        ]
        session = self._session_of(fork_id)
        if session is not None:  # a continuation is a launch into the session: its tombstone refuses it
            keys.append(self.keys.session_cancelled(session))
        args: list[Any] = [text.encode("utf-8"), inbox_limit, self.ttl_s, fork_id, DECISION_GRACE_MS]
        word, waiting = cast(list[Any], self._send(keys=keys, args=args))
        reply = word_of(SendReply, word, script="send", fork_id=fork_id)
        if reply is SendReply.SESSION_CANCELLED and session is not None:
            raise SessionCancelled(session_named(session), int(waiting), fork_id=fork_id)
        return reply, int(waiting)

    def _session_of(self, fork_id: str) -> str | None:
        """The parent session the fork's record names; None without a readable record (a message still reaches it)."""
        data = cast(bytes | None, self.client.get(self.keys.bootstrap(fork_id)))
        try:
            return None if data is None else BootstrapRecord.chunk_refs(data, fork_id=fork_id).parent_session
        except RecordDecodeError:
            return None

    def events(
        self, fork_id: str, *, after: str = "0-0", block_ms: int | None = None, count: int = 1000
    ) -> list[StreamEvent]:
        """Events after stream id `after`; with `block_ms`, wait up to that long for new ones."""
        entries = reads.run(self.client, reads.events(self.keys, fork_id, after=after, block_ms=block_ms, count=count))
        return [decode_event(*entry) for entry in entries]

    def latest_events(self, fork_id: str, *, count: int) -> list[StreamEvent]:
        """The fork's newest `count` events, newest first."""
        entries = reads.run(self.client, reads.latest_events(self.keys, fork_id, count=count))
        return [decode_event(*entry) for entry in entries]

    def follow(self, fork_id: str, *, after: str = "0-0", block_ms: int = 1000) -> Iterator[StreamEvent]:
        """Every event from `after` on, waiting for new ones, until the fork's terminal event."""
        while True:
            for event in self.events(fork_id, after=after, block_ms=block_ms):
                after = event.id
                yield event
                if event.terminal:
                    return


@dataclass(frozen=True)
class Decider:
    """Who approves or denies a call: `token:<id>` of an API token, or `local` (ForkClient, the CLI), and a tenant."""

    who: str
    tenant: str


def _approval_refusal(state: ForkState, call_id: str) -> str:
    if state.status is not Status.AWAITING_APPROVAL:
        return f"fork {state.fork_id} is {state.status.value}, not awaiting approval: there is no call to decide"
    waiting = ", ".join(f"{p.call_id} ({p.name})" for p in state.pending_approval) or "none"
    return f"fork {state.fork_id}: no pending call {call_id!r}; calls awaiting approval: {waiting}"


def decode_event(event_id: bytes, fields: dict[bytes, bytes]) -> StreamEvent:
    """The event of one XREAD/XRANGE entry (`workers.records.events.decode_event`, loaded at the first read)."""
    from workers.records import events  # noqa: PLC0415 (see the TYPE_CHECKING imports)

    return events.decode_event(event_id, fields)

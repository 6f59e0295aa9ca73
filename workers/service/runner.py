"""What a worker does with one fork job: verify, claim, replay, run the loop, finish or release."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Final

import redis

from broker_config.redis_client import redis_client
from broker_config.settings import Settings
from workers.base.keys import Keys
from workers.base.limits import INBOX_DELIVERY_BATCH
from workers.errors import ForkNotFound, ForkqError, LeaseLost, RecordIntegrityError
from workers.history.selection import ForkSeed
from workers.loop.budget import BudgetReached
from workers.loop.child import STOP_REASONS, ChildLoop, Parked, PrimedCall, Spawner, Stopped, StopReason
from workers.loop.guard import CallGuard, Guards
from workers.providers import ModelProvider
from workers.providers.routing import ProviderRouter, build_provider, endpoint_of
from workers.records.conversation import is_final_answer, recorded_surface
from workers.records.events import Event
from workers.records.fork import BootstrapRecord, ChunkCache, Declarations, ForkResult, Status
from workers.records.journal import EntryKind, JournalEntry, RequestDigests
from workers.service.admission import Admission, AdmissionGuard, SharedCooldown
from workers.service.budget import BudgetPark, budget_guard
from workers.service.job import FirstStep, RunForkJob, executable, first_step, load_inputs
from workers.service.metrics import Metrics
from workers.service.outcome import ENDED, STOPPED, Outcome, RunOutcome, stop_reason
from workers.service.progress import Progress, RunObserver
from workers.service.spawn import SubagentSpawner
from workers.store.admission import AdmissionStore
from workers.store.blobs import BlobStore
from workers.store.budget import BudgetStore
from workers.store.forks import ForkStore
from workers.store.lease import Claim, LeaseKeeper, Leases, revival_grace_s, ride_out
from workers.store.pipelined import Rider
from workers.store.presence import Presence, owner_token, presence_token
from workers.store.replies import RefusalReason, Written
from workers.subagents.definitions import CatalogCache
from workers.tools.builtins import load_tools
from workers.tools.registry import ToolRegistry
from workers.workspace.materialize import WorkspaceCache

if TYPE_CHECKING:  # a snapshot fork's run loads the workspace machinery; a shared one never does
    from workers.service.workspace import RunWorkspace, WorkspaceUse

log = logging.getLogger("forkq.worker")

Requeue = Callable[[str, str, int], None]  # fork id, digest, attempt

POOL_HEADROOM: Final = 16  # Redis connections of a worker process beyond one per fork slot
# the shortest Redis socket timeout of a worker: above the longest command it blocks on by design (the
# nested-subagent wait's XREAD BLOCK of spawn.POLL_MS, a launch's WAIT for replicas of store.WAIT_TIMEOUT_MS)
MIN_REDIS_TIMEOUT_S: Final = 2.0
MAX_REDIS_TIMEOUT_S: Final = 5.0
# pings of the presence connection within the sweeper's grace: a dropped one is named again well inside it
PRESENCE_PINGS_PER_GRACE: Final = 5


def redis_timeout_s(settings: Settings) -> float:
    """The worker's Redis socket and connect timeout: FORKQ_HEARTBEAT_S, within 2-5 s.

    A Redis that goes silent (a stopped process, a partition, a primary lost in a failover) would
    otherwise hold a write or a heartbeat until TCP gives up, long after the lease lapsed. Timed out,
    the call is retried on a new connection (`workers.store.lease.ride_out`, the heartbeat's retry), so a
    blocked renewal costs at most one beat.
    """
    return min(max(settings.heartbeat_s, MIN_REDIS_TIMEOUT_S), MAX_REDIS_TIMEOUT_S)


@dataclass
class WorkerRuntime:
    """Per-process worker resources, built lazily (after a prefork child starts) and thread-safe."""

    settings: Settings
    requeue: Requeue | None = None  # set by make_app: enqueue a released fork again
    stopping: threading.Event = field(default_factory=threading.Event)  # set on worker shutdown
    slots: int | None = None  # fork slots of the worker (its step sets it); None: FORKQ_WORKER_CONCURRENCY
    # named by every claim's owner token; made before a prefork pool forks, so its children share it
    presence_token: str = field(default_factory=presence_token)

    @cached_property
    def redis(self) -> redis.Redis:
        """One client (one connection pool) per process: a connection for every fork slot and the worker's own,
        and calls that time out (`redis_timeout_s`).

        A run holds one connection at a time; the headroom is for the heartbeat, the dead letters and
        beat sweeps. redis-py's default pool (100) failed runs at `--concurrency 1000` with
        `MaxConnectionsError`; a full pool now makes a command wait for a connection instead.
        """
        slots = self.slots or self.settings.worker_concurrency
        timeout = redis_timeout_s(self.settings)
        return redis_client(
            self.settings,
            health_check_interval=30,
            max_connections=slots + POOL_HEADROOM,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )

    @cached_property
    def store(self) -> ForkStore:
        """The fork store over this process's client."""
        return ForkStore(
            self.redis,
            Keys(self.settings.namespace),
            ttl_s=self.settings.record_ttl_s,
            chunk_cache=ChunkCache(self.settings.chunk_cache_mb * 1024 * 1024),
        )

    @cached_property
    def budgets(self) -> BudgetStore:
        """Session token budgets: read before each model call, charged after it."""
        return BudgetStore(self.redis, Keys(self.settings.namespace), ttl_s=self.settings.record_ttl_s)

    @cached_property
    def leases(self) -> Leases:
        """Claims and fenced writes."""
        return Leases(
            self.redis,
            Keys(self.settings.namespace),
            ttl_ms=int(self.settings.lease_ttl_s * 1000),
            retention_s=self.settings.record_ttl_s,
            lapse_grace_ms=int(revival_grace_s(self.settings.heartbeat_s) * 1000),
        )

    @cached_property
    def digests(self) -> RequestDigests:
        """Model request digests, each message encoded once per process (forks share their seed's)."""
        return RequestDigests()

    @cached_property
    def declarations(self) -> Declarations:
        """Parsed tool declarations, once per parent (forks of one parent share them and their encoding)."""
        return Declarations()

    @cached_property
    def keeper(self) -> LeaseKeeper:
        """The process's heartbeat."""
        return LeaseKeeper(self.leases, interval_s=self.settings.heartbeat_s)

    @cached_property
    def presence(self) -> Presence:
        """The connection this runtime keeps open and names, so a sweeper sees at once when the process is gone."""
        own = redis.Redis(connection_pool=self.redis.connection_pool, single_connection_client=True)
        interval = self.settings.presence_grace_s / PRESENCE_PINGS_PER_GRACE
        return Presence(own, Keys(self.settings.namespace), self.presence_token, interval_s=interval)

    @cached_property
    def metrics(self) -> Metrics:
        """This process's Prometheus metrics, in the runtime's own registry (served by the worker step)."""
        metrics = Metrics()
        metrics.watch_workspaces(self._workspace_totals)
        return metrics

    @cached_property
    def workspace_use(self) -> WorkspaceUse:
        """The runs of this process holding a workspace folder (for the metrics)."""
        from workers.service.workspace import WorkspaceUse  # noqa: PLC0415  (snapshot forks only)

        return WorkspaceUse()

    def _workspace_totals(self) -> tuple[int, int, int, int]:
        """Runs holding a workspace folder, their trees' bytes, the cache's bytes and bound (zeros before any)."""
        runs, run_bytes = self.workspace_use.totals() if "workspace_use" in vars(self) else (0, 0)
        limit = self.settings.workspace_cache_mb * 1024 * 1024
        cache = vars(self).get("workspace_cache")
        return runs, run_bytes, 0 if cache is None else cache.used_bytes, limit

    @cached_property
    def provider(self) -> ModelProvider:
        """The model provider forks of this worker use: a router choosing one per request by model name (whose
        attempts share each limited model's cooldown with every worker, when FORKQ_MODEL_LIMITS is set)."""
        if self.admission is None:
            return ProviderRouter(self.settings)
        pacer = SharedCooldown(self.admission)
        return ProviderRouter(self.settings, build=lambda settings, kind: build_provider(settings, kind, pacer))

    @cached_property
    def admission(self) -> Admission | None:
        """Cluster-wide admission of model calls (None without FORKQ_MODEL_LIMITS: no cost at all)."""
        if not self.settings.model_limits:
            return None
        ttl_ms = int(self.settings.lease_ttl_s * 1000)  # silent this long, a worker's forks are revived: its slots too
        keys = Keys(self.settings.namespace)
        store = AdmissionStore(self.redis, keys, token=self.presence_token, hold_ttl_ms=ttl_ms, alive_ttl_ms=ttl_ms)
        return Admission(store, self.settings, self.metrics, lambda model: endpoint_of(self.settings, model))

    @cached_property
    def spawner(self) -> SubagentSpawner | None:
        """Launches nested subagents (None without a broker to enqueue them on); a run binds it to its claim."""
        if self.requeue is None:
            return None
        definitions = CatalogCache(self.settings.agents_dir)
        return SubagentSpawner(self.store, self.requeue, self.stopping, catalog=definitions.get)

    @cached_property
    def blobs(self) -> BlobStore:
        """Workspace blobs and manifests (the default scope until tenants exist)."""
        return BlobStore(self.redis, Keys(self.settings.namespace), ttl_s=self.settings.record_ttl_s)

    @cached_property
    def workspace_cache(self) -> WorkspaceCache:
        """This process's bounded cache of workspace files."""
        from workers.service.workspace import worker_cache  # noqa: PLC0415  (snapshot forks only)

        return worker_cache(self.settings)

    @cached_property
    def tools(self) -> ToolRegistry:
        """The tools this worker can execute: built-ins and the `forkq.tools` entry points."""
        return load_tools(default_timeout_s=self.settings.tool_timeout_s)


@dataclass
class FencedChannel:
    """The loop's `ForkIO` for one claim: events buffered into the next fenced write or checkpoint.

    A step costs two round trips: a checkpoint before the model call (events + status check) and
    the journal append after it (entry + events, fenced by epoch and lease); the last step's append
    rides on the fenced `finish`, so a one-step fork makes three in all with its claim. Budgets and admission
    add no round trip after the call: its charge and its release ride on the append (`ride`), and the budget
    read before it on the checkpoint (`ahead`).
    """

    leases: Leases
    claim: Claim
    lost: threading.Event
    stopping: threading.Event
    pending_entries: list[JournalEntry] = field(default_factory=list)  # written with the next append
    pending_events: list[Event] = field(default_factory=list)
    observe: Callable[[Event], None] | None = None  # metrics and Flower progress, as emitted
    published: list[Event] = field(default_factory=list)  # by the claim (`Claim.primed`)
    mail: bool = False  # messages wait in the inbox (as the claim, or the last fenced write, found it)
    mail_items: list[bytes] = field(default_factory=list)  # read by `take_mail`, moved by `deliver`
    riders: list[Rider] = field(default_factory=list)  # scripts sent with the next fenced write (`ride`)
    before_call: list[Callable[[], Rider | None]] = field(default_factory=list)  # riders of each checkpoint (`ahead`)

    def ride(self, rider: Rider) -> None:
        """Send `rider` with the fork's next fenced write (a model call's charge and release: the append after it)."""
        self.riders.append(rider)

    def ahead(self, make: Callable[[], Rider | None]) -> None:
        """Send `make()`'s rider with each checkpoint (the round trip just before a model call)."""
        self.before_call.append(make)

    def _take_riders(self, *, checkpoint: bool = False) -> list[Rider]:
        riders, self.riders = self.riders, []
        if checkpoint:
            riders += [rider for make in self.before_call if (rider := make()) is not None]
        return riders

    def send_riders(self) -> None:
        """Send the riders no write took along (the run ended first), in a round trip of their own."""
        self.leases.send_riders(self.claim, self._take_riders())

    def emit(self, event: Event) -> None:
        """Queue a progress event."""
        self.pending_events.append(event)
        if self.observe is not None:
            self.observe(event)

    def _take_events(self) -> list[Event]:
        events, self.pending_events = self.pending_events, []
        return events

    def stop_if_asked(self) -> None:
        """Raise `Stopped` when the fork must stop: cancelled, lost, or its worker stops."""
        self._stop_if_asked()

    def _stop_if_asked(self) -> None:
        if self.lost.is_set():  # the heartbeat found the lease gone, or the fork no longer running: which?
            status = self.leases.emit(self.claim, [])
            raise Stopped(stop_reason(status))
        if self.stopping.is_set():
            raise Stopped(StopReason.SHUTDOWN)

    def checkpoint(self) -> None:
        """Publish queued events and stop if the fork was cancelled, lost or its worker stops.

        The first checkpoint of a primed claim costs no round trip when its events are the ones the
        claim published: the claim wrote them, and found the fork running, atomically.
        """
        self._stop_if_asked()
        published, self.published = self.published, []
        if published and not self.pending_entries and self.pending_events == published:
            self.pending_events = []
            return
        riders = self._take_riders(checkpoint=True)
        if self.pending_entries:  # the first run's tool surface: recorded before the first model call
            entries, self.pending_entries = self.pending_entries, []
            self.mail = self.leases.append(self.claim, *entries, events=self._take_events(), riders=riders)
            return
        status = self.leases.emit(self.claim, self._take_events(), riders)
        if status is not Status.RUNNING:
            raise Stopped(stop_reason(status))

    def append(self, entry: JournalEntry, *, boundary: bool = False) -> None:
        """Fenced append of `entry` (after any pending ones) with the queued events.

        A final answer (a model entry without calls) is held for the next write, normally `finish`:
        nothing runs on it, so a worker lost meanwhile only makes the revived run ask the model again.
        """
        if boundary:
            self._stop_if_asked()
        entries, self.pending_entries = [*self.pending_entries, entry], []
        if not boundary and is_final_answer(entry):
            self.pending_entries = entries
            return
        self.mail = self.leases.append(self.claim, *entries, events=self._take_events(), riders=self._take_riders())

    def take_mail(self) -> list[str]:
        """The oldest messages waiting in the inbox (none without a round trip when no write saw any)."""
        if not self.mail:
            return []
        self.mail_items = self.leases.inbox(self.claim.fork_id, INBOX_DELIVERY_BATCH)
        self.mail = bool(self.mail_items)
        return [item.decode("utf-8", "replace") for item in self.mail_items]

    def deliver(self, entries: list[JournalEntry]) -> None:
        """Journal `entries` (the messages `take_mail` read, after any held entry) and take them from the inbox."""
        self._stop_if_asked()
        held, self.pending_entries = self.pending_entries, []
        items, self.mail_items = self.mail_items, []
        events, riders = self._take_events(), self._take_riders()
        self.mail = self.leases.deliver(self.claim, [*held, *entries], items, events=events, riders=riders)

    def finish(self, result: ForkResult) -> Written:
        """Write the result with the held entries and queued events (one round trip); `continued` when
        messages arrived meanwhile and the fork was queued again instead (see `Leases.finish`)."""
        entries, self.pending_entries = self.pending_entries, []
        return self.leases.finish(self.claim, result, *entries, events=self._take_events(), riders=self._take_riders())


def run_fork_job(
    runtime: WorkerRuntime,
    job: RunForkJob,
    progress: Progress | None = None,
    claimed: Callable[[Claim], None] | None = None,
) -> RunOutcome:
    """Run one delivery of a fork job; returns what happened (`succeeded`, a `duplicate` of `<status>`, ...).

    `progress` is called once per step (`workers.service.progress.step_progress` fields), `claimed` once the
    delivery holds the fork (Flower's final state of the run before it); neither can stop the fork.

    A delivery whose digest is not the fork's launch digest is refused without touching the fork;
    a stored record that no longer matches its digest fails the fork; a delivery for a fork that is
    not queued (running under a live lease, finished, cancelled) is a no-op.
    """
    fid = job.fork_id
    if runtime.stopping.is_set() and runtime.requeue is not None:
        # a worker that is shutting down hands new deliveries back instead of claiming them
        runtime.requeue(fid, job.digest, 0)
        runtime.metrics.skipped(Outcome.HANDED_BACK)
        return RunOutcome(Outcome.HANDED_BACK)
    first = first_step(
        job, store=runtime.store, declarations=runtime.declarations, digests=runtime.digests, tools=runtime.tools
    )
    claim = runtime.leases.claim(
        fid, owner_token(runtime.presence_token), job.digest, first=first.write if first else None
    )
    if not isinstance(claim, Claim):
        if claim.reason is RefusalReason.FORGED:
            raise RecordIntegrityError(
                f"fork {fid}: job digest {job.digest[:12]}… is not the fork's launch digest; "
                "the job message was altered or belongs to another fork",
                fork_id=fid,
            )
        if claim.reason is RefusalReason.MISSING:
            raise ForkNotFound(f"fork {fid}: no such fork (never launched, or past its retention)", fork_id=fid)
        log.info("fork %s: delivery ignored, fork is %s", fid, claim.word)
        runtime.metrics.skipped(Outcome.DUPLICATE)
        return RunOutcome(Outcome.DUPLICATE, claim.word)
    lost = runtime.keeper.hold(claim)
    run = RunObserver(runtime.metrics, runtime.tools.tools, claim.attempt, progress)
    if claimed is not None:
        try:
            claimed(claim)
        except Exception as exc:  # observability never stops a fork
            log.warning("fork %s: the claim of attempt %d was not reported: %s", fid, claim.attempt, exc)
    try:
        return RunOutcome(run.ended(_run_claimed(runtime, job, claim, lost, observe=run.observe, first=first)))
    except LeaseLost as exc:
        if exc.refusal == Status.CANCELLED:  # cancelled mid-step: the write after it was fenced out, as it must be
            log.info("fork %s: cancelled while it ran; stopped", job.fork_id)
            return RunOutcome(run.ended(Outcome.CANCELLED))
        log.warning("%s", exc)
        return RunOutcome(run.ended(Outcome.LEASE_LOST))
    finally:
        run.close()
        runtime.keeper.drop(claim)


@dataclass
class Prepared:
    """What a claimed run starts from: its inputs, its journal, its channel, the tools it lacks."""

    record: BootstrapRecord
    seed: ForkSeed
    entries: list[JournalEntry]
    channel: FencedChannel
    declared: list[dict[str, Any]]
    missing: list[str]
    provider: ModelProvider
    spawner: Spawner | None
    primed: PrimedCall | None = None  # the first call the claim announced, made from this record


def _run_claimed(
    runtime: WorkerRuntime,
    job: RunForkJob,
    claim: Claim,
    lost: threading.Event,
    *,
    observe: Callable[[Event], None] | None = None,
    first: FirstStep | None = None,
) -> Outcome:
    fid = job.fork_id
    try:
        run = _prepare(runtime, job, claim, lost, observe=observe, first=first)
    except LeaseLost:  # Redis unreachable until the lease lapsed: the fork is revived, not failed
        raise
    except (ForkqError, redis.RedisError) as exc:
        runtime.leases.finish(claim, ForkResult(fork_id=fid, status=Status.FAILED, error=str(exc)))
        raise
    except Exception as exc:  # e.g. a broken tool plugin: fail now with the cause, not later as worker_lost
        log.exception("fork %s: worker could not set up the run", fid)
        error = f"worker setup failed: {type(exc).__name__}: {exc}"
        runtime.leases.finish(claim, ForkResult(fork_id=fid, status=Status.FAILED, error=error))
        return Outcome.FAILED
    if run.missing:
        reason = (
            f"declared tool(s) {', '.join(run.missing)} not available on this worker; the fork was started "
            "with them and does not run with a different tool surface: install them and `forkq resume`"
        )
        runtime.leases.pause(claim, reason)
        return Outcome.PAUSED
    return _run_loop(runtime, job, claim, lost, run)


def _guard(runtime: WorkerRuntime, job: RunForkJob, claim: Claim, run: Prepared) -> CallGuard:
    """What stands before each of the fork's model calls: its budgets, then its model's admission."""
    channel = run.channel
    until = claim.clock.deadline
    budget = budget_guard(runtime.settings, runtime.budgets, run.record, run.entries, until, rides=channel)
    admission = runtime.admission
    if admission is None or admission.limit_of(run.record.model) is None:
        return budget
    admit = AdmissionGuard(
        admission,
        fork_id=job.fork_id,
        session=run.record.parent_session,
        epoch=claim.epoch,
        owner=claim.owner,
        stop_if_asked=channel.stop_if_asked,
        rides=channel,
    )
    return Guards([budget, admit])  # the budget first: a fork at its budget never takes (or waits for) a slot


def _prepare(
    runtime: WorkerRuntime,
    job: RunForkJob,
    claim: Claim,
    lost: threading.Event,
    *,
    observe: Callable[[Event], None] | None,
    first: FirstStep | None,
) -> Prepared:
    """The run's inputs (the job's, when they are the stored record's bytes), journal, channel and tools."""
    primed = None
    if first is not None and claim.record == first.write.record:
        record, seed = first.record, first.seed
        primed = first.call if claim.primed else None  # a primed claim holds the job's record: this branch
    else:  # reads ride out a Redis outage like the fenced writes, while the lease certainly holds
        record, seed = ride_out(
            lambda: load_inputs(runtime.store, job, claim.record),
            until=claim.clock.deadline,
            what="reading its inputs",
            fork_id=job.fork_id,
        )
    entries = [JournalEntry.decode(raw, fork_id=job.fork_id) for raw in claim.journal]
    channel = FencedChannel(runtime.leases, claim, lost, runtime.stopping, observe=observe, mail=claim.mail > 0)
    if primed is not None:  # the claim published the first call's `model_call`: its checkpoint costs no round trip
        channel.published = [primed.event()]
    declared = runtime.declarations.of(record)
    missing = _check_tool_surface(runtime, declared, entries, channel)
    spawner = runtime.spawner
    # the nested-subagent wait rides out an outage like the claim's writes, until the same deadline
    bound = None if spawner is None else spawner.under(claim.clock.deadline)
    return Prepared(record, seed, entries, channel, declared, missing, runtime.provider, bound, primed)


def _run_loop(runtime: WorkerRuntime, job: RunForkJob, claim: Claim, lost: threading.Event, run: Prepared) -> Outcome:
    """The child loop of a prepared run, to its result, its park, or its stop."""
    settings = runtime.settings
    workspace = _workspace(runtime, run.record, claim)
    loop = ChildLoop(
        record=run.record,
        seed=run.seed,
        provider=run.provider,
        tools=runtime.tools,
        tool_declarations=run.declared,
        io=run.channel,
        entries=run.entries,
        max_turns=settings.max_turns,
        max_wall_s=settings.max_wall_s,
        running_s=claim.running_ms / 1000,
        max_depth=settings.max_subagent_depth,
        schema_retries=settings.schema_retries,
        spawner=run.spawner,
        cancelled=lost.is_set,
        digests=runtime.digests,
        primed=run.primed,
        workspace=workspace,
        guard=_guard(runtime, job, claim, run),
    )
    try:
        return _run_to_end(runtime, job, claim, run, loop=loop, workspace=workspace)
    finally:  # a call's charge and release that no write took along (the run stopped first) go on their own
        run.channel.send_riders()


def _run_to_end(
    runtime: WorkerRuntime,
    job: RunForkJob,
    claim: Claim,
    run: Prepared,
    *,
    loop: ChildLoop,
    workspace: RunWorkspace | None,
) -> Outcome:
    """Run `loop` and write how it ended: its result, its park, its pause, or its stop."""
    try:
        result = _run_in(loop, workspace)
    except Parked as park:  # no worker slot is held while a person decides
        runtime.leases.park(claim, park.calls)
        return Outcome.AWAITING_APPROVAL
    except BudgetReached as stop:  # before the model call: nothing of the step was spent
        BudgetPark(runtime.leases, runtime.store, runtime.budgets, runtime.requeue).park(claim, job.digest, stop)
        return stop_outcome(stop.reason, fork_id=job.fork_id)
    except Stopped as stop:
        return _stopped(runtime, job, claim, stop.reason)
    except (LeaseLost, redis.RedisError):
        raise
    except Exception as exc:  # a provider or loop failure ends the fork as failed, with the reason
        log.exception("fork %s: attempt %d failed", job.fork_id, claim.attempt)
        error = f"{type(exc).__name__}: {exc}"
        result = ForkResult(fork_id=job.fork_id, status=Status.FAILED, error=error, usage=loop.usage())
    if run.channel.finish(result) is Written.CONTINUED:  # messages arrived as it answered: the next run delivers them
        if runtime.requeue is not None:
            runtime.requeue(job.fork_id, job.digest, claim.attempt + 1)  # sends the job, then confirms it
        return Outcome.RELEASED
    return ENDED[result.status]


def _workspace(runtime: WorkerRuntime, record: BootstrapRecord, claim: Claim) -> RunWorkspace | None:
    """The run's own copy of a snapshot fork's files (None: its tools act on its `cwd` in place)."""
    if record.workspace is None or not record.workspace.snapshot:
        return None
    from workers.service.workspace import RunWorkspace  # noqa: PLC0415  (snapshot forks only)

    return RunWorkspace(
        record,
        settings=runtime.settings,
        blobs=runtime.blobs,
        cache=runtime.workspace_cache,
        epoch=claim.epoch,
        use=runtime.workspace_use,
    )


def _run_in(loop: ChildLoop, workspace: RunWorkspace | None) -> ForkResult:
    """The loop's run; the workspace's folder is removed however it ends (its changes are in the journal)."""
    try:
        return loop.run()
    finally:
        if workspace is not None:
            workspace.close()


def _check_tool_surface(
    runtime: WorkerRuntime, declared: list[dict[str, Any]], entries: list[JournalEntry], channel: FencedChannel
) -> list[str]:
    """Record the executable tool surface on the first run (with the first append); on a revival,
    the tools of the recorded surface this worker lacks."""
    surface = executable(runtime.tools, declared)
    recorded = recorded_surface(entries)
    if recorded is None:
        entry = JournalEntry(seq=len(entries), step=0, kind=EntryKind.SURFACE, tools=surface)
        channel.pending_entries.append(entry)
        entries.append(entry)
        return []
    return sorted(set(recorded) - set(surface))


def _stopped(runtime: WorkerRuntime, job: RunForkJob, claim: Claim, reason: StopReason) -> Outcome:
    if reason is StopReason.SHUTDOWN:  # checkpointed by the journal: hand the fork to another worker now
        runtime.leases.release(claim, "worker shutdown")
        if runtime.requeue is not None:
            runtime.requeue(job.fork_id, job.digest, claim.attempt + 1)  # sends the job, then confirms it
    return stop_outcome(reason, fork_id=job.fork_id)


def stop_outcome(reason: str, *, fork_id: str) -> Outcome:
    """How a run that stopped for `reason` (a `StopReason`) ended.

    A reason this worker does not know (a loop of another version), or `awaiting_approval` without
    `Parked` (nothing was parked), leaves the fork as a lost lease does: its lease lapses and the
    sweeper revives it from its journal.
    """
    outcome = STOPPED.get(StopReason(reason)) if reason in STOP_REASONS else None  # the one mapping, typed
    if outcome is not None:
        return outcome
    known = ", ".join(STOP_REASONS)
    log.error("fork %s: the loop stopped for %r, not one of %s; left to revival", fork_id, reason, known)
    return Outcome.LEASE_LOST

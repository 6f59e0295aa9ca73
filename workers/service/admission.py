"""The worker side of model admission (FORKQ_MODEL_LIMITS, docs/capacity.md): one coordinator per process, a
guard per fork, and the providers' shared cooldown.

A fork's `AdmissionGuard.enter` asks Redis once (`AdmissionStore.acquire`); when the call is admitted at once
that is all. Otherwise the fork's thread blocks on an event, and the process's `Admission` coordinator, one
thread, looks every `TICK_S` for all of the process's waiters at once (one script per model, pipelined) and
wakes those granted. The same thread renews the process's holds every heartbeat (one round trip).

A call's release (its hold freed, its tokens settled with the reported usage) costs no round trip of its own:
a call that answered is released by the journal append that records its answer, just after it (a `Rider` on the
fork's write, `workers.store.pipelined`), so admission adds one round trip per model call, the acquire. A call
that failed, a waiter that stops waiting, and a rider that did not get through are handed to the coordinator,
which wakes at once and sends every release of the process waiting to go in one pipelined round trip; a call's
acquire takes those still waiting along in its own round trip. The script hands the freed capacity on and wakes
this process's waiters it granted, so a slot passes between two forks of one process without a tick, and to
another process's waiter within that process's next tick. A release not yet sent when the worker dies is freed
as its other holds are (the hold is no longer renewed, and the sweeper frees a dead process's holds); `close`
sends the rest, and a release after `close` is sent by its own thread.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import redis

from broker_config.settings import ModelLimit, Settings, model_limit
from workers.base.keys import session_named
from workers.providers import ModelRequest, TokenUsage
from workers.records.parked import AdmissionLimit, ModelWait
from workers.service.metrics import Metrics
from workers.store.admission import (
    KEEP_ESTIMATE,
    AdmissionStore,
    Ask,
    Capacity,
    Release,
    WaitWrite,
    granted_of,
    wait_over,
    wait_shown,
)
from workers.store.pipelined import Rider, Rides

log = logging.getLogger("forkq.admission")

TICK_S: Final = 0.025  # how often a process with waiters looks for their grants
COMPLAINT_S: Final = 10.0  # a failed look is logged at most this often (an outage fails every look)
CENSUS_S: Final = 1.0  # how often a look also checks that every waiter is still queued (one dropped: asked again)
# how often a waiting fork checks whether it must stop (a cancel or a lost lease is known from the heartbeat, a
# shutdown at once): a thousand waiting threads wake twice a second, not in a tight loop
STOP_CHECK_S: Final = 0.5
CHARS_PER_TOKEN: Final = 4  # the estimate of a request's input tokens: its JSON's characters / 4
DEFAULT_OUTPUT_TOKENS: Final = 1024  # the output estimate of a request without a max output tokens setting
OUTPUT_KEYS: Final = ("max_output_tokens", "maxOutputTokens", "max_tokens")
# releases kept for another try while Redis does not answer; beyond, the oldest are left to their holds' TTL
RELEASES_KEPT: Final = 100_000


def capacity(limit: ModelLimit) -> Capacity:
    """A settings entry as the scripts take it."""
    return Capacity(limit.concurrency or 0, limit.rpm or 0, limit.tpm or 0)


def estimate(request: ModelRequest) -> int:
    """Tokens to reserve against tpm before the call: a quarter of the request's characters, plus its max output
    tokens (DEFAULT_OUTPUT_TOKENS without one). The call's reported usage settles it afterwards."""
    chars = sum(len(message.model_dump_json(exclude_none=True)) for message in request.messages)
    chars += len(str(request.system_instruction or "")) + len(str(request.tools))
    output = next((request.generation[k] for k in OUTPUT_KEYS if isinstance(request.generation.get(k), int)), None)
    return chars // CHARS_PER_TOKEN + (output if output is not None else DEFAULT_OUTPUT_TOKENS)


@dataclass
class Waiter:
    """A call of this process waiting for its grant."""

    model: str
    ask: Ask
    granted: threading.Event = field(default_factory=threading.Event)
    since: float = field(default_factory=time.monotonic)


@dataclass
class Admission:
    """One per worker process: the waiters' coordinator, the holds' heartbeat, and the guards' factory."""

    store: AdmissionStore
    settings: Settings
    metrics: Metrics
    endpoint_of: Callable[[str], str]  # a model's provider endpoint (`workers.providers.routing.endpoint_of`)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _waiters: dict[str, Waiter] = field(default_factory=dict)
    _holds: dict[str, set[str]] = field(default_factory=dict)  # model → hold ids of this process
    _counter: itertools.count[int] = field(default_factory=itertools.count)
    _writes: list[WaitWrite] = field(default_factory=list)  # forks' waits for their states, written by the next look
    _releases: list[Release] = field(default_factory=list)  # calls ended, sent by the coordinator's next round trip
    _wakeup: threading.Event = field(default_factory=threading.Event)  # something to do for an idle coordinator
    _released: threading.Event = field(default_factory=threading.Event)  # releases to send, between two ticks
    _stop: threading.Event = field(default_factory=threading.Event)
    _complained_at: float = -1e9  # monotonic time of the last logged failed look
    _thread: threading.Thread | None = None

    def limit_of(self, model: str | None) -> ModelLimit | None:
        """The model's limits (None: not limited, no admission)."""
        return model_limit(self.settings, model)

    def waiter_id(self, fork_id: str) -> str:
        """A new waiter id for a call of `fork_id`."""
        return f"{self.store.token}|{fork_id}|{next(self._counter)}"

    def weight(self, session: str) -> float:
        """The session's share of a short capacity (FORKQ_SESSION_WEIGHTS names a session by the id its tenant uses)."""
        return self.settings.session_weights.get(session_named(session), 1.0)

    def start(self) -> None:
        """Start the coordinator (once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="forkq-admission", daemon=True)
                self._thread.start()
                atexit.register(self.close)  # after the forks' threads: the releases not sent yet go

    def close(self) -> None:
        """Stop the coordinator, sending the releases not sent yet (later ones are sent by their own threads)."""
        self._stop.set()
        self._wakeup.set()
        self._released.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._send_releases()

    # ── a call's way through ──────────────────────────────────────────────────────────────────

    def acquire(self, model: str, ask: Ask) -> tuple[Waiter | None, ModelWait | None]:
        """Ask once: (None, None) when granted, else the waiter to wait on and the wait to show."""
        limit = self.limit_of(model)
        assert limit is not None
        self.start()
        waiter = Waiter(model, ask)
        with self._lock:  # known before Redis may grant it, so a look that collects the grant wakes it; releases
            self._waiters[ask.waiter] = waiter  # waiting for the coordinator ride along with this round trip
            releases, self._releases = self._releases, []
        try:
            answer, freed = self.store.release_and_acquire(releases, model, capacity(limit), ask)
        except BaseException:
            with self._lock:
                self._waiters.pop(ask.waiter, None)
                self._keep_releases(releases)
            raise
        for released_model, mine in freed:
            self._wake(released_model, mine)
        if answer.granted:
            self._granted(model, ask.waiter)
        self._wake(model, [other for other in answer.mine if other != ask.waiter])
        if waiter.granted.is_set():
            return None, None
        self._wakeup.set()
        limit_word = answer.limit or AdmissionLimit.CONCURRENCY
        return waiter, ModelWait(model=model, limit=limit_word, since_ms=answer.now_ms)

    def held(self, model: str, waiter: str) -> None:
        """The call was granted: its hold is renewed until `release`."""
        with self._lock:
            self._holds.setdefault(model, set()).add(waiter)

    def _forget(self, model: str, waiter: str, usage: TokenUsage | None) -> Release:
        """The call ended: its hold is no longer renewed here; its release, to send."""
        limit = self.limit_of(model)
        tokens = KEEP_ESTIMATE if usage is None else usage.input_tokens + usage.output_tokens
        with self._lock:
            self._waiters.pop(waiter, None)
            self._holds.get(model, set()).discard(waiter)
        return Release(model, capacity(limit or ModelLimit()), waiter, tokens)

    def release(self, model: str, waiter: str, usage: TokenUsage | None) -> None:
        """The call ended (or stopped waiting): its hold is no longer renewed, and the coordinator frees it, settles
        its tokens and wakes what it granted here with its next round trip (sent at once; none of this thread's)."""
        self._send_later(self._forget(model, waiter, usage))

    def release_rider(self, model: str, waiter: str, usage: TokenUsage) -> Rider:
        """The call ended: its release as a rider on its fork's next write, which wakes what it granted here; one
        that does not get through is sent by the coordinator."""
        one = self._forget(model, waiter, usage)
        return Rider(
            self.store.release_call(one),
            settle=lambda reply: self._wake(model, granted_of(reply)),
            failed=lambda exc: self._send_later(one),
        )

    def _send_later(self, one: Release) -> None:
        """Have the coordinator send `one` at once (this thread, when the coordinator is closed)."""
        with self._lock:
            self._releases.append(one)
            closed = self._stop.is_set()
        if closed:  # no coordinator any more (worker shutdown)
            self._send_releases()
            return
        self._released.set()
        self._wakeup.set()

    def _send_releases(self) -> bool:
        """Send the releases waiting (one round trip) and wake what they granted here; False when Redis did not
        answer (they are kept for another try; a hold not released meanwhile expires with its TTL)."""
        with self._lock:
            releases, self._releases = self._releases, []
        if not releases:
            return True
        try:
            sent = self.store.release_many(releases)
        except redis.RedisError as exc:
            with self._lock:
                self._keep_releases(releases)
            self._complain("%d holds were not released yet (%s); trying again every tick", len(releases), exc)
            return False
        for model, mine in sent:
            self._wake(model, mine)
        return True

    def _keep_releases(self, releases: list[Release]) -> None:
        """Keep releases Redis did not take for the next try, the oldest first (under the lock); past RELEASES_KEPT
        the oldest are left to their holds' TTL."""
        if releases:
            self._releases[:0] = releases
            del self._releases[:-RELEASES_KEPT]
            self._released.set()

    def _granted(self, model: str, waiter_id: str) -> bool:
        """Wake the waiter of a grant (its call now holds a slot); False when nobody here waits for it."""
        with self._lock:
            waiter = self._waiters.pop(waiter_id, None)
            if waiter is not None:
                self._holds.setdefault(model, set()).add(waiter_id)
        if waiter is not None:
            waiter.granted.set()
        return waiter is not None

    def _wake(self, model: str, granted: list[str]) -> None:
        """Wake the waiters of grants Redis handed this process (each once); one nobody waits for is handed back."""
        for waiter_id in granted:
            if not self._granted(model, waiter_id):
                self.release(model, waiter_id, TokenUsage())  # its fork stopped waiting meanwhile

    def show(self, write: WaitWrite) -> None:
        """Have a fork's wait written to its state and stream at the next look (the fork's call never waits for it)."""
        with self._lock:
            self._writes.append(write)
        self._wakeup.set()

    # ── the coordinator ───────────────────────────────────────────────────────────────────────

    def _run(self) -> None:
        renew_at = census_at = tick_at = 0.0
        while not self._stop.is_set():
            sent = self._send_releases()
            now = time.monotonic()
            if now >= tick_at:  # not when woken between two ticks for releases only
                tick_at = now + TICK_S
                try:
                    if now >= renew_at:
                        renew_at = now + self.settings.heartbeat_s
                        with self._lock:
                            holds = {model: sorted(ids) for model, ids in self._holds.items() if ids}
                        self.store.renew(holds)
                    census = now >= census_at
                    if census:
                        census_at = now + CENSUS_S
                    self._look(census)
                except redis.RedisError as exc:
                    self._complain("a look failed (%s); retrying every tick", exc)
                except Exception:  # a bug must not leave this process's waiting forks waiting for good
                    log.exception("admission: a look failed unexpectedly; retrying at the next tick")
                self._write_waits()
            self._pause(tick_at, renew_at, sent)
        self._send_releases()
        self._write_waits()

    def _complain(self, message: str, *args: object) -> None:
        """Log a failed look once per COMPLAINT_S: a Redis outage fails every 25 ms look, and says so once."""
        now = time.monotonic()
        if now >= self._complained_at + COMPLAINT_S:
            self._complained_at = now
            log.warning("admission: " + message, *args)

    def _pause(self, tick_at: float, renew_at: float, sent: bool) -> None:
        """Wait for the next thing to do: releases at once (those that came during the last send go now), waiters
        and waits to write at the next tick, else the next heartbeat or a call's ask."""
        self._released.clear()  # before looking, so what comes after the look wakes the wait below
        self._wakeup.clear()
        with self._lock:
            releases, busy = bool(self._releases), bool(self._waiters or self._writes)
        if releases:
            if not sent:  # Redis did not answer: try again at the next tick, not in a tight loop
                self._stop.wait(TICK_S)
            return
        if busy:
            self._released.wait(max(0.0, tick_at - time.monotonic()))
        else:
            self._wakeup.wait(max(0.0, renew_at - time.monotonic()))

    def _write_waits(self) -> None:
        """Write the waits shown and ended since the last look (one round trip); a failed write is dropped (the
        wait is shown, never a reason to stop a call; the next claim clears a stale one)."""
        with self._lock:
            writes, self._writes = self._writes, []
        if writes:
            try:
                self.store.write_waits(writes)
            except redis.RedisError as exc:
                self._complain("%d forks' waits were not written to their states (%s)", len(writes), exc)

    def _look(self, census: bool) -> None:
        """One look for every model with waiters: wake the granted, ask again for those dropped."""
        settled = time.monotonic() - CENSUS_S  # a census asks about waiters whose own acquire has certainly run
        with self._lock:
            by_model: dict[str, list[str]] = {}
            counted: dict[str, list[str]] = {}
            for waiter_id, waiter in self._waiters.items():
                by_model.setdefault(waiter.model, []).append(waiter_id)
                if census and waiter.since < settled:
                    counted.setdefault(waiter.model, []).append(waiter_id)
        limits = {model: self.limit_of(model) or ModelLimit() for model in by_model}
        if not limits:
            return
        polled = self.store.poll({model: capacity(limit) for model, limit in limits.items()}, counted)
        for model, result in polled.items():
            self._wake(model, result.mine)
            for waiter_id in result.lost:
                with self._lock:
                    lost = self._waiters.get(waiter_id)
                if lost is not None:  # dropped while this process looked silent: queued again
                    answer = self.store.acquire(model, capacity(limits[model]), lost.ask)
                    if answer.granted:
                        self._granted(model, waiter_id)
                    self._wake(model, [other for other in answer.mine if other != waiter_id])


@dataclass
class AdmissionGuard:
    """The `CallGuard` of one fork's run: admission before each model call of a limited model."""

    admission: Admission
    fork_id: str
    session: str
    epoch: int
    owner: str
    stop_if_asked: Callable[[], None]  # raises `Stopped` when the fork must stop (cancel, lost lease, shutdown)
    rides: Rides | None = None  # the fork's writes: a call's release goes with the next (None: the coordinator's)
    _hold: tuple[str, str] | None = None  # (model, waiter id) of the call in flight

    def enter(self, request: ModelRequest) -> float:
        """Wait for admission of `request`'s model (nothing for a model without limits); the seconds waited."""
        model = request.model
        admission = self.admission
        if model is None or admission.limit_of(model) is None:
            return 0.0
        label = admission.metrics.model_label(model)
        ask = Ask(
            waiter=admission.waiter_id(self.fork_id),
            session=self.session,
            estimate=estimate(request),
            endpoint=admission.endpoint_of(model),
            weight=admission.weight(self.session),
        )
        started = time.monotonic()
        waiter, wait = self._ask(model, ask)
        asked = time.monotonic() - started
        waited = asked if waiter is None and asked >= STOP_CHECK_S else 0.0  # an outage ridden out is a wait too
        if waiter is not None and wait is not None:
            waited = self._wait(waiter, wait, request.step + 1, label)
        admission.held(model, ask.waiter)
        self._hold = (model, ask.waiter)
        admission.metrics.model_wait_seconds.labels(model=label).observe(waited)
        return waited

    def _ask(self, model: str, ask: Ask) -> tuple[Waiter | None, ModelWait | None]:
        """`Admission.acquire`, asked again while Redis does not answer (the lease rides such an outage out too),
        until the fork must stop."""
        while True:
            try:
                return self.admission.acquire(model, ask)
            except redis.RedisError as exc:
                log.warning("fork %s: admission to %s not reached (%s); asking again", self.fork_id, model, exc)
                self.stop_if_asked()
                time.sleep(STOP_CHECK_S)  # Redis is unreachable: ask again shortly, as the lease's writes do

    def _wait(self, waiter: Waiter, wait: ModelWait, step: int, label: str) -> float:
        """Block until the grant (or a stop); the seconds waited. The fork shows its wait meanwhile."""
        admission = self.admission
        started = time.monotonic()
        gauge = admission.metrics.model_waiting.labels(model=label)
        gauge.inc()
        try:
            admission.show(wait_shown(self.fork_id, self.epoch, self.owner, wait, step))
            while not waiter.granted.wait(STOP_CHECK_S):
                self.stop_if_asked()
        except BaseException:
            admission.release(waiter.model, waiter.ask.waiter, TokenUsage())  # queued or granted: either goes
            raise
        finally:
            gauge.dec()
        waited = time.monotonic() - started
        admission.show(wait_over(self.fork_id, self.epoch, self.owner, int(waited * 1000)))
        return waited

    def leave(self, request: ModelRequest, usage: TokenUsage | None) -> None:
        """The call ended: free its slot and settle its tokens, with the fork's next write when it answered (the
        journal append just after), else at once."""
        hold, self._hold = self._hold, None
        if hold is None:
            return
        if usage is None or self.rides is None:
            self.admission.release(hold[0], hold[1], usage)
        else:
            self.rides.ride(self.admission.release_rider(hold[0], hold[1], usage))


@dataclass
class SharedCooldown:
    """The providers' `Pacer`: attempts of a limited model wait out the cooldown every worker shares.

    A first attempt reads no Redis (the guard's admission just checked the cooldown, this process's own
    reports are known here); a retry reads it (one round trip, on a retry only).
    """

    admission: Admission
    _until: dict[tuple[str, str], float] = field(default_factory=dict)  # (endpoint, model) → monotonic end

    def wait(self, endpoint: str, model: str, attempt: int) -> None:
        """Sleep until the cooldown of `endpoint` and `model` is over."""
        if self.admission.limit_of(model) is None:
            return
        if attempt > 1:
            try:
                until_ms, now_ms = self.admission.store.cooldown(model, endpoint)
            except redis.RedisError as exc:  # the retry's own backoff still applies
                log.warning("admission: the cooldown of %s at %s was not read (%s)", model, endpoint, exc)
            else:
                if until_ms:
                    self._until[(endpoint, model)] = time.monotonic() + (until_ms - now_ms) / 1000
        left = self._until.get((endpoint, model), 0.0) - time.monotonic()
        if left > 0:
            time.sleep(left)  # a wait the endpoint asked every caller for

    def throttled(self, endpoint: str, model: str, retry_after_s: float) -> None:
        """Start the cooldown for every worker's calls to `endpoint` and `model`."""
        if self.admission.limit_of(model) is None:
            return
        self.admission.metrics.model_cooldowns.labels(model=self.admission.metrics.model_label(model)).inc()
        try:
            until_ms, now_ms = self.admission.store.cooldown(model, endpoint, int(retry_after_s * 1000))
        except redis.RedisError as exc:
            log.warning("admission: the cooldown of %s at %s was not shared (%s)", model, endpoint, exc)
            until_ms, now_ms = int(retry_after_s * 1000), 0
        self._until[(endpoint, model)] = time.monotonic() + (until_ms - now_ms) / 1000
        log.info("model %s at %s: cooling down for %.2f s, cluster-wide", model, endpoint, retry_after_s)

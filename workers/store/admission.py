"""Model admission in Redis: concurrency slots, rate windows, shared cooldowns and fair queuing, cluster-wide.

Each worker process asks here before a model call of a limited model (`workers.service.admission` is its side).
A call is a *waiter* named `<presence token>|<fork id>|<n>`; granted, the same id is its *hold*. One round trip
asks (`acquire`): with nothing queued and capacity free the call goes out at once. Otherwise it is queued in fair
order across parent sessions, and the process learns of its grant from its next look (`poll`, one script per
model per tick for all its waiters) or from its own release of another call (`release` hands the freed capacity
on in the same script). The scripts and the fair-queuing rule are in `workers.store.admission_scripts`; the keys
in `workers.base.keys`.

A hold expires `hold_ttl_ms` after its last renewal (`renew`, once per heartbeat for all of a process's holds),
so a silent worker's slots come back when its forks' leases run out; the sweeper frees a dead worker's holds as
soon as it sees its connection gone (`release_owner`), as it revives its forks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import redis
from redis.commands.core import Script

from workers.base.keys import Keys
from workers.records.events import ModelWaitData
from workers.records.parked import AdmissionLimit, ModelWait
from workers.store.admission_scripts import ACQUIRE, COOLDOWN, MODEL_WAIT, POLL, RELEASE, RELEASE_OWNER, RENEW
from workers.store.pipelined import ScriptCall, run_scripts
from workers.store.replies import Admitted, word_of

KEEP_ESTIMATE: Final = -1  # `release` without a reported usage: the call's estimate stands


@dataclass(frozen=True)
class Capacity:
    """A model's limits as the scripts take them (0: none)."""

    concurrency: int = 0
    rpm: int = 0
    tpm: int = 0


@dataclass(frozen=True)
class Ask:
    """One model call asking to go out."""

    waiter: str  # `<presence token>|<fork id>|<n>`
    session: str  # the fork's parent session: the unit of fair share
    estimate: int  # tokens reserved against tpm until the call's usage settles them
    endpoint: str  # the provider's base URL (the cooldown's scope with the model)
    weight: float = 1.0  # the session's share (FORKQ_SESSION_WEIGHTS)


@dataclass(frozen=True)
class Release:
    """A call's release, as `release_many` sends it: its model, its limits, its hold, its tokens (`KEEP_ESTIMATE`)."""

    model: str
    capacity: Capacity
    waiter: str
    tokens: int


@dataclass(frozen=True)
class Answer:
    """What `acquire` said: granted or queued, Redis's time, what holds the queue, the process's grants."""

    granted: bool
    now_ms: int
    limit: AdmissionLimit | None
    mine: list[str]


@dataclass(frozen=True)
class Polled:
    """One model's look: the process's grants, census ids lost (to ask again), what holds the queue."""

    mine: list[str]
    lost: list[str]
    limit: AdmissionLimit | None


def _texts(raw: Sequence[Any]) -> list[str]:
    return [item.decode() if isinstance(item, bytes) else str(item) for item in raw]


def granted_of(reply: Any) -> list[str]:
    """The waiters of this process a `release` granted (its reply)."""
    return _texts(cast(list[Any], reply))


def _limit(raw: bytes | str) -> AdmissionLimit | None:
    word = raw.decode() if isinstance(raw, bytes) else raw
    return word_of(AdmissionLimit, word, script="admission", fork_id="-") if word else None


class AdmissionStore:
    """The admission scripts over one Redis client, for one process (`token`: its presence token)."""

    def __init__(self, client: redis.Redis, keys: Keys, *, token: str, hold_ttl_ms: int, alive_ttl_ms: int) -> None:
        self.client = client
        self.keys = keys
        self.token = token
        self.hold_ttl_ms = hold_ttl_ms
        self.alive_ttl_ms = alive_ttl_ms
        self._acquire = client.register_script(ACQUIRE)
        self._poll = client.register_script(POLL)
        self._release = client.register_script(RELEASE)
        self._renew = client.register_script(RENEW)
        self._release_owner = client.register_script(RELEASE_OWNER)
        self._cooldown = client.register_script(COOLDOWN)
        self._model_wait = client.register_script(MODEL_WAIT)

    def _keys(self, model: str) -> list[str]:
        return [*self.keys.admission(model), self.keys.admission_alive, self.keys.admission_models]

    def _header(self, model: str, capacity: Capacity) -> list[Any]:
        limits = (capacity.concurrency, capacity.rpm, capacity.tpm)
        return [model, *limits, self.hold_ttl_ms, self.alive_ttl_ms, self.token]

    def _scripts(self, calls: Sequence[tuple[Script, list[str], list[Any]]]) -> list[Any]:
        """Run (script, keys, args) calls in one round trip (`workers.store.pipelined.run_scripts`)."""
        return run_scripts(self.client, [ScriptCall(*call) for call in calls])

    def _release_call(self, one: Release) -> tuple[Script, list[str], list[Any]]:
        return self._release, self._keys(one.model), [*self._header(one.model, one.capacity), one.waiter, one.tokens]

    def release_call(self, one: Release) -> ScriptCall:
        """`release` as a script call, to ride on a fork's write; `granted_of` gives its reply's meaning."""
        return ScriptCall(*self._release_call(one))

    def acquire(self, model: str, capacity: Capacity, ask: Ask) -> Answer:
        """Admit the call now, or queue it fairly (one round trip)."""
        return self.release_and_acquire((), model, capacity, ask)[0]

    def release_and_acquire(
        self, releases: Sequence[Release], model: str, capacity: Capacity, ask: Ask
    ) -> tuple[Answer, list[tuple[str, list[str]]]]:
        """`release_many(releases)`, then `acquire`: one round trip for all; the answer, and the releases' grants."""
        args = [*self._header(model, capacity), ask.waiter, ask.session, max(0, ask.estimate), ask.endpoint]
        calls = [self._release_call(one) for one in releases]
        calls.append((self._acquire, self._keys(model), [*args, repr(float(ask.weight))]))
        *released, (word, now, limit, mine) = self._scripts(calls)
        granted = word_of(Admitted, word, script="admission acquire", fork_id="-") is Admitted.GRANTED
        freed = [(one.model, _texts(grants)) for one, grants in zip(releases, released, strict=True)]
        return Answer(granted, int(now), _limit(limit), _texts(mine)), freed

    def poll(self, capacities: Mapping[str, Capacity], census: Mapping[str, Sequence[str]]) -> dict[str, Polled]:
        """One look at every model with waiters (one round trip): grants, and `census` ids no longer queued."""
        models = list(capacities)
        calls = [
            (self._poll, self._keys(model), [*self._header(model, capacities[model]), *census.get(model, ())])
            for model in models
        ]
        replies = self._scripts(calls)
        return {
            model: Polled(_texts(mine), _texts(lost), _limit(limit))
            for model, (mine, lost, limit) in zip(models, replies, strict=True)
        }

    def release(self, model: str, capacity: Capacity, waiter: str, tokens: int = KEEP_ESTIMATE) -> list[str]:
        """The call ended, or its fork stopped waiting: free its hold, settle its tokens; the process's grants."""
        script, keys, args = self._release_call(Release(model, capacity, waiter, tokens))
        return _texts(script(keys=keys, args=args))

    def release_many(self, releases: Sequence[Release]) -> list[tuple[str, list[str]]]:
        """Several `release`s in one round trip: each one's model and the process's grants it made."""
        replies = self._scripts([self._release_call(one) for one in releases])
        return [(one.model, _texts(mine)) for one, mine in zip(releases, replies, strict=True)]

    def renew(self, holds: Mapping[str, Sequence[str]]) -> None:
        """Move every hold of this process `hold_ttl_ms` ahead (one round trip; expired ones stay gone)."""
        models = [model for model, ids in holds.items() if ids]
        if not models:
            return
        args: list[Any] = [self.hold_ttl_ms]
        for model in models:
            args += [len(holds[model]), *holds[model]]
        self._renew(keys=[self.keys.admission(model)[0] for model in models], args=args)

    def release_owner(self, token: str) -> int:
        """Free every hold and queued call of a dead process, and forget the models with nothing in flight or queued
        (two round trips); how many holds were freed."""
        keys: list[str] = []
        models = sorted(_texts(list(self.client.smembers(self.keys.admission_models))))
        for model in models:
            holds, queue, waiters, *_, granted = self.keys.admission(model)
            keys += [holds, queue, waiters, granted]
        keys += [self.keys.admission_alive, self.keys.admission_models]
        return int(self._release_owner(keys=keys, args=[token, *models]))

    def cooldown(self, model: str, endpoint: str, for_ms: int = 0) -> tuple[int, int]:
        """Start (or lengthen) the cooldown of `endpoint` for `model` by `for_ms`; (its end or 0, Redis's now)."""
        cooldown_key = self.keys.admission(model)[6]
        until, now = self._cooldown(keys=[cooldown_key], args=[endpoint, max(0, int(for_ms))])
        return int(until), int(now)

    def holds(self, model: str) -> list[str]:
        """The holds of `model` now (the calls in flight; for inspection and tests)."""
        return _texts(self.client.zrange(self.keys.admission(model)[0], 0, -1))

    def queued(self, model: str) -> list[str]:
        """The queued calls of `model`, in grant order."""
        return _texts(self.client.zrange(self.keys.admission(model)[1], 0, -1))

    def write_waits(self, writes: Sequence[WaitWrite]) -> None:
        """Write forks' waits to their states and streams, in order (one round trip for all)."""
        calls = [
            (
                self._model_wait,
                [self.keys.state(write.fork_id), self.keys.events(write.fork_id)],
                [write.epoch, write.owner, write.wait, write.event, write.waited_ms],
            )
            for write in writes
        ]
        self._scripts(calls)


@dataclass(frozen=True)
class WaitWrite:
    """A write of a fork's admission wait to its state (`MODEL_WAIT`): shown, or over."""

    fork_id: str
    epoch: int
    owner: str
    wait: str  # the state's `model_wait` ('' clears it)
    event: str  # the `model_wait` event's data ('' for none)
    waited_ms: int  # moves the fork's first start on


def wait_shown(fork_id: str, epoch: int, owner: str, wait: ModelWait, step: int) -> WaitWrite:
    """The write that shows `wait` in the fork's state and stream."""
    event = ModelWaitData(step=step, model=wait.model, limit=wait.limit).to_json()
    return WaitWrite(fork_id, epoch, owner, wait.stored(), event, 0)


def wait_over(fork_id: str, epoch: int, owner: str, waited_ms: int) -> WaitWrite:
    """The write that ends the fork's wait and moves its wall clock on by `waited_ms`."""
    return WaitWrite(fork_id, epoch, owner, "", "", max(0, waited_ms))

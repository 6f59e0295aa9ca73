"""Nested subagents: an Agent call of a regular subagent launches another one and waits for it.

The nested fork's id is fixed by the calling fork and the call's position, and its bootstrap record
is built from the caller's, so a revived caller re-launching it finds the same record (write-once)
and simply waits for the same subagent: the call is idempotent.

A caller waits through a Redis outage as its fenced writes do: every read and write of the launch and
the wait (and the job's publish) is retried until Redis (or the broker) answers, or until the caller's
own lease has lapsed past the sweeper's grace (`under(until)`, the claim's `LeaseClock.deadline`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from kombu.exceptions import OperationalError

from workers.errors import ForkqError, InvalidAgentParams
from workers.history.params import validate_agent_params
from workers.loop.child import Stopped
from workers.loop.policy import effective_mode
from workers.records.fork import BootstrapRecord, ForkOptions, ForkResult, Status
from workers.store.forks import ForkStore
from workers.store.lease import TRANSIENT, ride_out

T = TypeVar("T")

# the XREAD BLOCK of the wait: below the worker's Redis socket timeout (at least 2 s: runner.redis_timeout_s)
POLL_MS: Final = 500
# a publish that cannot reach the broker: kombu's error after Celery's own publish retries
PUBLISH_TRANSIENT: Final = (*TRANSIENT, OperationalError)
Enqueue = Callable[[str, str, int], None]  # fork id, digest, attempt


def nested_record(parent: BootstrapRecord, args: Mapping[str, Any], child_id: str) -> BootstrapRecord:
    """The bootstrap record of the regular subagent an Agent call of `parent` asks for (no history).

    Raises:
        InvalidAgentParams: the call's parameters break the Agent tool's contract.
    """
    agent = validate_agent_params(args)
    if agent.is_fork:  # the gate refuses this before; kept here so no caller can nest a fork
        raise InvalidAgentParams('a subagent cannot fork (subagent_type "fork")', field="subagent_type")
    return BootstrapRecord(
        fork_id=child_id,
        parent_session=parent.parent_session,  # the same context chunk: stored once for the whole tree
        kind="spawn",
        seed_chunks=[],
        message_count=0,
        task_prompt=agent.prompt,
        directive=agent.prompt,
        description=agent.description,
        subagent_type=agent.subagent_type,
        name=agent.name,
        system_instruction=parent.system_instruction,
        tools_json=parent.tools_json,
        model=agent.model or parent.model,
        generation=parent.generation,
        approval_mode=effective_mode(parent.approval_mode),
        cwd=parent.cwd,
        depth=parent.depth + 1,
        # no approval_policy: a nested subagent never parks, since its caller holds a worker slot waiting for it
        options=ForkOptions(max_wall_s=parent.options.max_wall_s),
    )


@dataclass
class SubagentSpawner:
    """Launches nested subagents through the fork store and the broker, and waits for their results."""

    store: ForkStore
    enqueue: Enqueue
    stopping: threading.Event
    # the caller's claim's `LeaseClock.deadline`: Redis and broker calls are retried until then
    until: Callable[[], float] = lambda: float("-inf")  # unbound (see `under`): a failed call raises LeaseLost

    def under(self, until: Callable[[], float]) -> SubagentSpawner:
        """This spawner for one claim: its calls ride out an outage until `until()` (monotonic)."""
        return dataclasses.replace(self, until=until)

    def _ride(
        self, call: Callable[[], T], what: str, fork_id: str, transient: tuple[type[Exception], ...] = TRANSIENT
    ) -> T:
        return ride_out(call, until=self.until, what=what, fork_id=fork_id, transient=transient)

    def spawn(
        self,
        record: BootstrapRecord,
        args: Mapping[str, Any],
        child_id: str,
        *,
        cancelled: Callable[[], bool],
        deadline: float,
    ) -> dict[str, Any]:
        """The nested subagent's output (`{"output": ...}`) or why it failed (`{"error": ...}`).

        Raises:
            Stopped: the worker shuts down, or the caller lost its lease (it is revived elsewhere and
                waits for the same subagent again).
            LeaseLost: (`unreachable`) Redis or the broker did not answer until the caller's lease lapsed.
        """
        try:
            child = nested_record(record, args, child_id)
        except InvalidAgentParams as exc:
            return {"error": f"Error: {exc}"}
        data, digest = child.encode()
        caller = record.fork_id
        try:
            self._ride(lambda: self.store.put_launch(child, data, digest), "launching its subagent", caller)
        except ForkqError as exc:
            return {"error": f"Error: the subagent could not be launched: {exc}"}
        # not yet run; a duplicate job would be a no-op anyway
        if self._ride(lambda: self.store.state(child_id), "reading its subagent's state", caller).attempt == 0:
            enqueue = lambda: self.enqueue(child_id, digest, 1)  # noqa: E731
            self._ride(enqueue, "enqueueing its subagent", caller, PUBLISH_TRANSIENT)
        return self._wait(caller, child_id, cancelled, deadline)

    def _wait(self, caller: str, child_id: str, cancelled: Callable[[], bool], deadline: float) -> dict[str, Any]:
        after = "0-0"
        while True:
            result = self._ride(lambda: self.store.result(child_id), "reading its subagent's result", caller)
            if result is not None:
                return _outcome(result)
            if cancelled():
                state = self._ride(lambda: self.store.state(caller), "reading its own state", caller)
                if state.status is not Status.CANCELLED:
                    raise Stopped("lease_lost")  # revived elsewhere: the new run waits for the same subagent
                self._ride(lambda: self.store.cancel(child_id), "cancelling its subagent", caller)
            if time.monotonic() >= deadline:  # the caller's wall clock ran out: its subagent's work is moot
                self._ride(lambda: self.store.cancel(child_id), "cancelling its subagent", caller)
                return {"error": "Error: the caller's wall-clock limit was reached while the subagent ran"}
            if self.stopping.is_set():
                raise Stopped("shutdown")
            poll = functools.partial(self.store.events, child_id, after=after, block_ms=POLL_MS)
            for event in self._ride(poll, "waiting for its subagent", caller):
                after = event.id
            time.sleep(0)  # let the heartbeat thread run between polls


def _outcome(result: ForkResult) -> dict[str, Any]:
    if result.status is Status.SUCCEEDED:
        return {"output": result.output or ""}
    return {"error": f"Error: the subagent {result.status.value}: {result.error or 'no reason given'}"}

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

from workers.base.keys import session_named
from workers.errors import ForkqError, InvalidAgentParams, RecordExistsError, SessionCancelled
from workers.history.params import validate_agent_params
from workers.loop.child import Stopped, StopReason, Workspace
from workers.loop.policy import effective_mode
from workers.records.conversation import fold
from workers.records.fork import BootstrapRecord, ForkOptions, ForkResult, Status
from workers.store.forks import ForkStore
from workers.store.lease import TRANSIENT, ride_out
from workers.subagents.definitions import Catalog, built_in_catalog
from workers.subagents.scope import ParentContext, resolve_scope
from workers.workspace.ref import WorkspaceRef

T = TypeVar("T")

# the XREAD BLOCK of the wait: below the worker's Redis socket timeout (at least 2 s: runner.redis_timeout_s)
POLL_MS: Final = 500
# a publish that cannot reach the broker: kombu's error after Celery's own publish retries
PUBLISH_TRANSIENT: Final = (*TRANSIENT, OperationalError)
Enqueue = Callable[[str, str, int], None]  # fork id, digest, attempt


def nested_record(
    parent: BootstrapRecord,
    args: Mapping[str, Any],
    child_id: str,
    catalog: Catalog | None = None,
    workspace: WorkspaceRef | None = None,
) -> BootstrapRecord:
    """The bootstrap record of the regular subagent an Agent call of `parent` asks for (no history).

    Its definition (`subagent_type`, from `catalog`) is resolved against the caller's own declarations,
    so a nested subagent never gets a tool its caller lacks; the caller's `max_depth` carries over. It works
    in the caller's workspace: `workspace` (the caller's files as they are now), else the caller's own.

    Raises:
        InvalidAgentParams: the call's parameters break the Agent tool's contract, or name an unknown type.
    """
    agent = validate_agent_params(args)
    if agent.is_fork:  # the gate refuses this before; kept here so no caller can nest a fork
        raise InvalidAgentParams('a subagent cannot fork (subagent_type "fork")', field="subagent_type")
    catalog = catalog or built_in_catalog()
    definition = catalog.find(agent.subagent_type)
    if definition is None:
        known = ", ".join(f'"{name}"' for name in catalog.names())
        raise InvalidAgentParams(
            f"Unknown subagent_type {agent.subagent_type!r}: the known types are {known}.", field="subagent_type"
        )
    context = ParentContext(parent.system_instruction, parent.tools, parent.tools_json, parent.model)
    scope = resolve_scope(definition, context, model=agent.model)
    return BootstrapRecord(
        fork_id=child_id,
        parent_session=parent.parent_session,  # the same context chunk when the scope is the caller's
        kind="spawn",
        seed_chunks=[],
        message_count=0,
        task_prompt=agent.prompt,
        directive=agent.prompt,
        description=agent.description,
        subagent_type=agent.subagent_type,
        name=agent.name,
        system_instruction=scope.system_instruction,
        tools_json=scope.tools_json,
        model=scope.model,
        generation=parent.generation,
        approval_mode=effective_mode(parent.approval_mode),
        cwd=parent.cwd,
        workspace=workspace or parent.workspace,
        tenant=parent.tenant,  # a nested subagent belongs to its caller's tenant
        depth=parent.depth + 1,
        # no approval_policy: a nested subagent never parks, since its caller holds a worker slot waiting for it
        options=ForkOptions(
            max_wall_s=parent.options.max_wall_s,
            max_turns=definition.max_turns,
            max_depth=parent.options.max_depth,  # never raised by a nested child
            agent=definition.name,
            agent_source=definition.source,
        ),
    )


@dataclass
class SubagentSpawner:
    """Launches nested subagents through the fork store and the broker, and waits for their results."""

    store: ForkStore
    enqueue: Enqueue
    stopping: threading.Event
    # the caller's claim's `LeaseClock.deadline`: Redis and broker calls are retried until then
    until: Callable[[], float] = lambda: float("-inf")  # unbound (see `under`): a failed call raises LeaseLost
    catalog: Callable[[], Catalog] = built_in_catalog  # the worker's definitions (FORKQ_AGENTS_DIR)

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
        workspace: Workspace | None = None,
    ) -> dict[str, Any]:
        """The nested subagent's output (`{"output": ...}`) or why it failed (`{"error": ...}`).

        A snapshot caller's subagent starts from the caller's files as they are now, and what it changed is
        written back into the caller's tree when it ends (succeeded or not), to be journaled with the call.

        Raises:
            Stopped: the worker shuts down, or the caller lost its lease (it is revived elsewhere and
                waits for the same subagent again).
            LeaseLost: (`unreachable`) Redis or the broker did not answer until the caller's lease lapsed.
        """
        try:
            shared = None if workspace is None else workspace.share()
            child = nested_record(record, args, child_id, self.catalog(), shared)
        except ForkqError as exc:  # an invalid call, or a malformed definitions folder
            return {"error": f"Error: {exc}"}
        data, digest = child.encode()
        caller = record.fork_id
        try:
            self._ride(lambda: self.store.put_launch(child, data, digest), "launching its subagent", caller)
        except RecordExistsError:
            pass  # launched by an earlier run of this caller (a definition edited since): wait for that one
        except SessionCancelled:  # the caller's own session is being cancelled: so is the caller, at its next write
            session = session_named(record.parent_session)
            return {"error": f"Error: the subagent was not launched: session {session} was cancelled."}
        except ForkqError as exc:
            return {"error": f"Error: the subagent could not be launched: {exc}"}
        # not yet run; a duplicate job would be a no-op anyway
        if self._ride(lambda: self.store.state(child_id), "reading its subagent's state", caller).attempt == 0:
            enqueue = lambda: self.enqueue(child_id, digest, 1)  # noqa: E731
            self._ride(enqueue, "enqueueing its subagent", caller, PUBLISH_TRANSIENT)
        outcome = self._wait(caller, child_id, cancelled, deadline)
        if workspace is not None:
            journal = self._ride(lambda: self.store.journal(child_id), "reading its subagent's journal", caller)
            workspace.merge(fold(journal, fork_id=child_id).changes)
        return outcome

    def _wait(self, caller: str, child_id: str, cancelled: Callable[[], bool], deadline: float) -> dict[str, Any]:
        after = "0-0"
        while True:
            result = self._ride(lambda: self.store.result(child_id), "reading its subagent's result", caller)
            if result is not None:
                return _outcome(result)
            if cancelled():
                state = self._ride(lambda: self.store.state(caller), "reading its own state", caller)
                if state.status is not Status.CANCELLED:
                    raise Stopped(StopReason.LEASE_LOST)  # revived elsewhere: the new run waits for the same subagent
                self._ride(lambda: self.store.cancel(child_id), "cancelling its subagent", caller)
            if time.monotonic() >= deadline:  # the caller's wall clock ran out: its subagent's work is moot
                self._ride(lambda: self.store.cancel(child_id), "cancelling its subagent", caller)
                return {"error": "Error: the caller's wall-clock limit was reached while the subagent ran"}
            if self.stopping.is_set():
                raise Stopped(StopReason.SHUTDOWN)
            poll = functools.partial(self.store.events, child_id, after=after, block_ms=POLL_MS)
            for event in self._ride(poll, "waiting for its subagent", caller):
                after = event.id
            time.sleep(0)  # let the heartbeat thread run between polls


def _outcome(result: ForkResult) -> dict[str, Any]:
    if result.status is Status.SUCCEEDED:
        return {"output": result.output or ""}
    return {"error": f"Error: the subagent {result.status.value}: {result.error or 'no reason given'}"}

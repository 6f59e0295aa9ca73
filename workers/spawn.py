"""Nested subagents: an Agent call of a regular subagent launches another one and waits for it.

The nested fork's id is fixed by the calling fork and the call's position, and its bootstrap record
is built from the caller's, so a revived caller re-launching it finds the same record (write-once)
and simply waits for the same subagent: the call is idempotent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from workers.child import Stopped
from workers.errors import ForkqError, InvalidAgentParams
from workers.params import validate_agent_params
from workers.policy import effective_mode
from workers.records import BootstrapRecord, ForkResult, Status
from workers.store import ForkStore

POLL_MS: Final = 500
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
        options={k: v for k, v in parent.options.items() if k == "max_wall_s"},
    )


@dataclass
class SubagentSpawner:
    """Launches nested subagents through the fork store and the broker, and waits for their results."""

    store: ForkStore
    enqueue: Enqueue
    stopping: threading.Event

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
        """
        try:
            child = nested_record(record, args, child_id)
        except InvalidAgentParams as exc:
            return {"error": f"Error: {exc}"}
        data, digest = child.encode()
        try:
            self.store.put_launch(child, data, digest)
        except ForkqError as exc:
            return {"error": f"Error: the subagent could not be launched: {exc}"}
        if self.store.state(child_id).attempt == 0:  # not yet run; a duplicate job would be a no-op anyway
            self.enqueue(child_id, digest, 1)
        return self._wait(record.fork_id, child_id, cancelled, deadline)

    def _wait(self, caller: str, child_id: str, cancelled: Callable[[], bool], deadline: float) -> dict[str, Any]:
        after = "0-0"
        while True:
            result = self.store.result(child_id)
            if result is not None:
                return _outcome(result)
            if cancelled():
                if self.store.state(caller).status is not Status.CANCELLED:
                    raise Stopped("lease_lost")  # revived elsewhere: the new run waits for the same subagent
                self.store.cancel(child_id)  # the caller was cancelled: so is what it launched
            if time.monotonic() >= deadline:  # the caller's wall clock ran out: its subagent's work is moot
                self.store.cancel(child_id)
                return {"error": "Error: the caller's wall-clock limit was reached while the subagent ran"}
            if self.stopping.is_set():
                raise Stopped("shutdown")
            for event in self.store.events(child_id, after=after, block_ms=POLL_MS):
                after = event.id
            time.sleep(0)  # let the heartbeat thread run between polls


def _outcome(result: ForkResult) -> dict[str, Any]:
    if result.status is Status.SUCCEEDED:
        return {"output": result.output or ""}
    return {"error": f"Error: the subagent {result.status.value}: {result.error or 'no reason given'}"}

"""Sending fork jobs and final task events through a Celery app, by task name: the launcher's and the worker's one way.

The app is a parameter (a send-only one in a parent, the worker's own in a worker), so nothing here
loads Celery: `send_task` needs no registered task. `enqueue_again` is the one "send the job, then
confirm it enqueued" step that every re-send goes through (a resume, a decision, a revival, a release).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from broker_config.celery import RUN_FORK_TASK
from workers.store.forks import ForkStore
from workers.store.lease import Leases

if TYPE_CHECKING:  # a type only: the app is built by whoever sends
    from celery import Celery

log = logging.getLogger("forkq.queue")

ARGSREPR_TEXT_MAX: Final = 80  # characters of a description or session id a job's argsrepr shows


def job_argsrepr(
    fork_id: str,
    digest: str,
    seed_chunks: list[bytes] | None,
    *,
    description: str | None = None,
    parent_session: str | None = None,
) -> str:
    """What Flower shows for a job: the fork id, its description and parent session when the sender knows
    them, the digest prefix and the seed size, never the bytes."""
    if seed_chunks is None:
        seed = "seed in Redis"
    else:
        seed = f"seed inline: {len(seed_chunks)} chunks, {sum(map(len, seed_chunks)):,} bytes"
    named = "".join(
        f"{label}={text[:ARGSREPR_TEXT_MAX]!r}, "
        for label, text in (("description", description), ("parent", parent_session))
        if text
    )
    return f"({fork_id!r}, {named}digest={digest[:12]}…, {seed})"


def enqueue_fork(
    app: Celery,
    queue: str,
    fork_id: str,
    digest: str,
    *,
    attempt: int,
    seed_chunks: list[bytes] | None = None,
    record: bytes | None = None,
    description: str | None = None,
    parent_session: str | None = None,
) -> None:
    """Send a `run_fork` job (task id `<fork id>.<attempt>`, so Flower lists every run of a fork).

    With `record` (the stored record bytes) the worker prepares the first model call before its claim,
    which then also makes the checkpoint before that call (`workers.store.lease.Leases.claim`).
    `description` and `parent_session` only name the job in Flower (`argsrepr`); the job is the same.
    """
    call = run_fork_call(
        fork_id,
        digest,
        attempt=attempt,
        seed_chunks=seed_chunks,
        record=record,
        description=description,
        parent_session=parent_session,
    )
    send_call(app, queue, call)


def send_call(app: Celery, queue: str, call: tuple[str, list[Any], str]) -> None:
    """Send one `run_fork` job made by `run_fork_call` through the app's producer."""
    task_id, args, argsrepr = call
    app.send_task(RUN_FORK_TASK, args=args, queue=queue, task_id=task_id, argsrepr=argsrepr, kwargsrepr="{}")


def run_fork_call(
    fork_id: str,
    digest: str,
    *,
    attempt: int,
    seed_chunks: list[bytes] | None = None,
    record: bytes | None = None,
    description: str | None = None,
    parent_session: str | None = None,
) -> tuple[str, list[Any], str]:
    """A `run_fork` job's task id, arguments and Flower `argsrepr` (`enqueue_fork` says what each carries)."""
    args: list[Any] = [fork_id, digest, seed_chunks] if record is None else [fork_id, digest, seed_chunks, record]
    argsrepr = job_argsrepr(fork_id, digest, seed_chunks, description=description, parent_session=parent_session)
    return f"{fork_id}.{attempt}", args, argsrepr


def enqueue_again(
    app: Celery, fork_id: str, digest: str, attempt: int, *, queue: str, store: ForkStore, leases: Leases
) -> None:
    """Send the job of a fork put back in the queue state, then confirm it enqueued (it leaves the running index).

    In this order: a fork confirmed before its job is in the broker could be left queued without one; a
    job sent but not confirmed is sent again by a sweeper after its grace, and a duplicate job is a no-op.
    Its Flower row names its description too (one HGETALL of the fork's state; the parent session is in
    its record only, so re-sent rows leave it out). Confirming a fork that is not in the running index
    (a first job, a handed-back delivery) changes nothing.
    """
    description = store.state(fork_id).description
    enqueue_fork(app, queue, fork_id, digest, attempt=attempt, description=description)
    leases.enqueued(fork_id)


def send_ended_event(app: Celery, event: str, task_id: str, *, sender: str, **fields: Any) -> None:
    """A final task event for a run that no worker will end: sent by a sweeper or a client, not a worker.

    A run whose fork failed `worker_lost` (its attempts used up) or was cancelled while parked gets no next
    run to end it (`end_previous_run`). Flower lists `sender@<host>` as the worker of this one event.
    Best-effort (`retry=False`): a broker hiccup loses one event, never a sweep or a cancel.
    """
    send_ended_events(app, event, [task_id], sender=sender, **fields)


def send_ended_events(app: Celery, event: str, task_ids: Sequence[str], *, sender: str, **fields: Any) -> None:
    """`send_ended_event` for many runs at once (a session's parked forks cancelled together), on one connection."""
    if not app.conf.worker_send_task_events or not task_ids:
        return
    try:
        with app.events.default_dispatcher(hostname=f"{sender}@{socket.gethostname()}") as dispatcher:
            for task_id in task_ids:
                dispatcher.send(event, uuid=task_id, retry=False, **fields)
    except Exception as exc:
        log.warning("tasks %s: %s not sent (%s: %s)", ", ".join(task_ids[:3]), event, type(exc).__name__, exc)

"""The Celery tasks: decode the job, call a plain function, map failures. Nothing else lives here."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Final

from celery import Celery, Task
from celery.exceptions import InvalidTaskError
from celery.worker.request import Request
from pydantic import ValidationError

from broker_config.celery import RUN_FORK_TASK, SWEEP_TASK
from workers.base.keys import Keys
from workers.broker import queue as job_queue
from workers.broker.queue import send_ended_event
from workers.errors import ForkNotFound, RecordDecodeError, RecordIntegrityError
from workers.records.events import (
    AwaitingApprovalEvent,
    Event,
    FinishedEvent,
    PausedEvent,
    ReleasedEvent,
    RevivedEvent,
    StartedEvent,
    StreamEvent,
)
from workers.service.job import RunForkJob
from workers.service.outcome import Outcome, RunOutcome
from workers.service.progress import Progress
from workers.service.runner import WorkerRuntime, run_fork_job
from workers.service.sweeper import Sweeper
from workers.store.admission import AdmissionStore
from workers.store.lease import Claim
from workers.store.presence import PresenceWatch

log = logging.getLogger("forkq.worker")


def enqueue_again(app: Celery, runtime: WorkerRuntime, fork_id: str, digest: str, attempt: int) -> None:
    """`workers.broker.queue.enqueue_again` on the runtime's store and leases: send the job, then confirm it."""
    job_queue.enqueue_again(
        app, fork_id, digest, attempt, queue=runtime.settings.queue, store=runtime.store, leases=runtime.leases
    )


def make_sweeper(app: Celery, runtime: WorkerRuntime) -> Sweeper:
    """A sweeper over the runtime's Redis that re-enqueues through `app`."""
    settings = runtime.settings
    ttl_ms = int(settings.lease_ttl_s * 1000)
    admission = AdmissionStore(
        runtime.redis, Keys(settings.namespace), token=runtime.presence_token, hold_ttl_ms=ttl_ms, alive_ttl_ms=ttl_ms
    )
    return Sweeper(
        leases=runtime.leases,
        store=runtime.store,
        max_attempts=settings.max_attempts,
        interval_s=settings.sweep_s,
        metrics=runtime.metrics,
        enqueue=lambda fid, digest, attempt: enqueue_again(app, runtime, fid, digest, attempt),
        presence=PresenceWatch(runtime.redis, Keys(settings.namespace), grace_s=settings.presence_grace_s),
        presence_s=settings.presence_check_s,
        release_holds=admission.release_owner,
        failed=lambda fid, attempt: send_ended_event(
            app,
            "task-lost",
            f"{fid}.{attempt}",
            sender="forkq-sweeper",
            result=f"lost (its worker stopped renewing the lease); the fork failed worker_lost after {attempt} runs",
        ),
    )


class ForkqRequest(Request):
    """Celery's request, refusing a message body that is not `[args, kwargs, embed]`.

    Celery's consumer survives `InvalidTaskError` (it logs and acks the message) but not the
    `ValueError` its own request raises on a malformed body, which would stop the worker and
    leave the message to crash the next one.
    """

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        body = getattr(message, "payload", None)
        if not (
            isinstance(body, list | tuple)
            and len(body) == 3
            and isinstance(body[0], list | tuple)
            and isinstance(body[1], dict)
            and isinstance(body[2], dict | None)
        ):
            raise InvalidTaskError(f"malformed task body ({type(body).__name__}); expected [args, kwargs, embed]")
        super().__init__(message, *args, **kwargs)


class WorkerEvents:
    """The event dispatcher of the worker running this process's requests (threads and solo pools).

    Celery sends its own task events (`task-started`, `task-succeeded`) through it from the pool's
    threads: buffered, then published in batches by the worker's event loop. `Task.send_event`
    instead builds a dispatcher and publishes one message per event, which cost a one-step fork as
    much worker CPU as its journal writes. In a prefork child (another pid) there is none.
    """

    def __init__(self) -> None:
        self._seen: tuple[int, Any] = (0, None)

    def seen(self, dispatcher: Any) -> None:
        """Remember the dispatcher a request was created with."""
        self._seen = (os.getpid(), dispatcher)

    def dispatcher(self) -> Any:
        """The worker's dispatcher, if this process's requests were created here."""
        pid, dispatcher = self._seen
        return dispatcher if pid == os.getpid() else None


# the fork's events that end a run without a final event from its own worker, newest first from the claim
# of the next run: a revival (its worker was lost: LOST), a park (AWAITING_APPROVAL or PAUSED until the
# fork runs again: RESUMED); a release ended with its own RELEASED
_RUN_ENDED_BY: Final[dict[type[Event], str]] = {
    RevivedEvent: "task-lost",
    AwaitingApprovalEvent: "task-resumed",
    PausedEvent: "task-resumed",
}
_RUN_ENDS: Final[tuple[type[Event], ...]] = (*_RUN_ENDED_BY, ReleasedEvent, StartedEvent, FinishedEvent)
EVENTS_SCANNED: Final = 200  # events read back from a re-claim to the end of the run before it


def previous_run_end(events: Sequence[StreamEvent], attempt: int) -> str | None:
    """The Celery event that ends run `attempt - 1` in Flower, from the fork's events newest first
    (the claim of run `attempt` among them); None when that run ended with an event of its own."""
    seen_claim = False
    for event in events:
        if not seen_claim:
            seen_claim = isinstance(event, StartedEvent) and event.data.attempt == attempt
            continue
        if isinstance(event, _RUN_ENDS):
            return _RUN_ENDED_BY.get(type(event))
    return None


def final_event(result: object) -> str | None:
    """The Celery event that ends a `run_fork` delivery in Flower (`RunOutcome.final_event`), from the
    `result` field Celery's own `task-succeeded` would carry: the repr of the task's return value.

    None keeps Celery's `task-succeeded` (state SUCCESS): a fork that ended `succeeded`, or a value that
    is no delivery outcome. Flower shows the last event's subject as the state (AWAITING_APPROVAL,
    RELEASED, ...). A run that sent none (its worker was lost) or parked gets `task-lost` / `task-resumed`
    later (`end_previous_run`).
    """
    outcome = RunOutcome.from_wire(result) if isinstance(result, str) else None
    return None if outcome is None else outcome.final_event


def _request_class(events: WorkerEvents) -> type[ForkqRequest]:
    class Request(ForkqRequest):
        def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(message, *args, **kwargs)
            events.seen(kwargs.get("eventer"))

        def send_event(self, type: str, **fields: Any) -> None:
            # Celery's success path stays as it is (task_ready, ack); only its final event carries forkq's
            # outcome, so Flower shows RELEASED, AWAITING_APPROVAL, ... instead of SUCCESS for every delivery
            event = final_event(fields.get("result")) if type == "task-succeeded" else None
            if event == "task-failed":
                fork_id = str(self.id).rsplit(".", 1)[0]  # task ids are `<fork id>.<attempt>`
                reason = f"ForkFailed('fork {fork_id} ended failed: `forkq result {fork_id}` has the reason')"
                fields = {"exception": reason, "traceback": "", "runtime": fields.get("runtime")}
            super().send_event(event or type, **fields)

    return Request


def register_tasks(app: Celery, runtime: WorkerRuntime) -> None:
    """Register `run_fork` and `sweep` on `app`, bound to the process's runtime."""
    events = WorkerEvents()

    # shared=False: each app gets its own task (a shared task would register on every app built later)
    @app.task(
        name=RUN_FORK_TASK,
        bind=True,
        shared=False,
        ignore_result=True,
        acks_late=True,
        reject_on_worker_lost=True,
        Request=_request_class(events),
    )
    def run_fork(self: Task[Any, Any], *args: Any, **kwargs: Any) -> str:
        """Run one delivery of a fork job (a no-op when the fork is not queued); returns the outcome's text."""
        try:
            job = RunForkJob.model_validate(_job_fields(args, kwargs))
        except (ValidationError, TypeError) as exc:
            # a hostile or malformed message: refuse it, never run it, never crash the worker
            log.error("rejected malformed run_fork job %s: %s", self.request.id, exc)
            runtime.store.dead_letter(str(self.request.id), f"malformed run_fork job: {exc}")
            runtime.metrics.skipped(Outcome.REJECTED)
            return str(RunOutcome(Outcome.REJECTED, "malformed"))
        dispatcher = events.dispatcher()
        try:
            outcome = run_fork_job(
                runtime,
                job,
                progress=progress_events(self, dispatcher),
                claimed=lambda claim: end_previous_run(self, dispatcher, runtime, claim),
            )
        except (RecordIntegrityError, RecordDecodeError, ForkNotFound) as exc:
            log.error("fork %s: refused: %s", job.fork_id, exc)
            runtime.store.dead_letter(str(self.request.id), str(exc))
            runtime.metrics.skipped(Outcome.REFUSED)
            outcome = RunOutcome(Outcome.REFUSED, type(exc).__name__)
        return str(outcome)  # Celery's result and event carry text: the outcome's fixed words

    @app.task(name=SWEEP_TASK, shared=False, ignore_result=True, Request=ForkqRequest)
    def sweep() -> dict[str, int]:
        """One sweeper pass (Celery beat schedules it every FORKQ_SWEEP_S)."""
        return dict(make_sweeper(app, runtime).sweep_once())


def end_previous_run(task: Task[Any, Any], dispatcher: Any, runtime: WorkerRuntime, claim: Claim) -> None:
    """Give the fork's run before this claim its final state in Flower (LOST, RESUMED), if it has none.

    A lost worker sent no final event, so its run's row stayed PROGRESS; a parked run's row stayed
    AWAITING_APPROVAL after the fork went on. The worker that takes the fork over sends it, naming
    the run that goes on (rows are task ids `<fork id>.<attempt>`, as `enqueue_fork` sends them).
    """
    if claim.attempt <= 1 or not task.app.conf.worker_send_task_events:
        return
    events = runtime.store.latest_events(claim.fork_id, count=EVENTS_SCANNED)
    event = previous_run_end(events, claim.attempt)
    if event is None:
        return
    went_on = f"{claim.fork_id}.{claim.attempt}"
    word = "lost (its worker stopped renewing the lease)" if event == "task-lost" else "resumed"
    send_task_event(
        task, dispatcher, event, f"{claim.fork_id}.{claim.attempt - 1}", result=f"{word}; went on as {went_on}"
    )


def send_task_event(task: Task[Any, Any], dispatcher: Any, event: str, task_id: str, **fields: Any) -> None:
    """A task event for `task_id`: through the worker's buffered dispatcher when there is one, else its own
    connection (`retry=False`: a broker hiccup loses one event, never holds up a fork)."""
    if dispatcher is not None and dispatcher.enabled:
        dispatcher.send(event, uuid=task_id, **fields)
        return
    with task.app.events.default_dispatcher(hostname=task.request.hostname) as own:
        own.send(event, uuid=task_id, retry=False, **fields)


def progress_events(task: Task[Any, Any], dispatcher: Any = None) -> Progress | None:
    """Each step of the running delivery as a `task-progress` Celery event (None when task events are off).

    Flower shows a task's last event as its state: `PROGRESS` while the fork runs, with the step
    summary as its result; the delivery's return value (`succeeded`, `released`, ...) replaces it.
    With the worker's `dispatcher` (`WorkerEvents`) the event joins the worker's own buffered task events.
    """
    if not task.app.conf.worker_send_task_events:
        return None
    task_id = str(task.request.id)

    def send(fields: dict[str, Any]) -> None:
        send_task_event(task, dispatcher, "task-progress", task_id, **fields)

    return send


def _job_fields(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("fork_id", "digest", "seed_chunks", "record")
    if len(args) > len(names):
        raise TypeError(f"run_fork takes at most {len(names)} arguments, got {len(args)}")
    return {**dict(zip(names, args, strict=False)), **kwargs}

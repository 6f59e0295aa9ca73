"""The Celery tasks: decode the job, call a plain function, map failures. Nothing else lives here."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task
from celery.exceptions import InvalidTaskError
from celery.worker.request import Request
from pydantic import ValidationError

from broker_config.celery import RUN_FORK_TASK, SWEEP_TASK
from workers.errors import ForkNotFound, RecordDecodeError, RecordIntegrityError
from workers.runner import RunForkJob, WorkerRuntime, run_fork_job
from workers.sweeper import Sweeper

log = logging.getLogger("forkq.worker")


def job_argsrepr(fork_id: str, digest: str, seed_chunks: list[bytes] | None) -> str:
    """What Flower shows for a job: the fork id, digest prefix and seed size, never the bytes."""
    if seed_chunks is None:
        seed = "seed in Redis"
    else:
        seed = f"seed inline: {len(seed_chunks)} chunks, {sum(map(len, seed_chunks)):,} bytes"
    return f"({fork_id!r}, digest={digest[:12]}…, {seed})"


def enqueue_fork(
    app: Celery, queue: str, fork_id: str, digest: str, *, attempt: int, seed_chunks: list[bytes] | None = None
) -> None:
    """Send a `run_fork` job (task id `<fork id>.<attempt>`, so Flower lists every run of a fork)."""
    app.send_task(
        RUN_FORK_TASK,
        args=[fork_id, digest, seed_chunks],
        queue=queue,
        task_id=f"{fork_id}.{attempt}",
        argsrepr=job_argsrepr(fork_id, digest, seed_chunks),
        kwargsrepr="{}",
    )


def make_sweeper(app: Celery, runtime: WorkerRuntime) -> Sweeper:
    """A sweeper over the runtime's Redis that re-enqueues through `app`."""
    settings = runtime.settings
    return Sweeper(
        leases=runtime.leases,
        store=runtime.store,
        max_attempts=settings.max_attempts,
        interval_s=settings.sweep_s,
        enqueue=lambda fid, digest, attempt: enqueue_fork(app, settings.queue, fid, digest, attempt=attempt),
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


def register_tasks(app: Celery, runtime: WorkerRuntime) -> None:
    """Register `run_fork` and `sweep` on `app`, bound to the process's runtime."""

    # shared=False: each app gets its own task (a shared task would register on every app built later)
    @app.task(
        name=RUN_FORK_TASK,
        bind=True,
        shared=False,
        ignore_result=True,
        acks_late=True,
        reject_on_worker_lost=True,
        Request=ForkqRequest,
    )
    def run_fork(self: Task[Any, Any], *args: Any, **kwargs: Any) -> str:
        """Run one delivery of a fork job (a no-op when the fork is not queued)."""
        try:
            job = RunForkJob.model_validate(_job_fields(args, kwargs))
        except (ValidationError, TypeError) as exc:
            # a hostile or malformed message: refuse it, never run it, never crash the worker
            log.error("rejected malformed run_fork job %s: %s", self.request.id, exc)
            runtime.store.dead_letter(str(self.request.id), f"malformed run_fork job: {exc}")
            return "rejected:malformed"
        try:
            return run_fork_job(runtime, job)
        except (RecordIntegrityError, RecordDecodeError, ForkNotFound) as exc:
            log.error("fork %s: refused: %s", job.fork_id, exc)
            runtime.store.dead_letter(str(self.request.id), str(exc))
            return f"refused:{type(exc).__name__}"

    @app.task(name=SWEEP_TASK, shared=False, ignore_result=True, Request=ForkqRequest)
    def sweep() -> dict[str, int]:
        """One sweeper pass (Celery beat schedules it every FORKQ_SWEEP_S)."""
        return dict(make_sweeper(app, runtime).sweep_once())


def _job_fields(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("fork_id", "digest", "seed_chunks")
    if len(args) > len(names):
        raise TypeError(f"run_fork takes at most {len(names)} arguments, got {len(args)}")
    return {**dict(zip(names, args, strict=False)), **kwargs}

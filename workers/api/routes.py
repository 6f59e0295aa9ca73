"""The API's endpoints: each a thin function over `ForkClient` (writes) or `AsyncForkReader` (reads and waits).

Writes (launch, cancel, approve, deny) run `ForkClient`'s own code in the threadpool, so a launch over HTTP is
checked exactly as one from Python. Reads, long polls and event streams use `redis.asyncio`: a request
waiting on a fork holds a connection, never a thread.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Annotated, Any, Final, cast

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer

from broker_config.settings import Settings
from workers.api.auth import ANYONE, Caller
from workers.api.launches import Launcher
from workers.api.models import (
    DIGEST_PATTERN,
    MAX_WAIT_S,
    BudgetRequest,
    Cancelled,
    ChangedFile,
    ChangesBody,
    Decided,
    DecisionRequest,
    Health,
    Launched,
    LaunchRequest,
    Listing,
    MessageRequest,
    MessageSent,
    Notification,
    ResultBody,
    SessionFork,
    SessionForks,
    WorkspaceOffer,
    WorkspaceOffered,
)
from workers.api.problems import ErrorBody
from workers.api.sse import DESCRIBED, EVENT_ID_PATTERN, event_stream
from workers.api.transcript import Transcript, build_transcript
from workers.api.workspaces import Workspaces, workspace_scope
from workers.base.keys import FORK_ID_RE, SESSION_RE, session_scope
from workers.client import ForkClient
from workers.errors import ForkNotEnded
from workers.records.events import ForkEvent
from workers.records.fork import ForkResult, ForkState
from workers.records.notification import render_task_notification
from workers.store.budget import ForkBudget, SessionBudget
from workers.store.forks import Decider
from workers.store.health import check_redis
from workers.store.reader import AsyncForkReader
from workers.store.reads import not_found
from workers.store.replies import Decision
from workers.store.sessions import SessionCancel

FORK_ID_PATTERN = f"^{FORK_ID_RE.pattern}$"
SESSION_PATTERN = f"^{SESSION_RE.pattern}$"
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"  # visible ASCII

log = logging.getLogger("forkq.api")


@dataclass(frozen=True)
class Services:
    """What the endpoints use, built once per app by its lifespan."""

    settings: Settings
    client: ForkClient
    reader: AsyncForkReader
    launcher: Launcher
    workspaces: Workspaces


async def services(request: Request) -> Services:
    """The app's services (a dependency; async, so FastAPI does not run it in the threadpool)."""
    return cast(Services, request.app.state.services)


Svc = Annotated[Services, Depends(services)]


async def caller(request: Request) -> Caller:
    """Who the request's token names (`ANYONE` on a server without tokens: one trusted user)."""
    return cast(Caller, getattr(request.state, "caller", ANYONE))


Who = Annotated[Caller, Depends(caller)]


async def visible(fork_id: str, svc: Services, who: Caller) -> ForkState:
    """The fork's state, if `who` may reach it; a fork of another tenant is not found, exactly as one that never
    existed (the answer says nothing of whether it does)."""
    state = await svc.reader.state(fork_id)
    if not who.sees(state.tenant):
        raise not_found(fork_id)
    return state


def visible_now(fork_id: str, svc: Services, who: Caller) -> None:
    """`visible`, for an endpoint that runs in the threadpool (a write through `ForkClient`)."""
    if not who.sees(svc.client.status(fork_id).tenant):
        raise not_found(fork_id)


ForkId = Annotated[str, Path(pattern=FORK_ID_PATTERN, description="A fork id, as the launch returned it.")]
SessionId = Annotated[str, Path(pattern=SESSION_PATTERN, description="The parent's session id.")]
Digest = Annotated[str, Path(pattern=DIGEST_PATTERN, description="The SHA-256 of the blob's bytes, lowercase hex.")]
DIFF_MEDIA: Final = "text/x-diff"


Responses = dict[int | str, dict[str, Any]]
BODY_ERRORS: Final = (400, 413, 415)  # any POST: its body is read (bounded, decoded) before the endpoint sees it


def _errors(*codes: int, other: Responses | None = None) -> Responses:
    """The OpenAPI entries of an endpoint's error responses (all of the one shape), after its `other` responses."""
    errors: Responses = {
        code: {"model": ErrorBody, "description": "The error (docs/api.md: errors)."} for code in codes
    }
    return {**(other or {}), **errors}


def _state_json(state: ForkState, status_code: int = 200) -> JSONResponse:
    return JSONResponse(state.model_dump(mode="json"), status_code=status_code)


def launch_fork(
    body: LaunchRequest,
    svc: Svc,
    who: Who,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", pattern=IDEMPOTENCY_KEY_PATTERN)] = None,
) -> JSONResponse:
    """Launch a fork or subagent: 202 with its id; 200 with the same fork for an Idempotency-Key seen before."""
    outcome = svc.launcher.launch(body, key=idempotency_key, token_id=who.token_id, tenant=who.tenant)
    launched = Launched(fork_id=outcome.fork_id, status=outcome.status)
    headers = {"Location": f"/v1/forks/{outcome.fork_id}"}
    if not outcome.created:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(launched.model_dump(), status_code=202 if outcome.created else 200, headers=headers)


async def fork_state(fork_id: ForkId, svc: Svc, who: Who) -> JSONResponse:
    """The fork's state (as `forkq status --json` prints it)."""
    return _state_json(await visible(fork_id, svc, who))


async def fork_result(
    fork_id: ForkId,
    svc: Svc,
    who: Who,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for the end (at most 60).")] = 0,
) -> JSONResponse:
    """The result (200) once the fork has ended; else, once `wait` runs out or at once if parked, its state (202)."""
    await visible(fork_id, svc, who)
    outcome = await svc.reader.result_within(fork_id, wait)
    if isinstance(outcome, ForkResult):
        body = ResultBody(**outcome.model_dump(include={"fork_id", "status", "output", "usage", "error"}))
        return JSONResponse(body.model_dump(mode="json"))
    return _state_json(outcome, 202)


async def fork_notification(fork_id: ForkId, svc: Svc, who: Who) -> Notification:
    """The `<task-notification>` for the parent's model; 409 while the fork has not ended."""
    state = await visible(fork_id, svc, who)
    result = await svc.reader.result(fork_id)
    if result is None:
        raise ForkNotEnded(
            f"fork {fork_id} is {state.status.value}: it has no result to notify yet; wait for it first "
            f"(GET /v1/forks/{fork_id}/result?wait=60)",
            fork_id=fork_id,
        )
    changed = await run_in_threadpool(svc.client.changed_files, fork_id)  # a snapshot fork's, for the parent to apply
    text = render_task_notification(result, description=state.description, changed_files=changed)
    return Notification(fork_id=fork_id, status=result.status, notification=text)


async def fork_events(
    fork_id: ForkId,
    svc: Svc,
    who: Who,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", pattern=EVENT_ID_PATTERN)] = None,
) -> StreamingResponse:
    """The fork's events as Server-Sent Events, after `Last-Event-ID` if given, until it ends."""
    await visible(fork_id, svc, who)  # 404 before the stream starts
    stream = event_stream(svc.reader, fork_id, after=last_event_id or "0-0", keepalive_s=svc.settings.api_keepalive_s)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may hold events back
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers)


async def fork_transcript(
    fork_id: ForkId,
    svc: Svc,
    who: Who,
    max_chars: Annotated[int, Query(ge=0, le=1_000_000, description="Characters of a tool result kept.")] = 4096,
) -> JSONResponse:
    """The seed's summary and every journaled step (tool results cut to `max_chars`)."""
    state = await visible(fork_id, svc, who)
    record = await svc.reader.record(fork_id, state.digest or None)
    entries = await svc.reader.journal(fork_id)
    transcript = build_transcript(state, record, entries, max_chars=max_chars)
    # a step has the fields of its kind only; every other null (a seed's fork_turns, a call's id) is the value
    body = transcript.model_dump(mode="json", exclude={"steps"})
    body["steps"] = [
        {k: v for k, v in step.model_dump(mode="json").items() if v is not None} for step in transcript.steps
    ]
    return JSONResponse(body)


def cancel_fork(fork_id: ForkId, svc: Svc, who: Who) -> Cancelled:
    """Cancel the fork; its status afterwards (`cancelled`, or the status it had already ended with)."""
    visible_now(fork_id, svc, who)
    return Cancelled(fork_id=fork_id, status=svc.client.cancel(fork_id))


def decide_call(
    fork_id: ForkId,
    call_id: Annotated[str, Path(min_length=1, max_length=200, description="The pending call's id.")],
    body: DecisionRequest,
    svc: Svc,
    who: Who,
) -> Decided:
    """Approve or deny a call a parked fork waits on; the fork goes on once no call waits."""
    visible_now(fork_id, svc, who)
    by = Decider(f"token:{who.token_id}" if who.token_id else "local", who.tenant)  # the audit: in the journal
    if body.decision == "approve":
        status = svc.client.approve(fork_id, call_id, by=by)
    else:
        status = svc.client.deny(fork_id, call_id, body.reason, by=by)
    outcome = Decision.after(status)
    return Decided(fork_id=fork_id, call_id=call_id, decision=body.decision, outcome=outcome, status=status)


async def session_forks(
    session_id: SessionId,
    svc: Svc,
    who: Who,
    limit: Annotated[int, Query(ge=1, le=1000, description="The newest this many.")] = 100,
) -> SessionForks:
    """The forks launched from a parent session of the caller's tenant that are still in Redis, newest first."""
    forks = await svc.reader.session_forks(session_scope(session_id, who.tenant), limit=limit)
    return SessionForks(session_id=session_id, forks=[SessionFork(**dataclasses.asdict(f)) for f in forks])


def cancel_session(session_id: SessionId, svc: Svc, who: Who) -> SessionCancel:
    """Cancel every fork of a parent session of the caller's tenant that has not ended, nested subagents included;
    launches into the session are refused (409) from then until FORKQ_SESSION_TOMBSTONE_S after it."""
    return svc.client.cancel_session(session_id, tenant=who.tenant)


def session_budget(session_id: SessionId, svc: Svc, who: Who) -> SessionBudget:
    """The token budget of a session of the caller's tenant: its limit (null: none), what its forks used, and what
    is left."""
    return svc.client.budget(session_id, tenant=who.tenant)


def set_session_budget(session_id: SessionId, body: BudgetRequest, svc: Svc, who: Who) -> SessionBudget:
    """Set the token budget of a session of the caller's tenant; raised above what its forks used, the forks it
    paused resume (`resumed`)."""
    return svc.client.set_budget(session_id, tokens=body.tokens, tenant=who.tenant)


def fork_budget(fork_id: ForkId, svc: Svc, who: Who) -> ForkBudget:
    """The fork's budgets: its own max_tokens, used and left, and its session's budget."""
    visible_now(fork_id, svc, who)
    return svc.client.fork_budget(fork_id)


def send_message(fork_id: ForkId, body: MessageRequest, svc: Svc, who: Who) -> MessageSent:
    """Give the fork a message (docs/conversations.md): a succeeded fork is continued, a running or parked one
    reads it before its next model call; a fork that failed or was cancelled, or a full inbox, is 409."""
    visible_now(fork_id, svc, who)
    sent = svc.client.send(fork_id, body.text)
    return MessageSent(fork_id=sent.fork_id, outcome=sent.outcome, waiting=sent.waiting)


def offer_workspace(body: WorkspaceOffer, svc: Svc, who: Who) -> WorkspaceOffered:
    """Offer a tree's manifest: its digest, and the blobs the server lacks (upload them, then offer again);
    once none is missing, the manifest is stored and a launch may name it."""
    offered = svc.workspaces.offer(workspace_scope(who.token_id), body.entries)
    return WorkspaceOffered(manifest=offered.manifest, missing=offered.missing)


async def upload_blob(digest: Digest, request: Request, svc: Svc, who: Who) -> Response:
    """Upload one file's bytes (the raw body), checked against its digest: 204 once stored."""
    data = await request.body()  # read whole and bounded by `BodyLimit`
    await run_in_threadpool(svc.workspaces.upload, workspace_scope(who.token_id), digest, data)
    return Response(status_code=204)


async def fork_changes(
    fork_id: ForkId,
    request: Request,
    svc: Svc,
    who: Who,
    stat: Annotated[bool, Query(description="Only the changed files (JSON), no patch.")] = False,
) -> Response:
    """The fork's changes to its workspace: a git patch (text/x-diff, binary files included), or, with `stat` or
    `Accept: application/json`, the changed files (and the patch) as JSON."""
    await visible(fork_id, svc, who)  # 404 for a fork that does not exist, or is another tenant's
    changes = await run_in_threadpool(svc.client.changes, fork_id)
    accept = request.headers.get("accept", "")
    if not stat and ("application/json" not in accept or DIFF_MEDIA in accept):
        return Response(await run_in_threadpool(changes.patch), media_type=DIFF_MEDIA)
    files = [ChangedFile.model_validate(f) for f in await run_in_threadpool(changes.stat)]
    text = None if stat else (await run_in_threadpool(changes.patch)).decode("utf-8", errors="replace")
    return JSONResponse(ChangesBody(fork_id=fork_id, files=files, patch=text).model_dump(mode="json"))


def list_agents(svc: Svc) -> Listing:
    """The subagent definitions a launch can name (`forkq agents --json`)."""
    return Listing(items=svc.client.agents())


def list_providers(svc: Svc) -> Listing:
    """The subagent providers and their capabilities (`forkq providers --json`)."""
    return Listing(items=svc.client.providers())


def healthz(svc: Svc) -> JSONResponse:
    """200 when Redis answers and is fit for forkq (`forkq check`), else 503; no token needed."""
    health = check_redis(svc.settings)
    fit = not health.problems
    for problem in health.problems:  # the body says only whether: the details may name hosts
        log.warning("health: %s", problem)
    body = Health(ok=fit, redis_reachable=health.reachable, redis_fit=fit)
    return JSONResponse(body.model_dump(), status_code=200 if fit else 503)


def fork_router(*, secured: bool) -> APIRouter:
    """The `/v1` endpoints (behind a bearer token when `secured`) and `/healthz`."""
    bearer = [Security(HTTPBearer(auto_error=False, description="A token of FORKQ_API_TOKENS."))] if secured else []
    router = APIRouter()
    v1 = APIRouter(prefix="/v1", dependencies=bearer, responses=_errors(401, 422, 500, 503))
    v1.add_api_route(
        "/forks",
        launch_fork,
        methods=["POST"],
        status_code=202,
        response_model=Launched,
        responses=_errors(
            409, *BODY_ERRORS, other={200: {"model": Launched, "description": "An Idempotency-Key seen before"}}
        ),
    )
    _add_read_routes(v1)
    _add_write_routes(v1)
    _add_workspace_routes(v1)
    v1.add_api_route("/agents", list_agents, methods=["GET"])
    v1.add_api_route("/providers", list_providers, methods=["GET"])
    router.include_router(v1)
    router.add_api_route(
        "/healthz",
        healthz,
        methods=["GET"],
        response_model=Health,
        responses=_errors(500, other={503: {"model": Health, "description": "Redis is unreachable or unfit"}}),
    )
    return router


def _add_read_routes(v1: APIRouter) -> None:
    """The endpoints that read a fork: its state, result, notification, events and transcript."""
    v1.add_api_route("/forks/{fork_id}", fork_state, methods=["GET"], response_model=ForkState, responses=_errors(404))
    v1.add_api_route(
        "/forks/{fork_id}/result",
        fork_result,
        methods=["GET"],
        response_model=ResultBody,
        responses=_errors(404, other={202: {"model": ForkState, "description": "Not ended (yet): the fork's state"}}),
    )
    v1.add_api_route("/forks/{fork_id}/notification", fork_notification, methods=["GET"], responses=_errors(404, 409))
    v1.add_api_route(
        "/forks/{fork_id}/events",
        fork_events,
        methods=["GET"],
        response_class=StreamingResponse,
        responses=_errors(404, other={200: {"model": ForkEvent, "description": DESCRIBED}}),  # `document_events`
    )
    v1.add_api_route(
        "/forks/{fork_id}/transcript",
        fork_transcript,
        methods=["GET"],
        response_model=Transcript,
        responses=_errors(404),
    )


def _add_write_routes(v1: APIRouter) -> None:
    """The endpoints that act on a fork or a session: cancel, approvals, messages, and a session's listing."""
    v1.add_api_route("/forks/{fork_id}/cancel", cancel_fork, methods=["POST"], responses=_errors(404, *BODY_ERRORS))
    v1.add_api_route(
        "/forks/{fork_id}/approvals/{call_id}",
        decide_call,
        methods=["POST"],
        responses=_errors(404, 409, *BODY_ERRORS),
    )
    v1.add_api_route("/sessions/{session_id}/forks", session_forks, methods=["GET"])
    v1.add_api_route("/sessions/{session_id}/budget", session_budget, methods=["GET"], response_model=SessionBudget)
    v1.add_api_route(
        "/sessions/{session_id}/budget",
        set_session_budget,
        methods=["PUT"],
        response_model=SessionBudget,
        responses=_errors(*BODY_ERRORS),
    )
    v1.add_api_route(
        "/forks/{fork_id}/budget", fork_budget, methods=["GET"], response_model=ForkBudget, responses=_errors(404)
    )
    v1.add_api_route(
        "/sessions/{session_id}/cancel",
        cancel_session,
        methods=["POST"],
        response_model=SessionCancel,
        responses=_errors(*BODY_ERRORS),
    )
    v1.add_api_route(
        "/forks/{fork_id}/messages",
        send_message,
        methods=["POST"],
        status_code=202,
        responses=_errors(404, 409, *BODY_ERRORS),
    )


def _add_workspace_routes(v1: APIRouter) -> None:
    """The endpoints of uploaded workspaces (a manifest, its blobs) and of a fork's changes."""
    v1.add_api_route(
        "/workspaces",
        offer_workspace,
        methods=["POST"],
        response_model=WorkspaceOffered,
        responses=_errors(*BODY_ERRORS),
    )
    v1.add_api_route(
        "/workspaces/blobs/{digest}",
        upload_blob,
        methods=["PUT"],
        status_code=204,
        response_class=Response,
        responses=_errors(*BODY_ERRORS),
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "The file's exact bytes (a symlink's: its target).",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
    )
    v1.add_api_route(
        "/forks/{fork_id}/changes",
        fork_changes,
        methods=["GET"],
        response_class=Response,
        responses=_errors(
            404,
            other={
                200: {
                    "model": ChangesBody,
                    "description": "The git patch (text/x-diff), or the files and patch as JSON",
                    "content": {DIFF_MEDIA: {"schema": {"type": "string"}}},
                }
            },
        ),
    )

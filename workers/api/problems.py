"""The API's one error shape, and which HTTP status each of forkq's errors gets.

Every refused request, whatever refused it (the token check, the body limits, FastAPI's own
validation, a `ForkqError` from the client, Redis, a bug), gets the same JSON body:
`{"error": {"status": 422, "message": "...", "field": "fork_turns"}}`; `field` is null when no
one field is at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import Send

from workers.api.models import LaunchOptions
from workers.errors import (
    ApplyConflict,
    BudgetExhausted,
    ForkNotEnded,
    ForkNotFound,
    ForkNotPaused,
    ForkqError,
    IdempotencyConflict,
    InvalidAgentDefinition,
    InvalidAgentParams,
    InvalidApproval,
    InvalidBudget,
    InvalidHistory,
    InvalidParentSnapshot,
    MessageRefused,
    RecordExistsError,
    RequestRefused,
    SandboxUnavailable,
    SessionCancelled,
    WorkspaceError,
)

log = logging.getLogger("forkq.api")
LAUNCH_OPTIONS: Final = tuple(LaunchOptions.model_fields)

STATUS_OF: Final[Sequence[tuple[type[ForkqError], int]]] = (
    (InvalidAgentParams, 422),
    (InvalidAgentDefinition, 500),  # the server's FORKQ_AGENTS_DIR holds a malformed file: its operator's to fix
    (InvalidParentSnapshot, 422),
    (InvalidHistory, 422),
    (ForkNotFound, 404),
    (ForkNotEnded, 409),
    (ForkNotPaused, 409),
    (BudgetExhausted, 409),
    (InvalidBudget, 422),
    (InvalidApproval, 409),
    (MessageRefused, 409),  # an ended fork, a full inbox; an empty or oversized message is 422 (its field)
    (IdempotencyConflict, 409),
    (SessionCancelled, 409),  # a launch into a session cancelled moments ago: a new session id is the fix
    (RecordExistsError, 409),  # a fork id chosen by the caller that another launch took
    (SandboxUnavailable, 503),  # no worker can confine a snapshot fork's tools: the operator's to fix
    (ApplyConflict, 409),
    (WorkspaceError, 422),  # a manifest, blob or workspace option the request got wrong
)


class ErrorDetail(BaseModel):
    """What went wrong: the HTTP status again, a message naming the thing and the fix, and the field at fault."""

    status: int
    message: str
    field: str | None = None


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def error_json(status: int, message: str, field: str | None = None) -> bytes:
    """The error body's bytes."""
    body = {"error": {"status": status, "message": message, "field": field}}
    return json.dumps(body, ensure_ascii=False).encode()


def error_response(
    status: int, message: str, field: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An error response (for handlers and endpoints)."""
    body = {"error": {"status": status, "message": message, "field": field}}
    return JSONResponse(body, status_code=status, headers=headers)


async def send_error(send: Send, status: int, message: str, *, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Send an error response from ASGI middleware, before the app has seen the request."""
    body = error_json(status, message)
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


def status_of(exc: ForkqError) -> int:
    """The HTTP status of one of forkq's errors: 422 bad input, 404 no such fork, 409 not now, else 500."""
    if isinstance(exc, RequestRefused):
        return exc.status
    if isinstance(exc, MessageRefused) and exc.field == "message":  # the text itself: bad input
        return 422
    return next((status for kind, status in STATUS_OF if isinstance(exc, kind)), 500)


async def _forkq_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ForkqError)
    status = status_of(exc)
    if status == 500:
        log.error("request failed: %s", exc)
    return error_response(status, exc.message, exc.field)


async def _redis_error(_: Request, exc: Exception) -> JSONResponse:
    log.warning("Redis error: %s", exc)
    message = f"Redis error: {exc}; the server cannot reach its Redis now (GET /healthz); try again"
    return error_response(503, message)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first: dict[str, Any] = dict(exc.errors()[0]) if exc.errors() else {"loc": (), "msg": "invalid request"}
    field, message = validation_message(first)
    return error_response(422, message, field)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body as JSON
        return error_response(422, body_not_json(exc.__cause__))
    return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


def body_not_json(cause: BaseException) -> str:
    """The message for a body FastAPI could not decode (its own says only "There was an error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"the request body is not JSON: byte {cause.object[cause.start]:#04x} at offset {cause.start} is not "
            "UTF-8; send the JSON encoded as UTF-8"
        )
    if isinstance(cause, RecursionError):
        return "the request body is not JSON this server reads: it nests too deeply; flatten it"
    return f"the request body is not JSON ({type(cause).__name__}); send a JSON object encoded as UTF-8"


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); the server's log has the details")


def validation_message(error: Mapping[str, Any]) -> tuple[str | None, str]:
    """(field, message) for one of FastAPI's validation errors: the field's dotted path without its source."""
    loc = [str(part) for part in error.get("loc", ())]
    source, path = (loc[0], loc[1:]) if loc and loc[0] in ("body", "query", "path", "header") else ("", loc)
    field = ".".join(path) or None
    where = f"{source} field {field!r}" if field else ("the request body" if source == "body" else "the request")
    kind = error.get("type")
    if kind == "extra_forbidden" and len(path) == 2 and path[0] == "options":
        known = ", ".join(LAUNCH_OPTIONS)
        return field, f"launch option {path[1]!r} is not known; the options are {known} (docs/api.md)"
    if kind == "extra_forbidden":
        return field, f"{where} is not known: leave it out (docs/api.md lists the fields)"
    if kind == "missing":
        return field, f"{where} is required"
    if kind == "json_invalid":
        return None, f"the request body is not JSON: {error.get('ctx', {}).get('error', error.get('msg'))}"
    return field, f"{where}: {error.get('msg', 'invalid')}"


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app answers with take the one shape."""
    app.add_exception_handler(ForkqError, _forkq_error)
    app.add_exception_handler(redis.RedisError, _redis_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)

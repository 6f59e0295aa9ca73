"""The forkq error tree: every error forkq raises on purpose, with its context as attributes.

```
ForkqError                      base; never raised bare
├── InvalidAgentParams          an Agent tool call's parameters break the contract (.field)
├── InvalidHistory              a parent history is not a list of Gemini Contents (.index)
├── InvalidParentSnapshot       a parent snapshot file is malformed (.field)
├── RecordDecodeError           bytes are not a canonical forkq record (.key, .cause)
├── RecordIntegrityError        a stored record does not match its digest (.fork_id, .key)
├── RecordExistsError           a write-once record already exists with other bytes (.fork_id, .key)
├── ForkNotFound                no fork with that id in Redis (.fork_id)
├── ForkTimeout                 a fork did not end within the caller's wait (.fork_id)
├── ForkNotEnded                a fork has no result yet (.fork_id)
├── ForkParked                  a waited-on fork is parked: awaiting approval or paused (.fork_id, .status, .pending)
├── ForkNotPaused               a resumed fork is not paused: nothing to resume (.fork_id, .status)
├── BudgetExhausted             a resumed fork paused at a token budget that is still used up (.fork_id, .budget)
├── InvalidBudget               a session budget that is not a whole number of tokens, or a bad session id (.field)
├── LeaseLost                   this worker no longer holds the fork's lease (.fork_id)
├── InvalidApproval             approve/deny of a fork or call that is not awaiting a decision (.fork_id)
├── MessageRefused              a message `send` cannot give: empty, too long, ended fork, full inbox (.status)
├── SessionCancelled            a launch into a session cancelled moments ago (.session, .until_ms)
├── IdempotencyConflict         an Idempotency-Key sent again with another launch body (.fork_id: the first launch's)
├── RequestRefused              an HTTP request `forkq serve` will not read: body too large, unknown encoding (.status)
├── WorkspaceError              a fork's files cannot be snapshotted, stored, built or applied (.field)
│   ├── WorkspaceTooLarge       a tree over FORKQ_WORKSPACE_MAX_BYTES or _MAX_FILES (.largest: its biggest folders)
│   ├── ApplyConflict           a fork's changes do not apply to a tree (.paths)
│   └── SandboxUnavailable      this machine cannot confine a snapshot fork's tools (.reason)
├── ConfigurationError          settings or the Redis server are unfit for forkq (.field)
│   ├── MissingExtra            a command needs an optional part of forkq that is not installed (.extra, .missing)
│   └── InvalidAgentDefinition  a subagent definition file is malformed (.path, .field)
├── ToolError                   a tool call failed in a way the model should read (workers.tools.registry)
└── ProviderError               a model provider call failed for good (.provider, .model, .status, .attempts)
```

Every message names the thing, what was expected, and how to fix it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


class ForkqError(Exception):
    """Base class of every error forkq raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        fork_id: str | None = None,
        key: str | None = None,
        field: str | None = None,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.fork_id = fork_id
        self.key = key
        self.field = field
        self.cause = cause

    def __str__(self) -> str:
        return self.message


class InvalidAgentParams(ForkqError):
    """The parameters of an Agent tool call are invalid; `.field` names the parameter."""


class InvalidHistory(ForkqError):
    """A raw history is not a valid list of Contents; `.index` names the first bad message."""

    def __init__(
        self, message: str, *, index: int | None, field: str | None = None, cause: BaseException | None = None
    ) -> None:
        super().__init__(message, field=field, cause=cause)
        self.index = index


class InvalidParentSnapshot(ForkqError):
    """A parent snapshot (the CLI's `--parent` file) is malformed; `.field` names the bad field."""


class RecordDecodeError(ForkqError):
    """Bytes could not be decoded as a forkq record."""


class RecordIntegrityError(ForkqError):
    """A record's bytes do not match the digest they were stored or sent under."""


class RecordExistsError(ForkqError):
    """A write-once record already exists with different content."""


class ForkNotFound(ForkqError):
    """No fork with this id exists (never launched, or past its retention)."""


class ForkTimeout(ForkqError):
    """A fork did not end within the time the caller waited."""


class ForkNotEnded(ForkqError):
    """The fork has not ended, so it has no result (or notification) yet."""


class ForkParked(ForkqError):
    """A fork someone waits for is parked (`awaiting_approval` or `paused`): it ends only after a person acts.

    `status` is the fork's status, `pending` the calls it waits on (`call_id`, `name`, `args`; empty
    when paused), `reason` why it paused (None when it waits on calls) and `waiting_for` the state's
    `waiting_for` as JSON data (`kind` `approval` or `resume`), so the caller can decide at once.
    """

    def __init__(
        self,
        message: str,
        *,
        fork_id: str,
        status: str,
        pending: list[dict[str, Any]],
        reason: str | None,
        waiting_for: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, fork_id=fork_id)
        self.status = status
        self.pending = pending
        self.reason = reason
        self.waiting_for = waiting_for


class ForkNotPaused(ForkqError):
    """A resume of a fork that is not paused, so there is nothing to resume; `status` is the fork's status."""

    def __init__(self, message: str, *, fork_id: str, status: str) -> None:
        super().__init__(message, fork_id=fork_id)
        self.status = status


class BudgetExhausted(ForkqError):
    """A resume of a fork paused at a token budget still used up; `budget` is `max_tokens` (its own) or `session`."""

    def __init__(self, message: str, *, fork_id: str, budget: str) -> None:
        super().__init__(message, fork_id=fork_id)
        self.budget = budget


class InvalidBudget(ForkqError):
    """A session budget's tokens or session id are invalid; `.field` names which (`tokens`, `session`)."""


class LeaseLost(ForkqError):
    """This worker no longer holds the fork's lease (expired, revived elsewhere, or cancelled).

    `refusal` is what the fenced write found: `stale` (another epoch), `lost` (another owner), or the
    fork's status when it is no longer running (`cancelled`, ...).
    """

    def __init__(self, message: str, *, fork_id: str | None = None, refusal: str | None = None) -> None:
        super().__init__(message, fork_id=fork_id)
        self.refusal = refusal


class InvalidApproval(ForkqError):
    """An approve/deny that does not apply: the fork is not awaiting approval, or has no such pending call."""


class MessageRefused(ForkqError):
    """A message `send` did not give the fork: the text is empty or too long, the fork failed or was cancelled,
    or its inbox is full; `status` is the fork's status when that is the reason, and nothing was written."""

    def __init__(self, message: str, *, fork_id: str | None, status: str | None = None, field: str | None = None):
        super().__init__(message, fork_id=fork_id, field=field)
        self.status = status


class SessionCancelled(ForkqError):
    """A launch into a parent session that was cancelled (`forkq cancel --session`) while its tombstone lasts;
    nothing was written. `session` is the session, `until_ms` when launches into it are taken again (Unix ms)."""

    def __init__(self, session: str, until_ms: int, *, fork_id: str | None = None) -> None:
        until = utc_text(until_ms)
        super().__init__(
            f"session {session!r} was cancelled: launches into it are refused until {until} "
            "(FORKQ_SESSION_TOMBSTONE_S after its cancel), and this one wrote nothing; launch with a new session id",
            fork_id=fork_id,
            field="session_id",
        )
        self.session = session
        self.until_ms = until_ms


def utc_text(ms: int) -> str:
    """Unix milliseconds as an ISO 8601 UTC time to the second."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class IdempotencyConflict(ForkqError):
    """A launch sent with an Idempotency-Key that an earlier launch with a different body used; nothing was written.

    `fork_id` is the fork the first launch with that key made.
    """


class RequestRefused(ForkqError):
    """An HTTP request the API refuses before its app reads it (a body over the limit, in an encoding it does not
    read, or not valid gzip); `status` is the HTTP status of the answer."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class WorkspaceError(ForkqError):
    """A fork's files cannot be snapshotted, stored, materialized or applied; the message names the path."""


class WorkspaceTooLarge(WorkspaceError):
    """A tree is over the workspace bounds; `largest` lists its biggest folders as `(folder, bytes, files)`."""

    def __init__(self, message: str, *, largest: list[tuple[str, int, int]]) -> None:
        super().__init__(message, field="workspace")
        self.largest = largest


class ApplyConflict(WorkspaceError):
    """A fork's changes do not apply: the target's files differ from the ones the fork started from (`paths`)."""

    def __init__(self, message: str, *, paths: list[str], fork_id: str | None = None) -> None:
        super().__init__(message, fork_id=fork_id)
        self.paths = paths


class SandboxUnavailable(WorkspaceError):
    """This machine cannot confine a snapshot fork's tools; `reason` says what is missing."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message, field="sandbox")
        self.reason = reason


class ConfigurationError(ForkqError):
    """Settings or the Redis server are not fit for forkq; the message says what to change."""


class MissingExtra(ConfigurationError):
    """A command needs an optional part of forkq (a pip extra) that is not installed; the message names the extra."""

    def __init__(self, what: str, extra: str, missing: list[str]) -> None:
        super().__init__(
            f"{what} needs the \"{extra}\" extra (not installed: {', '.join(missing)}): pip install 'forkq[{extra}]'",
            field=extra,
        )
        self.extra = extra
        self.missing = missing


class InvalidAgentDefinition(ConfigurationError):
    """A subagent definition (a Markdown file with front matter in FORKQ_AGENTS_DIR) is malformed.

    `path` names the file and `field` the front-matter field (or `body`, `front matter`).
    """

    def __init__(self, message: str, *, path: str, field: str | None) -> None:
        super().__init__(message, field=field)
        self.path = path


class ProviderError(ForkqError):
    """A model provider call failed for good: not retryable, or still failing after the last attempt.

    The message names the provider, the model, the HTTP status (if any) and the attempts made; it never
    contains an API key.
    """

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        model: str | None,
        status: int | None = None,
        attempts: int | None = None,
        fork_id: str | None = None,
    ) -> None:
        super().__init__(message, fork_id=fork_id)
        self.provider = provider
        self.model = model
        self.status = status
        self.attempts = attempts

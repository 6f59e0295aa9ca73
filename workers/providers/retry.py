"""Retries of model calls: bounded attempts, exponential backoff with jitter, `Retry-After` honoured.

The adapters turn off their SDK's own retries and call `call_with_retries`, handing it a `classify`
function that maps an SDK exception to a `Failure` (retryable or not, HTTP status, server-requested
delay). Anything `classify` does not recognise is a bug, not a provider failure, and propagates.

A `Pacer` (cluster-wide admission, `workers.service.admission`) makes the attempts of every worker share one
cooldown per endpoint and model: every attempt waits for it first, and a 429 or 503 with `Retry-After` starts it.
"""

from __future__ import annotations

import email.utils
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol, TypeVar

from workers.errors import ProviderError

log = logging.getLogger("forkq.provider")

T = TypeVar("T")

# 408 request timeout, 409 conflict (OpenAI's lock contention), 429 rate limit; every 5xx is transient too
RETRYABLE_STATUSES = frozenset({408, 409, 429})
_DETAIL_MAX_CHARS = 300
COOLDOWN_STATUSES: Final = frozenset({429, 503})  # with Retry-After: the endpoint asks every caller to hold off


class Pacer(Protocol):
    """A cooldown shared with every other caller of an endpoint and model."""

    def wait(self, endpoint: str, model: str, attempt: int) -> None:
        """Block until attempt `attempt` (1-based) of a call to `model` at `endpoint` may go out."""
        ...

    def throttled(self, endpoint: str, model: str, retry_after_s: float) -> None:
        """`endpoint` answered 429 or 503 asking callers of `model` to wait `retry_after_s`."""
        ...


def is_retryable_status(status: int) -> bool:
    """Whether an HTTP status is worth another attempt."""
    return status in RETRYABLE_STATUSES or status >= 500


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as the retry loop needs to see it."""

    retryable: bool
    status: int | None  # HTTP status; None for timeouts and connection errors
    detail: str  # short description for the message and the log (secrets are scrubbed before use)
    retry_after_s: float | None = None  # what the server asked for, if anything


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry; `sleep` and `uniform` are injectable for tests."""

    max_attempts: int = 5
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0
    max_retry_after_s: float = 300.0  # a server asking for longer than this gets this
    pacer: Pacer | None = field(default=None, compare=False)  # a cooldown shared cluster-wide (None: this call's own)
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    uniform: Callable[[], float] = field(default=random.random, compare=False)  # in [0, 1)

    def delay(self, attempt: int, retry_after_s: float | None) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based): jittered backoff, at least `Retry-After`."""
        backoff = min(self.max_delay_s, self.base_delay_s * 2.0 ** (attempt - 1))
        jittered = backoff * (0.5 + self.uniform() / 2)  # "equal jitter": spread retries, never collapse to 0
        if retry_after_s is None:
            return jittered
        return min(max(retry_after_s, jittered), self.max_retry_after_s)


def parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    """The server's requested delay in seconds: `retry-after-ms`, `retry-after` seconds or HTTP date."""
    if not headers:
        return None
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret replaced by `***`, shortened for a message."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_MAX_CHARS else text[: _DETAIL_MAX_CHARS - 1] + "…"


def call_with_retries(
    call: Callable[[], T],
    *,
    provider: str,
    model: str,
    policy: RetryPolicy,
    classify: Callable[[Exception], Failure | None],
    secrets: Iterable[str] = (),
    fork_id: str | None = None,
    endpoint: str = "",
) -> T:
    """Run `call` until it succeeds, fails for good, or `policy.max_attempts` attempts are spent; each attempt
    waits first for the shared cooldown of `endpoint` and `model` (`policy.pacer`), and a 429 or 503 with
    `Retry-After` starts it.

    Raises:
        ProviderError: a non-retryable failure, or the last retryable one; names provider, model,
            status and attempts, never a secret. Exceptions `classify` does not recognise propagate.
    """
    secrets = tuple(secrets)
    attempt = 0
    while True:
        attempt += 1
        if policy.pacer is not None:
            policy.pacer.wait(endpoint, model, attempt)
        try:
            return call()
        except Exception as exc:
            failure = classify(exc)
            if failure is None:
                raise
            if policy.pacer is not None and failure.status in COOLDOWN_STATUSES and failure.retry_after_s:
                policy.pacer.throttled(endpoint, model, min(failure.retry_after_s, policy.max_retry_after_s))
            detail = scrub(failure.detail, secrets)
            if not failure.retryable or attempt >= policy.max_attempts:
                error = _terminal_error(provider, model, failure, detail=detail, attempts=attempt, fork_id=fork_id)
                # the SDK's exception text could echo a key back; then it must not ride along as the cause
                leaks = any(s and s in str(exc) for s in secrets)
                raise error from (None if leaks else exc)
            delay = policy.delay(attempt, failure.retry_after_s)
            log.warning(
                "%s model %r: attempt %d/%d failed (%s); retrying in %.2fs",
                provider,
                model,
                attempt,
                policy.max_attempts,
                detail,
                delay,
            )
            policy.sleep(delay)


def _terminal_error(
    provider: str, model: str, failure: Failure, *, detail: str, attempts: int, fork_id: str | None
) -> ProviderError:
    what = f"HTTP {failure.status}: {detail}" if failure.status is not None else detail
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    if failure.retryable:
        summary = f"still failing after {tries} ({what})"
    else:
        summary = f"failed with a non-retryable error after {tries} ({what})"
    return ProviderError(
        f"{provider} model {model!r}: {summary}; {_fix(provider, failure)}",
        provider=provider,
        model=model,
        status=failure.status,
        attempts=attempts,
        fork_id=fork_id,
    )


def _fix(provider: str, failure: Failure) -> str:
    env = f"FORKQ_{provider.upper()}"
    status = failure.status
    if status in (401, 403):
        return f"check {env}_API_KEY and that it may use this model"
    if status == 404:
        return f"check the model name and {env}_BASE_URL"
    if status is not None and 400 <= status < 500 and status not in RETRYABLE_STATUSES:
        return "the provider rejected the request as sent; see the detail above"
    if status == 429:
        return "the provider is rate-limiting this key; lower FORKQ_WORKER_CONCURRENCY or raise the quota"
    if status is None and not failure.retryable:  # an answer the SDK could not use: waiting will not help
        return f"check that {env}_BASE_URL points at a server that speaks the {provider} API; see the detail above"
    return (
        f"the provider is unavailable or slow; check {env}_BASE_URL and the provider's status, "
        "or raise FORKQ_PROVIDER_TIMEOUT_S / FORKQ_PROVIDER_MAX_ATTEMPTS"
    )

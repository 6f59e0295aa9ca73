"""The shared retry loop: backoff, jitter, Retry-After, bounded attempts and the terminal error."""

from __future__ import annotations

import email.utils
import time

import pytest

from workers.errors import ProviderError
from workers.providers.retry import (
    Failure,
    RetryPolicy,
    call_with_retries,
    is_retryable_status,
    parse_retry_after,
    scrub,
)


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


class Flaky:
    """Fails with the given exceptions, in order, then returns "ok"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


class Status(Exception):
    def __init__(self, status: int, retry_after: float | None = None, text: str = "boom") -> None:
        super().__init__(text)
        self.status = status
        self.retry_after = retry_after


def classify(exc: Exception) -> Failure | None:
    if isinstance(exc, Status):
        return Failure(is_retryable_status(exc.status), exc.status, str(exc), exc.retry_after)
    if isinstance(exc, TimeoutError):
        return Failure(True, None, "timed out")
    return None


def run(call: Flaky, sleeps: Sleeps, attempts: int = 4, secrets: tuple[str, ...] = ()) -> str:
    policy = RetryPolicy(max_attempts=attempts, base_delay_s=1.0, max_delay_s=8.0, sleep=sleeps, uniform=lambda: 0.5)
    return call_with_retries(call, provider="openai", model="m", policy=policy, classify=classify, secrets=secrets)


def test_backoff_doubles_is_capped_and_jitter_stays_within_half_to_full():
    low = RetryPolicy(base_delay_s=1.0, max_delay_s=5.0, uniform=lambda: 0.0)
    high = RetryPolicy(base_delay_s=1.0, max_delay_s=5.0, uniform=lambda: 0.999999)

    assert [low.delay(n, None) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 2.5, 2.5]
    assert [round(high.delay(n, None), 3) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]


def test_retry_after_is_a_floor_and_is_capped():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=5.0, max_retry_after_s=30.0, uniform=lambda: 0.0)

    assert policy.delay(1, 7.0) == 7.0
    assert policy.delay(4, 0.1) == 2.5  # backoff larger than what the server asked
    assert policy.delay(1, 3600.0) == 30.0


def test_retry_after_headers_in_seconds_milliseconds_and_http_dates():
    soon = email.utils.formatdate(time.time() + 60, usegmt=True)

    assert parse_retry_after({"retry-after": "2"}) == 2.0
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert 55 < (parse_retry_after({"retry-after": soon}) or 0) <= 60
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({"retry-after-ms": "x"}) is None
    assert parse_retry_after({}) is None
    assert parse_retry_after(None) is None


def test_transient_failures_are_retried_until_success():
    sleeps = Sleeps()
    call = Flaky(Status(503), TimeoutError(), Status(429, retry_after=3.0))

    assert run(call, sleeps) == "ok"
    assert call.calls == 4
    assert sleeps == [0.75, 1.5, 3.0]


def test_the_last_attempt_raises_a_provider_error_with_status_and_attempts():
    sleeps = Sleeps()

    with pytest.raises(ProviderError) as caught:
        run(Flaky(*[Status(502)] * 4), sleeps)

    error = caught.value
    assert (error.provider, error.model, error.status, error.attempts) == ("openai", "m", 502, 4)
    assert str(error).startswith("openai model 'm': still failing after 4 attempts (HTTP 502: boom)")
    assert "FORKQ_PROVIDER_MAX_ATTEMPTS" in str(error)
    assert isinstance(error.__cause__, Status)
    assert len(sleeps) == 3


def test_a_non_retryable_status_fails_at_once():
    sleeps = Sleeps()

    with pytest.raises(ProviderError, match=r"non-retryable error after 1 attempt \(HTTP 404: boom\); check the model"):
        run(Flaky(Status(404)), sleeps)
    assert sleeps == []


def test_an_exception_the_adapter_does_not_recognise_propagates_unwrapped():
    with pytest.raises(KeyError):
        run(Flaky(KeyError("bug")), Sleeps())


def test_secrets_are_scrubbed_and_a_leaking_cause_is_not_chained():
    with pytest.raises(ProviderError) as caught:
        run(Flaky(Status(401, text="bad key sk-SECRET-1 given")), Sleeps(), secrets=("sk-SECRET-1",))

    assert "sk-SECRET-1" not in str(caught.value)
    assert "bad key *** given" in str(caught.value)
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__


def test_scrub_shortens_long_details():
    assert len(scrub("x" * 1000, ())) == 300
    assert scrub("a\n  b", ("",)) == "a b"

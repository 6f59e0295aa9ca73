"""A worker process's side of admission on a real Redis: its coordinator wakes many waiting threads, two
processes share one limit, a waiting fork can stop, the token estimate, and the providers' shared cooldown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from broker_config.settings import Settings
from tests.conftest import TEST_NAMESPACE
from tests.live import wait_until
from workers.base.keys import Keys
from workers.history.messages import Content, Part
from workers.loop.child import Stopped, StopReason
from workers.providers import ModelRequest, TokenUsage
from workers.service.admission import DEFAULT_OUTPUT_TOKENS, Admission, AdmissionGuard, SharedCooldown, estimate
from workers.service.metrics import Metrics
from workers.store.admission import AdmissionStore

MODEL = "gpt-4.1-mini"
ENDPOINT = "http://127.0.0.1:9/v1"


def request(fork_id: str = "f-1", model: str = MODEL, text: str = "hello", **generation: int) -> ModelRequest:
    messages = [Content(role="user", parts=[Part(text=text)])]
    return ModelRequest(
        fork_id=fork_id,
        step=0,
        model=model,
        system_instruction=None,
        tools=[],
        messages=messages,
        generation=generation,
    )


@pytest.fixture
def make_admission(
    redis_client: redis.Redis, make_settings: Callable[..., Settings]
) -> Iterator[Callable[..., Admission]]:
    """Build a process's `Admission` (its presence token, FORKQ_MODEL_LIMITS); coordinators stop after the test."""
    made: list[Admission] = []

    def make(token: str, limits: dict[str, dict[str, int]]) -> Admission:
        settings = make_settings(model_limits=limits, heartbeat_s=1.0, lease_ttl_s=10.0)
        store = AdmissionStore(redis_client, Keys(TEST_NAMESPACE), token=token, hold_ttl_ms=10_000, alive_ttl_ms=10_000)
        admission = Admission(store, settings, Metrics(), lambda model: ENDPOINT)
        made.append(admission)
        return admission

    yield make
    for admission in made:
        admission.close()


def guard(admission: Admission, fork_id: str, stop: Callable[[], None] = lambda: None) -> AdmissionGuard:
    return AdmissionGuard(admission, fork_id=fork_id, session="s-1", epoch=1, owner="w", stop_if_asked=stop)


def run_calls(admissions: list[Admission], calls: int, hold_s: float) -> int:
    """`calls` threads spread over the processes, each entering, holding, leaving; the most in flight at once."""
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def call(i: int) -> None:
        one, made = guard(admissions[i % len(admissions)], f"f-{i}"), request(f"f-{i}")
        one.enter(made)
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(hold_s)  # the model's time
        with lock:
            state["now"] -= 1
        one.leave(made, TokenUsage(input_tokens=5, output_tokens=5))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return state["most"]


def test_forty_waiting_threads_of_one_process_are_woken_in_turn_and_never_exceed_the_limit(
    make_admission: Callable[..., Admission],
) -> None:
    admission = make_admission("host:1:aaaa", {"gpt-*": {"concurrency": 3}})

    most = run_calls([admission], calls=40, hold_s=0.02)

    assert most == 3
    wait_until(lambda: admission.store.holds(MODEL) == [] == admission.store.queued(MODEL), 5, "the last releases")
    registry = admission.metrics.registry
    assert registry.get_sample_value("forkq_model_wait_seconds_count", {"model": MODEL}) == 40
    assert registry.get_sample_value("forkq_model_waiting", {"model": MODEL}) == 0


def test_two_processes_share_one_limit(make_admission: Callable[..., Admission]) -> None:
    limits = {MODEL: {"concurrency": 2}}
    processes = [make_admission("host:1:aaaa", limits), make_admission("host:2:bbbb", limits)]

    assert run_calls(processes, calls=24, hold_s=0.03) == 2


def test_a_model_without_limits_is_not_admitted_at_all(make_admission: Callable[..., Admission]) -> None:
    admission = make_admission("host:1:aaaa", {"gpt-*": {"concurrency": 1}})

    assert guard(admission, "f-1").enter(request(model="gemini-2.5-pro")) == 0.0
    assert admission.store.holds("gemini-2.5-pro") == []


def test_a_waiting_fork_that_must_stop_gives_its_place_up(make_admission: Callable[..., Admission]) -> None:
    admission = make_admission("host:1:aaaa", {MODEL: {"concurrency": 1}})
    holder = guard(admission, "f-holder")
    holder.enter(request("f-holder"))
    cancelled = threading.Event()
    outcome: list[Stopped] = []

    def stop() -> None:
        if cancelled.is_set():
            raise Stopped(StopReason.CANCELLED)

    def enter() -> None:
        try:
            guard(admission, "f-waiting", stop).enter(request("f-waiting"))
        except Stopped as stopped:
            outcome.append(stopped)

    thread = threading.Thread(target=enter)
    thread.start()
    wait_until(lambda: len(admission.store.queued(MODEL)) == 1, 5, "the call to queue")

    cancelled.set()
    thread.join(timeout=5)

    assert [s.reason for s in outcome] == [StopReason.CANCELLED]
    wait_until(lambda: admission.store.queued(MODEL) == [], 5, "the stopped call to leave the queue")
    holder.leave(request("f-holder"), None)
    wait_until(lambda: admission.store.holds(MODEL) == [], 5, "the holder's release")


def test_the_estimate_is_a_quarter_of_the_requests_characters_and_its_max_output_tokens() -> None:
    small, large = request(text="x"), request(text="x" * 4000)

    assert estimate(small) < DEFAULT_OUTPUT_TOKENS + 30
    assert estimate(large) - estimate(small) in (999, 1000)
    assert estimate(request(text="x", max_output_tokens=50)) == estimate(small) - DEFAULT_OUTPUT_TOKENS + 50


def test_a_429_reported_by_one_process_holds_the_retries_of_another(make_admission: Callable[..., Admission]) -> None:
    limits: dict[str, dict[str, int]] = {MODEL: {}}
    reporter = SharedCooldown(make_admission("host:1:aaaa", limits))
    other = SharedCooldown(make_admission("host:2:bbbb", limits))

    reporter.throttled(ENDPOINT, MODEL, 0.5)
    started = time.monotonic()
    other.wait(ENDPOINT, MODEL, attempt=2)  # a retry reads the shared cooldown
    waited = time.monotonic() - started

    assert 0.35 <= waited <= 2.0
    other.wait("https://elsewhere/v1", MODEL, attempt=2)  # another endpoint is not cooling
    assert time.monotonic() - started - waited < 0.1


def test_a_calls_release_costs_its_forks_thread_no_round_trip_and_is_sent_soon_after(
    make_admission: Callable[..., Admission], redis_client: redis.Redis
) -> None:
    admission = make_admission("host:1:aaaa", {MODEL: {"concurrency": 1, "tpm": 100_000}})
    holder, made = guard(admission, "f-1"), request("f-1")
    holder.enter(made)
    redis_client.client_pause(1000, all=False)  # writes (scripts) wait a second: a release sent here would too

    started = time.monotonic()
    holder.leave(made, TokenUsage(input_tokens=7, output_tokens=3))
    left = time.monotonic() - started

    assert left < 0.2
    wait_until(lambda: admission.store.holds(MODEL) == [], 5, "the release, sent by the coordinator")
    tokens = redis_client.hgetall(Keys(TEST_NAMESPACE).admission(MODEL)[5])
    assert tokens[b"_sum"] == b"10"  # settled with the reported usage


def test_a_release_after_close_is_sent_by_its_own_thread(make_admission: Callable[..., Admission]) -> None:
    admission = make_admission("host:1:aaaa", {MODEL: {"concurrency": 1}})
    holder, made = guard(admission, "f-1"), request("f-1")
    holder.enter(made)
    admission.close()

    holder.leave(made, None)

    assert admission.store.holds(MODEL) == []


def test_a_session_weight_applies_to_the_session_of_every_tenant_that_uses_its_id(
    redis_client: redis.Redis, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(session_weights={"s-urgent": 3})
    store = AdmissionStore(redis_client, Keys(TEST_NAMESPACE), token="t:1:1", hold_ttl_ms=1, alive_ttl_ms=1)
    admission = Admission(store, settings, Metrics(), lambda model: ENDPOINT)

    # a record's session is its scope: the id itself for `default`, `<id> @<tenant>` for another tenant
    assert admission.weight("s-urgent") == admission.weight("s-urgent @acme") == 3.0
    assert admission.weight("s-other @acme") == 1.0

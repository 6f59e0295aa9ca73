"""A session cancel (workers/store/sessions.py, `ForkClient.cancel_session`) on a real Redis, without workers: its
tombstone refuses launches into the session atomically and writes nothing of them; every fork of the session is
cancelled in batches and counted; a succeeded fork of it is not continued by a message; another session is
untouched."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import redis

from broker_config.settings import Settings
from tests.api_support import no_keys_written
from tests.store.test_forks import finished
from workers.client import ForkClient
from workers.errors import SessionCancelled
from workers.records.fork import Status
from workers.store import sessions
from workers.store.forks import ForkStore
from workers.store.replies import SendReply

FORK = {"description": "audit", "prompt": "Audit the limiter.", "subagent_type": "fork", "fork_turns": "1"}
TEAMMATE = {"description": "review", "prompt": "Review it.", "subagent_type": "general-purpose", "name": "ann"}


def in_session(parent: dict[str, Any], session: str) -> dict[str, Any]:
    return {**copy.deepcopy(parent), "session_id": session, "approval_mode": "yolo"}


@pytest.fixture
def tombstone_client(make_settings: Callable[..., Settings]) -> Any:
    with ForkClient(make_settings(session_tombstone_s=120, workspace="shared")) as client:
        yield client


def test_a_session_cancel_cancels_every_fork_of_the_session_and_counts_those_that_had_ended(
    tombstone_client: ForkClient, parent: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a session of five queued forks, one of them cancelled already, and another session's fork; batches of 2
    monkeypatch.setattr(sessions, "BATCH", 2)
    client = tombstone_client
    forks = [client.launch(in_session(parent, "s-one"), FORK).fork_id for _ in range(5)]
    client.cancel(forks[1])
    other = client.launch(in_session(parent, "s-two"), FORK).fork_id

    # When the session is cancelled, twice
    first = client.cancel_session("s-one")
    again = client.cancel_session("s-one")

    # Then the four live forks were cancelled (oldest first), the ended one counted apart; then none is left
    assert first.session == "s-one" and first.forks == [forks[0], *forks[2:]]
    assert (first.cancelled, first.already_ended) == (4, 1)
    assert (again.cancelled, again.forks, again.already_ended) == (0, [], 5)
    assert again.refused_until_ms >= first.refused_until_ms
    assert {client.status(fid).status for fid in forks} == {Status.CANCELLED}
    assert client.status(other).status is Status.QUEUED
    result = client.result(forks[0])
    assert result is not None and result.status is Status.CANCELLED and result.usage.model_calls == 0


def test_a_launch_into_a_cancelled_session_is_refused_naming_it_and_writes_nothing(
    tombstone_client: ForkClient, parent: dict[str, Any], redis_client: redis.Redis
) -> None:
    # Given a cancelled session (of one fork)
    client = tombstone_client
    client.launch(in_session(parent, "s-gone"), FORK)
    outcome = client.cancel_session("s-gone")
    unchanged = no_keys_written(redis_client)

    # When a fork and a named teammate are launched into it
    with pytest.raises(SessionCancelled) as fork_refused:
        client.launch(in_session(parent, "s-gone"), FORK)
    with pytest.raises(SessionCancelled):
        client.launch(in_session(parent, "s-gone"), TEAMMATE)

    # Then both are refused with the session, until when, and the fix; nothing was written, not even the name
    unchanged()
    error = fork_refused.value
    assert error.session == "s-gone" and error.until_ms == outcome.refused_until_ms and error.field == "session_id"
    assert "'s-gone' was cancelled" in str(error) and "new session id" in str(error)
    assert "FORKQ_SESSION_TOMBSTONE_S" in str(error)
    assert client.store.teammate("s-gone", "ann") is None


def test_the_tombstone_lasts_the_setting_and_another_session_still_launches(
    tombstone_client: ForkClient, parent: dict[str, Any], redis_client: redis.Redis
) -> None:
    # Given a cancelled session with no fork at all
    client = tombstone_client
    outcome = client.cancel_session("s-empty")

    # When another session launches
    launched = client.launch(in_session(parent, "s-alive"), TEAMMATE)

    # Then the other session's launch went through, and the tombstone expires within FORKQ_SESSION_TOMBSTONE_S
    assert (outcome.cancelled, outcome.already_ended) == (0, 0)
    assert client.status(launched.fork_id).status is Status.QUEUED
    ttl_ms = int(redis_client.pttl(client.store.keys.session_cancelled("s-empty")))
    assert 0 < ttl_ms <= 120_000
    assert redis_client.ttl(client.store.keys.session_cancelled("s-alive")) == -2


def test_a_retried_launch_of_a_fork_written_before_the_cancel_is_not_refused(
    tombstone_client: ForkClient, parent: dict[str, Any]
) -> None:
    # Given a fork launched into a session, then the session cancelled
    client = tombstone_client
    handle = client.launch(in_session(parent, "s-retry"), FORK)
    client.cancel_session("s-retry")
    record = client.store.get_record(handle.fork_id, handle.digest)

    # When its launch is written again (a launch retried after a lost reply): it had landed before the cancel
    client.store.put_launch(record, *record.encode())

    # Then it is found as it was: cancelled
    assert client.status(handle.fork_id).status is Status.CANCELLED


def test_a_message_does_not_continue_a_succeeded_fork_of_a_cancelled_session(
    tombstone_client: ForkClient, parent: dict[str, Any], redis_client: redis.Redis
) -> None:
    # Given a succeeded fork of a session that is then cancelled, and a succeeded fork of another session
    client = tombstone_client
    done = client.launch(in_session(parent, "s-done"), FORK).fork_id
    elsewhere = client.launch(in_session(parent, "s-live"), FORK).fork_id
    for fork_id in (done, elsewhere):
        finished(client.store, fork_id)
    outcome = client.cancel_session("s-done")
    unchanged = no_keys_written(redis_client)

    # When each gets a message, which would continue it
    with pytest.raises(SessionCancelled) as refused:
        client.send(done, "And the tests?")
    unchanged()
    sent = client.send(elsewhere, "And the tests?")

    # Then the cancelled session's fork stays as it ended, untouched; the other one is continued
    assert (outcome.cancelled, outcome.already_ended) == (0, 1)
    assert refused.value.session == "s-done" and refused.value.fork_id == done
    assert client.status(done).status is Status.SUCCEEDED
    assert sent.outcome is SendReply.CONTINUED and client.status(elsewhere).status is Status.QUEUED


@pytest.mark.parametrize("session", ["has space", "{brace}", "x" * 201])
def test_a_session_cancel_of_an_invalid_session_id_is_refused_before_anything_is_written(
    tombstone_client: ForkClient, session: str, redis_client: redis.Redis
) -> None:
    unchanged = no_keys_written(redis_client)

    with pytest.raises(ValueError, match="parent session id"):
        tombstone_client.cancel_session(session)

    unchanged()


def test_a_session_of_a_thousand_forks_is_cancelled_in_a_few_round_trips_not_one_per_fork(
    make_queued_fork: Callable[..., tuple[str, str]],
    fork_store: ForkStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given 1,000 queued forks of one session, and every round trip to Redis counted (redis-py's one send per
    # command, or per pipeline)
    forks = [make_queued_fork()[0] for _ in range(1000)]
    sent = []
    real_send = redis.connection.Connection.send_packed_command

    def counted(self: redis.connection.Connection, command: Any, check_health: bool = True) -> None:
        sent.append(1)
        real_send(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)

    # When the session is cancelled
    outcome, _ = sessions.cancel_session(fork_store, "s-unit", tombstone_s=60)

    # Then all were cancelled: the tombstone, then per batch of 200 one read of the index and three pipelines
    monkeypatch.undo()
    assert outcome.cancelled == 1000 and set(outcome.forks) == set(forks)
    assert len(sent) <= 1 + 5 * 4 + 2 * 2  # and, in a Redis that lacks them, each of 2 scripts loaded and sent again
    assert {fork_store.state(fid).status for fid in forks[::97]} == {Status.CANCELLED}

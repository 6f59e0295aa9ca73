"""`GET /v1/forks/{id}/events`: Server-Sent Events from the fork's Redis stream, resumed with Last-Event-ID.

Against uvicorn serving the API, the private Redis and live workers; httpx reads the streams.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from celery.worker import WorkController

from tests.api_support import FORK, TOKEN, Api, sse
from tests.cli_support import call, step
from workers.client import ForkClient

LISTING = [step(call(f"l{i}", "list_directory"), delay_s=0.05) for i in range(4)] + [step("listed")]


def launch(http: httpx.Client, parent: dict[str, Any]) -> str:
    response = http.post("/v1/forks", json={"parent": parent, "agent": FORK})
    assert response.status_code == 202, response.text
    return str(response.json()["fork_id"])


def events_only(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return [m for m in messages if "comment" not in m]


def test_a_stream_resumed_on_another_server_with_last_event_id_has_every_event_once_and_ends_after_finished(
    http: httpx.Client,
    serve_api: Callable[..., Api],
    client: ForkClient,
    scripted_worker: Callable[..., WorkController],
    parent: dict[str, Any],
) -> None:
    # Given a fork whose run writes a dozen events or more
    scripted_worker(LISTING)
    fork_id = launch(http, parent)

    # When a client reads three events, drops the connection, and reconnects to another server with the last id
    with sse(http, f"/v1/forks/{fork_id}/events") as messages:
        head = [m for m, _ in zip((m for m in messages if "comment" not in m), range(3), strict=False)]
    with (
        serve_api().client() as other,
        sse(other, f"/v1/forks/{fork_id}/events", **{"Last-Event-ID": head[-1]["id"]}) as messages,
    ):
        tail = events_only(list(messages))  # to the end: the server ends the stream

    # Then the two parts are the fork's whole stream, in order, nothing twice, nothing missing
    stored = list(client.events(fork_id))
    seen = head + tail
    assert [m["id"] for m in seen] == [e.id for e in stored]
    assert [m["event"] for m in seen] == [e.type for e in stored]
    assert [json.loads(m["data"]) for m in seen] == [e.wire_data() for e in stored]
    assert seen[-1]["event"] == "finished" and seen[0]["event"] == "queued"
    assert len(stored) > 10 and "tool" in [e.type for e in stored]


def test_an_idle_stream_sends_keep_alives_and_ends_with_the_finished_event_of_a_cancel(
    serve_api: Callable[..., Api], parent: dict[str, Any]
) -> None:
    api = serve_api(api_keepalive_s=0.2)
    with api.client() as http:
        fork_id = launch(http, parent)  # no worker: nothing happens until the cancel
        with sse(http, f"/v1/forks/{fork_id}/events") as messages:
            got = [next(messages)]
            while "comment" not in got[-1]:
                got.append(next(messages))
            got.append(next(messages))  # a second keep-alive, a keep-alive interval later
            http.post(f"/v1/forks/{fork_id}/cancel")
            got += list(messages)

    assert got[0]["event"] == "queued"
    assert {"comment": "keep-alive"} in got
    assert events_only(got)[-1]["event"] == "finished"
    assert '"status":"cancelled"' in events_only(got)[-1]["data"]


def test_resuming_after_the_finished_event_ends_the_stream_at_once(
    http: httpx.Client, client: ForkClient, parent: dict[str, Any]
) -> None:
    fork_id = launch(http, parent)
    http.post(f"/v1/forks/{fork_id}/cancel")
    finished = list(client.events(fork_id))[-1]

    started = time.monotonic()
    with sse(http, f"/v1/forks/{fork_id}/events", **{"Last-Event-ID": finished.id}) as messages:
        rest = list(messages)

    assert finished.type == "finished"
    assert rest == [] and time.monotonic() - started < 2


@pytest.mark.parametrize("last_id", ["abc", "1-2-3", "-1", "1" * 21 + "-0"])
def test_a_last_event_id_that_is_no_stream_id_is_refused_with_422(
    http: httpx.Client, parent: dict[str, Any], last_id: str
) -> None:
    fork_id = launch(http, parent)

    response = http.get(f"/v1/forks/{fork_id}/events", headers={"Last-Event-ID": last_id})

    assert response.status_code == 422
    assert response.json()["error"]["field"] == "Last-Event-ID"


STREAMS = 1000


async def follow_raw(api: Api, fork_id: str, launched: Callable[[], None]) -> list[str]:
    """Follow a fork's events over a plain socket (httpx would cost more than the server here): their types."""
    host, port = api.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    request = f"GET /v1/forks/{fork_id}/events HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    writer.write(request.encode())
    types: list[str] = []
    async for line in reader:
        if line.startswith(b"event: "):
            types.append(line.decode().removeprefix("event: ").strip())
            if types[-1] == "queued":
                launched()
        if line.strip() == b"0":  # the last chunk: the server ended the response
            break
    writer.close()
    return types


def test_a_thousand_streams_wait_in_one_process_without_a_thread_each_and_all_see_the_end(
    serve_api: Callable[..., Api], parent: dict[str, Any]
) -> None:
    # Given one queued fork and a thousand clients following its events
    api = serve_api()
    with api.client() as http:
        fork_id = launch(http, parent)
    threads_before = threading.active_count()

    async def main() -> tuple[list[list[str]], int]:
        ready, followers = asyncio.Event(), [0]

        def launched() -> None:
            followers[0] += 1
            if followers[0] == STREAMS:
                ready.set()

        tasks = [asyncio.create_task(follow_raw(api, fork_id, launched)) for _ in range(STREAMS)]
        await asyncio.wait_for(ready.wait(), 60)
        threads_waiting = threading.active_count()
        # When the fork is cancelled
        async with api.async_client() as client:
            assert (await client.post(f"/v1/forks/{fork_id}/cancel")).json()["status"] == "cancelled"
        return await asyncio.wait_for(asyncio.gather(*tasks), 60), threads_waiting

    streams, threads_waiting = asyncio.run(main())

    # Then every stream saw the launch and the end, while the server held no thread per stream
    assert streams == [["queued", "finished"]] * STREAMS
    assert threads_waiting - threads_before < 10

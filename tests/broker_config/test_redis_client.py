"""redis_client and async_redis_client: FORKQ_REDIS_URL direct or through a real Redis Sentinel; a broker found by
Sentinel runs forks."""

from __future__ import annotations

import asyncio
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from celery import Celery
from celery.worker import WorkController
from redis.sentinel import MasterNotFoundError

from broker_config.redis_client import QUIET_CHECK_S, async_redis_client, close_async_client, redis_client
from broker_config.settings import Settings
from tests.live import wait_until
from workers.app import make_app
from workers.base.keys import Keys
from workers.client import ForkClient
from workers.demo.redis_server import RedisServer
from workers.records.fork import Status

FORK = {"description": "d", "prompt": "Summarise the session.", "subagent_type": "fork", "fork_turns": "1"}


@dataclass
class SentinelNode:
    """A `redis-server --sentinel` process watching one primary under the name `master`."""

    port: int
    master: str
    process: subprocess.Popen[bytes]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def start_sentinel(redis_executable: str, tmp_path: Path) -> Iterator[Callable[..., SentinelNode]]:
    """Start Sentinel nodes (stopped after the test) that watch a primary on 127.0.0.1."""
    nodes: list[SentinelNode] = []

    def start(
        primary_port: int, *, master: str = "forkq-primary", auth_pass: str = "", requirepass: str = ""
    ) -> SentinelNode:
        port = free_port()
        config = tmp_path / f"sentinel-{port}.conf"  # Sentinel rewrites its config file: one per node
        lines = [
            "bind 127.0.0.1",
            f"port {port}",
            f"dir {tmp_path}",
            f"sentinel monitor {master} 127.0.0.1 {primary_port} 1",
        ]
        lines += [f"sentinel auth-pass {master} {auth_pass}"] if auth_pass else []
        lines += [f"requirepass {requirepass}"] if requirepass else []
        config.write_text("\n".join(lines) + "\n")
        log = (tmp_path / f"sentinel-{port}.log").open("wb")
        process = subprocess.Popen([redis_executable, str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        node = SentinelNode(port, master, process)
        nodes.append(node)
        with redis.Redis(port=port, password=requirepass or None, socket_timeout=1) as probe:

            def log() -> str:
                return (tmp_path / f"sentinel-{port}.log").read_text()

            def answers() -> bool:
                try:
                    return bool(probe.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", master))
                except redis.ConnectionError:
                    if process.poll() is not None:
                        pytest.fail(f"Sentinel on port {port} exited: {log()}")
                    return False

            wait_until(answers, 10, lambda: f"Sentinel on port {port} to start: {log()}")
            return node

    yield start
    for node in nodes:
        node.process.terminate()
        node.process.wait(10)


def test_a_plain_redis_url_is_opened_with_the_given_options(redis_url: str) -> None:
    with redis_client(Settings(redis_url=redis_url), socket_timeout=2) as client:
        assert client.ping()
        assert client.connection_pool.connection_kwargs["socket_timeout"] == 2


def test_a_sized_pool_makes_a_command_wait_for_a_free_connection_instead_of_failing(redis_url: str) -> None:
    # Given a client whose pool has one connection, held by a thread blocked in BLPOP for a second
    with redis_client(Settings(redis_url=redis_url), max_connections=1, pool_timeout_s=10) as client:
        # Then another thread's command waits for that connection instead of raising at once
        assert _waited_for_the_held_connection(client, redis_url) > 0.2


def _waited_for_the_held_connection(client: redis.Redis, observed_url: str) -> float:
    """Seconds a PING waited while a thread held the client's one connection in a 1 s BLPOP."""
    blocked = threading.Thread(target=client.blpop, args=(["forkq-test-nothing"], 1))
    blocked.start()
    with redis.Redis.from_url(observed_url) as observer:
        blocking = lambda: any(c.get("cmd") == "blpop" for c in observer.client_list())  # noqa: E731
        wait_until(blocking, 10, "the BLPOP to hold the connection")
    try:
        started = time.monotonic()
        assert client.ping()
        return time.monotonic() - started
    finally:
        blocked.join()
        assert client.connection_pool.max_connections == 1


def test_a_sized_sentinel_pool_makes_a_command_wait_for_a_free_connection_instead_of_failing(
    redis_server: RedisServer, redis_url: str, start_sentinel: Callable[..., SentinelNode]
) -> None:
    # Given a client through Sentinel whose pool has one connection, held by a thread blocked in BLPOP
    assert redis_server.port is not None
    node = start_sentinel(redis_server.port)
    settings = Settings(redis_url=f"sentinel://127.0.0.1:{node.port}/0", sentinel_master=node.master)
    with redis_client(settings, max_connections=1, pool_timeout_s=10) as client:
        # Then another thread's command waits for it (redis-py's Sentinel pool raised MaxConnectionsError)
        assert _waited_for_the_held_connection(client, redis_url) > 0.2


def test_a_sentinel_url_reaches_the_primary_that_sentinel_names(
    fresh_redis: RedisServer, start_sentinel: Callable[..., SentinelNode]
) -> None:
    # Given a password-protected primary, watched by two Sentinel nodes under a custom master name
    assert fresh_redis.port is not None
    with redis.Redis.from_url(fresh_redis.url) as admin:
        admin.config_set("requirepass", "pa55-word")
    first = start_sentinel(fresh_redis.port, auth_pass="pa55-word")
    second = start_sentinel(fresh_redis.port, auth_pass="pa55-word")
    url = f"sentinel://:pa55-word@127.0.0.1:{first.port}/2;sentinel://:pa55-word@127.0.0.1:{second.port}/2"
    settings = Settings(redis_url=url, sentinel_master=first.master)

    # When forkq's Redis client writes through the sentinel:// URL
    with redis_client(settings, socket_timeout=3) as client:
        client.set("forkq-sentinel-probe", "yes")

    # Then the write landed on the primary, in the URL's database, with the URL's password
    direct = f"redis://:pa55-word@127.0.0.1:{fresh_redis.port}/2"
    with redis.Redis.from_url(direct) as primary:
        assert primary.get("forkq-sentinel-probe") == b"yes"


# ── the asyncio client of `forkq serve` ───────────────────────────────────────────────────────


async def _async_wait_for_held_connection(client: redis.asyncio.Redis) -> float:
    """Seconds a PING waited while another task held the client's one connection in a 1 s BLPOP."""
    blocked = asyncio.create_task(client.blpop(["forkq-test-nothing"], 1))
    await asyncio.sleep(0.2)  # the BLPOP has the connection
    started = time.monotonic()
    assert await client.ping()
    waited = time.monotonic() - started
    await blocked
    return waited


def test_an_async_client_with_a_sized_pool_makes_a_command_wait_for_a_free_connection(redis_url: str) -> None:
    async def run() -> float:
        client = async_redis_client(Settings(redis_url=redis_url), max_connections=1, pool_timeout_s=10)
        try:
            return await _async_wait_for_held_connection(client)
        finally:
            await close_async_client(client)

    assert asyncio.run(run()) > 0.5


def test_an_async_sentinel_url_reaches_the_primary_that_sentinel_names(
    fresh_redis: RedisServer, start_sentinel: Callable[..., SentinelNode]
) -> None:
    assert fresh_redis.port is not None
    with redis.Redis.from_url(fresh_redis.url) as admin:
        admin.config_set("requirepass", "pa55-word")
    node = start_sentinel(fresh_redis.port, auth_pass="pa55-word")
    settings = Settings(redis_url=f"sentinel://:pa55-word@127.0.0.1:{node.port}/3", sentinel_master=node.master)

    async def run() -> None:
        client = async_redis_client(settings, max_connections=4)
        try:
            await client.set("forkq-async-sentinel-probe", "yes")
        finally:
            await close_async_client(client)

    asyncio.run(run())

    with redis.Redis.from_url(f"redis://:pa55-word@127.0.0.1:{fresh_redis.port}/3") as primary:
        assert primary.get("forkq-async-sentinel-probe") == b"yes"


def test_sentinel_nodes_that_require_a_password_get_forkq_sentinel_password(
    redis_server: RedisServer, redis_url: str, start_sentinel: Callable[..., SentinelNode]
) -> None:
    node = start_sentinel(redis_server.port, requirepass="sentinel-pw")
    url = f"sentinel://127.0.0.1:{node.port}/0"

    with redis_client(Settings(redis_url=url, sentinel_master=node.master, sentinel_password="sentinel-pw")) as client:
        assert client.ping()
    with (
        redis_client(Settings(redis_url=url, sentinel_master=node.master)) as client,
        pytest.raises(MasterNotFoundError, match="AuthenticationError"),
    ):
        client.ping()


@pytest.mark.parametrize("records_too", [False, True], ids=["broker", "broker-and-records"])
def test_a_fork_runs_end_to_end_on_redis_found_by_sentinel(
    *,
    records_too: bool,
    redis_server: RedisServer,
    make_settings: Callable[..., Settings],
    start_sentinel: Callable[..., SentinelNode],
    start_live_worker: Callable[[Celery], WorkController],
    parent: dict[str, Any],
) -> None:
    # Given a URL that lists Sentinel nodes instead of Redis (the second one down: nodes are asked in
    # order, so a node that is down first costs each new connection its retries), for the broker and,
    # in the second case, for forkq's own records too (one URL serves both, as in deploy/)
    node = start_sentinel(redis_server.port)
    url = f"sentinel://127.0.0.1:{node.port}/0;sentinel://127.0.0.1:{free_port()}/0"
    records = {"redis_url": url} if records_too else {}
    settings = make_settings(broker_url=url, sentinel_master=node.master, **records)
    app = make_app(settings)

    # When a fork is launched through the client and a worker consumes the queue
    try:
        with ForkClient(settings, app=app) as client:
            handle = client.launch(parent, FORK)
            start_live_worker(app)
            result = handle.wait(timeout=15)
            record = client.inspect(handle.fork_id)
    finally:
        app.close()

    # Then the job went through the primary Sentinel named, the fork ran, and its records are there
    assert app.conf.broker_transport_options["master_name"] == node.master
    assert result.status is Status.SUCCEEDED, result.error
    assert record["fork_id"] == handle.fork_id
    with redis.Redis(port=redis_server.port) as primary:
        assert primary.exists(Keys(settings.namespace).bootstrap(handle.fork_id)) == 1


class _CountedSocket:
    """A real socket whose mode changes are counted (redis-py's check before each command changes it twice)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.mode_changes = 0

    def settimeout(self, value: float | None) -> None:
        self.mode_changes += 1
        self.sock.settimeout(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def _counted(client: redis.Redis) -> _CountedSocket:
    """The pool's one connection, its socket wrapped to count mode changes."""
    client.ping()
    [conn] = list(client.connection_pool._connections)  # type: ignore[attr-defined]
    counted = _CountedSocket(conn._sock)
    conn._sock = counted
    conn._parser._buffer._sock = counted
    return counted


def test_a_sized_pool_hands_out_a_connection_whose_replies_were_all_read_without_asking_the_socket(
    settings: Settings,
) -> None:
    client = redis_client(settings, max_connections=1)
    counted = _counted(client)

    for i in range(50):
        client.set("k", i)
        assert client.get("k") == str(i).encode()
    with client.pipeline() as pipe:
        pipe.set("k", "p").get("k")
        assert pipe.execute() == [True, b"p"]

    assert counted.mode_changes == 0  # redis-py's own check: two per command
    plain = redis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=1)
    plain_counted = _counted(redis.Redis(connection_pool=plain))
    redis.Redis(connection_pool=plain).get("k")
    assert plain_counted.mode_changes == 2
    client.close()


def test_a_connection_with_a_reply_unread_still_asks_the_socket_and_says_so(settings: Settings) -> None:
    # Given a pooled connection that sent a command and has not read its reply
    client = redis_client(settings, max_connections=1)
    client.set("k", "value")
    conn = client.connection_pool.get_connection()
    raw = conn._sock
    counted = _CountedSocket(raw)
    conn._sock = conn._parser._buffer._sock = counted
    conn.send_command("GET", "k")
    # the reply is waiting on the socket (select on the socket itself leaves the counted wrapper untouched)
    assert select.select([raw], [], [], 10)[0], "no reply arrived within 10 s"

    # Then the check the pool makes asks the socket, and reports the reply waiting (as redis-py's own does)
    assert conn.can_read() is True
    assert counted.mode_changes == 2
    assert conn.read_response() == b"value"
    assert conn.can_read() is False  # every reply read: answered without the socket
    assert counted.mode_changes == 2
    client.connection_pool.release(conn)
    client.close()


def test_a_connection_the_server_closed_while_idle_is_opened_again(settings: Settings, redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    # Given a sized pool's connection, idle past the quiet window, that the server closed
    client = redis_client(settings, max_connections=1)
    client.set("k", "v")
    client.client_setname("quick-check-idle")
    victim = [c["id"] for c in admin.client_list() if c.get("name") == "quick-check-idle"]
    admin.client_kill_filter(_id=victim[0])
    time.sleep(QUIET_CHECK_S + 0.1)  # not a synchronization: idle past the quiet window, what the test is about

    # Then the next command opens a new connection and succeeds (redis-py's check ran: the socket was asked)
    assert client.get("k") == b"v"
    client.close()

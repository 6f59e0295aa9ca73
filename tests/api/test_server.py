"""`forkq serve`: it refuses to start without tokens, refuses `--insecure-no-auth` off loopback, and serves
(here as the installed command, in a subprocess) until SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable

import httpx
import pytest

from broker_config.settings import Settings
from tests.api_support import TOKEN
from tests.cli_support import FORKQ, Run
from tests.live import wait_until
from workers.api.server import is_loopback


def test_serve_without_tokens_refuses_to_start_with_exit_2_naming_the_setting(forkq: Run) -> None:
    code, out, err = forkq("serve", "--port", "8711")

    assert (code, out) == (2, "")
    assert err.startswith("forkq serve: forkq serve refuses to start: no API token is configured")
    assert "FORKQ_API_TOKENS" in err and "--insecure-no-auth" in err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com", "127.0.0.1.example.com"])
def test_serve_refuses_insecure_no_auth_on_a_host_that_is_not_loopback(forkq: Run, host: str) -> None:
    code, _, err = forkq("serve", "--insecure-no-auth", "--host", host)

    assert code == 2
    assert f"refuses --insecure-no-auth on host {host!r}" in err and "FORKQ_API_TOKENS" in err


def test_serve_refuses_tokens_and_insecure_no_auth_together(forkq: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKQ_API_TOKENS", TOKEN)

    code, _, err = forkq("serve", "--insecure-no-auth")

    assert code == 2 and "FORKQ_API_TOKENS is set and --insecure-no-auth was given" in err and TOKEN not in err


@pytest.mark.parametrize("port", ["0", "65536", "http", "-1"])
def test_serve_refuses_a_port_that_is_not_one(forkq: Run, port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        forkq("serve", "--port", port)

    assert exited.value.code == 2 and "is not a TCP port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("localhost.example", False),
    ],
)
def test_loopback_hosts_are_the_loopback_addresses_and_localhost(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_installed_forkq_serve_answers_and_stops_on_sigterm(
    forkq_env: Settings, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    # Given `forkq serve` started as an operator would, with a token
    fork_id, _ = make_queued_fork()
    port = free_port()
    env = {
        **os.environ,
        "FORKQ_REDIS_URL": forkq_env.redis_url,
        "FORKQ_NAMESPACE": forkq_env.namespace,
        "FORKQ_API_TOKENS": TOKEN,
    }
    server = subprocess.Popen(
        [FORKQ, "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def healthz() -> httpx.Response | None:
            try:
                return httpx.get(f"{base}/healthz", timeout=2)
            except httpx.TransportError:
                assert server.poll() is None, "forkq serve exited before it served"
                return None

        health = wait_until(healthz, 20, "forkq serve to start")

        # Then it serves the fork's state to a caller with the token, and stops cleanly on SIGTERM
        state = httpx.get(f"{base}/v1/forks/{fork_id}", headers={"Authorization": f"Bearer {TOKEN}"})
        assert health.json()["ok"] is True
        assert state.status_code == 200 and state.json()["status"] == "queued"
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=20)[0].decode()
    assert server.returncode == 0, output

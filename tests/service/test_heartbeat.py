"""The worker heartbeat file and `forkq check --worker`, the worker probe."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery
from celery.worker import WorkController

from broker_config.settings import Settings
from tests.live import wait_until
from workers.app import make_app
from workers.cli import main
from workers.service.heartbeat import Heartbeat, heartbeat_problem, write_heartbeat


def test_a_fresh_heartbeat_is_no_problem(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    write_heartbeat(path, "w1@host")

    assert heartbeat_problem(path, interval_s=5) is None
    assert json.loads(path.read_text())["hostname"] == "w1@host"


def test_a_missing_heartbeat_says_which_file_and_what_to_start(tmp_path: Path) -> None:
    problem = heartbeat_problem(tmp_path / "nope", interval_s=5)

    assert problem is not None
    assert str(tmp_path / "nope") in problem and "forkq worker" in problem and "FORKQ_HEARTBEAT_FILE" in problem


def test_a_heartbeat_older_than_three_intervals_names_its_writer_and_age(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    write_heartbeat(path, "w1@host")
    old = time.time() - 16
    os.utime(path, (old, old))

    problem = heartbeat_problem(path, interval_s=5)

    assert problem is not None
    assert "16 s old, over 15 s" in problem and "w1@host" in problem and "restart" in problem
    assert heartbeat_problem(path, interval_s=6) is None  # 18 s allowed


def test_an_unwritable_heartbeat_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    Heartbeat(tmp_path / "missing-dir" / "hb", 1.0, "w1").beat()

    assert "not written" in caplog.text


# ── the worker writes it; `forkq check --worker` reads it ───────────────────────────────────


@pytest.fixture
def settings(make_settings: Callable[..., Settings], tmp_path: Path) -> Settings:
    """Fast heartbeats into a file of this test."""
    return make_settings(heartbeat_s=0.2, lease_ttl_s=1.0, heartbeat_file=tmp_path / "worker.heartbeat")


def check_worker(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    for name, value in {
        "FORKQ_REDIS_URL": settings.redis_url,
        "FORKQ_HEARTBEAT_S": str(settings.heartbeat_s),
        "FORKQ_LEASE_TTL_S": str(settings.lease_ttl_s),
        "FORKQ_HEARTBEAT_FILE": str(settings.heartbeat_file),
    }.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = main(["check", "--worker"])
    out, err = capsys.readouterr()
    return code, out + err


def test_check_worker_fails_without_a_worker_and_passes_while_one_runs(
    settings: Settings,
    start_live_worker: Callable[[Celery], WorkController],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given no worker has run: the probe fails and says what to fix
    code, output = check_worker(settings, monkeypatch, capsys)
    assert code == 1
    assert "no worker heartbeat" in output and str(settings.heartbeat_file) in output

    # When a worker runs, its event loop rewrites the file every FORKQ_HEARTBEAT_S
    app = make_app(settings)
    start_live_worker(app)
    wait_until(settings.heartbeat_file.exists, timeout=10, what="the first heartbeat")
    first = settings.heartbeat_file.stat().st_mtime_ns
    wait_until(lambda: settings.heartbeat_file.stat().st_mtime_ns > first, timeout=10, what="a second heartbeat")

    # Then the probe passes
    code, output = check_worker(settings, monkeypatch, capsys)
    assert code == 0, output
    assert "worker heartbeat" in output
    app.close()


def test_check_without_worker_ignores_the_heartbeat(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FORKQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("FORKQ_HEARTBEAT_FILE", str(settings.heartbeat_file))

    assert main(["check"]) == 0

"""workers.cli_args: every value the `forkq` command takes is checked by argparse, which exits 2 naming the option.

Each command runs in-process against the private Redis (the `forkq` fixture); a refused argument never
reaches a command, so nothing is read from or written to Redis and no worker starts.
"""

from __future__ import annotations

import pytest
import redis

from tests.cli_support import Run
from workers.cli_args import build_parser


def refused(forkq: Run, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run `forkq ARGV`, which argparse must refuse with exit 2; its stderr."""
    with pytest.raises(SystemExit) as exited:
        forkq(*argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf", "1e999", "-1", "soon", ""])
def test_a_wait_timeout_that_is_not_a_finite_number_of_seconds_exits_2_naming_the_option(
    forkq: Run, capsys: pytest.CaptureFixture[str], redis_client: redis.Redis, timeout: str
) -> None:
    err = refused(forkq, capsys, "result", "f-1", "--wait", f"--timeout={timeout}")

    assert "argument --timeout: " in err and "is not a finite number of seconds, 0 or more" in err
    assert "Traceback" not in err
    assert redis_client.dbsize() == 0


@pytest.mark.parametrize("concurrency", ["0", "-3", "1.5", "many", "9" * 5000, "٣"])
def test_a_worker_concurrency_that_is_not_a_positive_whole_number_exits_2_before_anything_starts(
    forkq: Run, capsys: pytest.CaptureFixture[str], concurrency: str
) -> None:
    err = refused(forkq, capsys, "worker", f"--concurrency={concurrency}")

    assert "argument --concurrency: " in err and "is not a positive whole number" in err
    assert len(err) < 500


def test_an_unknown_worker_log_level_exits_2_naming_the_choices(forkq: Run, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(forkq, capsys, "worker", "--loglevel", "chatty")

    assert "argument --loglevel: invalid choice: 'CHATTY'" in err and "'DEBUG', 'INFO'" in err


@pytest.mark.parametrize("command", ["status", "result", "events", "inspect", "cancel", "resume"])
@pytest.mark.parametrize("fork_id", ["../x", "f-1/../../etc", "a b", "{f-1}", "", "f-\udcff", "x" * 129])
def test_a_fork_id_that_is_not_one_exits_2_naming_the_argument(
    forkq: Run, capsys: pytest.CaptureFixture[str], command: str, fork_id: str
) -> None:
    err = refused(forkq, capsys, command, fork_id)

    assert "argument fork_id: " in err and "is not a fork id: ids are 1-128 letters, digits" in err
    assert "Traceback" not in err and "ValueError" not in err


@pytest.mark.parametrize("command", ["approve", "deny"])
def test_approve_and_deny_check_the_fork_id_too(forkq: Run, capsys: pytest.CaptureFixture[str], command: str) -> None:
    assert "argument fork_id: " in refused(forkq, capsys, command, "../x", "call-1")


def test_a_denial_reason_with_a_byte_that_is_not_utf8_exits_2_naming_the_option(
    forkq: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(forkq, capsys, "deny", "f-1", "call-1", "--reason", "not \udcff now")

    assert "argument --reason: " in err
    assert "is not valid Unicode text: character 4 is a lone surrogate (U+DCFF, the byte 0xff" in err


def test_valid_values_are_parsed_as_numbers_and_levels() -> None:
    parser = build_parser()

    waited = parser.parse_args(["result", "f-1.a_b", "--wait", "--timeout", "0.5"])
    worker = parser.parse_args(["worker", "--concurrency", "64", "--loglevel", "debug"])

    assert (waited.fork_id, waited.timeout) == ("f-1.a_b", 0.5)
    assert parser.parse_args(["result", "f-1", "--timeout", "0"]).timeout == 0.0
    assert (worker.concurrency, worker.loglevel) == (64, "DEBUG")

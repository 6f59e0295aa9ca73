"""`forkq cancel --session S`: every fork of a session, its line and its JSON, the exclusive forms, a refused launch.

The session cancel itself (batches, tombstone, counts) is tested in tests/store/test_sessions.py; on live
workers in tests/e2e/test_session_cancel.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cli_support import PARENT, PROMPT, Run, launch, parent_file

SESSION = json.loads(Path(PARENT).read_text(encoding="utf-8"))["session_id"]


def test_cancel_session_prints_how_many_forks_it_cancelled_and_until_when_launches_are_refused(forkq: Run) -> None:
    forks = [launch(forkq), launch(forkq)]

    code, out, err = forkq("cancel", "--session", SESSION)

    assert code == 0, err
    assert re.fullmatch(
        rf"session {SESSION}: 2 forks cancelled, 0 had already ended; launches into it are refused until "
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\n",
        out,
    )
    assert {json.loads(forkq("status", fid, "--json")[1])["status"] for fid in forks} == {"cancelled"}


def test_cancel_session_json_lists_the_forks_it_cancelled(forkq: Run, tmp_path: Path) -> None:
    other = launch(forkq, "--parent", parent_file(tmp_path, session_id="s-other"))
    first = launch(forkq)

    code, out, _ = forkq("cancel", "--session", SESSION, "--json")
    again = json.loads(forkq("cancel", "--session", SESSION, "--json")[1])

    body = json.loads(out)
    assert code == 0
    assert (body["session"], body["cancelled"], body["forks"], body["already_ended"]) == (SESSION, 1, [first], 0)
    assert body["refused_until_ms"] > 0
    assert (again["cancelled"], again["forks"], again["already_ended"]) == (0, [], 1)
    assert json.loads(forkq("status", other, "--json")[1])["status"] == "queued"


def test_a_launch_into_a_cancelled_session_exits_2_naming_the_session_and_the_fix(forkq: Run) -> None:
    forkq("cancel", "--session", SESSION)

    code, out, err = forkq("launch", "--parent", PARENT, "--prompt", PROMPT, "--subagent-type", "fork")

    assert (code, out) == (2, "")
    assert f"session {SESSION!r} was cancelled" in err and "launch with a new session id" in err


@pytest.mark.parametrize(
    "argv",
    [["cancel"], ["cancel", "f-one", "--session", "s-one"]],
    ids=["neither", "both"],
)
def test_cancel_takes_a_fork_id_or_a_session_exactly_one_of_them(forkq: Run, argv: list[str]) -> None:
    code, out, err = forkq(*argv)

    assert (code, out) == (2, "")
    assert "forkq cancel ID | forkq cancel --session S" in err


def test_cancel_refuses_a_session_id_that_is_not_one(forkq: Run, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        forkq("cancel", "--session", "has space")

    assert exited.value.code == 2
    assert "is not a parent session id" in capsys.readouterr().err


def test_forkq_tenant_gives_the_cli_its_own_session_space(forkq: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a fork of the default tenant and one of tenant acme, both from the same session id
    theirs = launch(forkq)
    monkeypatch.setenv("FORKQ_TENANT", "acme")
    ours = launch(forkq)

    # When acme lists the session and cancels it
    listed = [f["fork_id"] for f in json.loads(forkq("list", "--session", SESSION, "--json")[1])]
    code, out, err = forkq("cancel", "--session", SESSION, "--json")

    # Then it saw and cancelled its own fork only; the default tenant's fork of the same session id runs on
    assert listed == [ours]
    assert code == 0, err
    assert json.loads(out)["forks"] == [ours]
    assert json.loads(forkq("status", theirs, "--json")[1])["status"] == "queued"
    assert json.loads(forkq("status", ours, "--json")[1])["tenant"] == "acme"
    monkeypatch.delenv("FORKQ_TENANT")
    assert json.loads(forkq("status", theirs, "--json")[1])["tenant"] == "default"

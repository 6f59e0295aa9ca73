"""Tenants against one `forkq serve`: tokens name their tenant, and a fork is reachable only by its own tenant's
tokens (and operators'); every other tenant gets the 404 of a fork that does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from tests.api.test_routes import error_of, launch
from tests.api_support import FORK, TOKEN, Api, wait_status
from tests.cli_support import call, step
from workers.api.auth import TokenSet
from workers.client import ForkClient

ACME, BETA, ADMIN = "tok-of-acme-5b1d", "tok-of-beta-77c0", "tok-of-the-operator-19ae"


@pytest.fixture
def tenants(serve_api: Callable[..., Api]) -> Api:
    """The API with a token of tenant acme, one of tenant beta, a `default` one and an operator's."""
    return serve_api(api_tokens=f"{TOKEN}, acme={ACME}, beta={BETA}", api_admin_tokens=ADMIN)


def fork_requests(fork_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every request that names one fork: (method, path, JSON body)."""
    base = f"/v1/forks/{fork_id}"
    return [
        ("GET", base, None),
        ("GET", f"{base}/result", None),
        ("GET", f"{base}/events", None),
        ("GET", f"{base}/transcript", None),
        ("GET", f"{base}/notification", None),
        ("GET", f"{base}/changes", None),
        ("GET", f"{base}/budget", None),
        ("POST", f"{base}/messages", {"text": "stop that"}),
        ("POST", f"{base}/approvals/c-1", {"decision": "approve"}),
        ("POST", f"{base}/cancel", {}),
    ]


def test_another_tenants_token_gets_the_404_of_a_fork_that_does_not_exist_on_every_fork_endpoint(
    tenants: Api, parent: dict[str, Any], client: ForkClient
) -> None:
    # Given a fork launched by tenant acme
    with tenants.client(ACME) as acme, tenants.client(BETA) as beta, tenants.client(ADMIN) as admin:
        fork_id = launch(acme, parent)

        # When tenant beta names it on every endpoint, Then each answers as for a fork that never existed
        for method, path, body in fork_requests(fork_id):
            seen = beta.request(method, path, json=body)
            never = beta.request(method, path.replace(fork_id, "f-never-launched-0"), json=body)
            assert seen.status_code == never.status_code == 404, (path, seen.text)
            unknown = error_of(never, 404)["message"].replace("f-never-launched-0", fork_id)
            assert error_of(seen, 404)["message"] == unknown, path

        # And its own tenant, and an operator, reach it; the state and the record name its tenant
        assert acme.get(f"/v1/forks/{fork_id}").json()["tenant"] == "acme"
        assert admin.get(f"/v1/forks/{fork_id}").json()["tenant"] == "acme"
        assert acme.get(f"/v1/forks/{fork_id}/transcript").status_code == 200
        assert acme.get(f"/v1/forks/{fork_id}/budget").status_code == 200
        assert client.store.get_record(fork_id, None).tenant == "acme"
        # beta's cancel above reached nothing: the fork is still queued, and acme can cancel it
        assert client.status(fork_id).status.value == "queued"
        assert acme.post(f"/v1/forks/{fork_id}/cancel", json={}).json()["status"] == "cancelled"


def test_two_tenants_use_one_session_id_and_one_teammate_name_without_meeting(
    tenants: Api, parent: dict[str, Any]
) -> None:
    session = parent["session_id"]
    mate = {"description": "t", "prompt": "p", "subagent_type": "general-purpose", "name": "helper"}
    with tenants.client(ACME) as acme, tenants.client(BETA) as beta, tenants.client(ADMIN) as admin:
        # Given each tenant launched a fork and a teammate named `helper` from the same session id
        acme_fork, beta_fork = launch(acme, parent), launch(beta, parent)
        acme_mate, beta_mate = launch(acme, parent, mate), launch(beta, parent, mate)

        # Then each lists only its own, with its tenant
        listed = acme.get(f"/v1/sessions/{session}/forks").json()["forks"]
        assert {f["fork_id"] for f in listed} == {acme_fork, acme_mate} and {f["tenant"] for f in listed} == {"acme"}
        assert {f["fork_id"] for f in beta.get(f"/v1/sessions/{session}/forks").json()["forks"]} == {
            beta_fork,
            beta_mate,
        }
        # (an operator's session ids are the `default` tenant's: nobody launched there)
        assert admin.get(f"/v1/sessions/{session}/forks").json()["forks"] == []

        # When beta sets its session's budget and cancels its session
        assert beta.put(f"/v1/sessions/{session}/budget", json={"tokens": 10}).json()["tokens"] == 10
        cancelled = beta.post(f"/v1/sessions/{session}/cancel", json={}).json()
        assert cancelled["session"] == session and set(cancelled["forks"]) == {beta_fork, beta_mate}

        # Then acme's session has no budget, its forks still wait, and it can launch into it (no tombstone)
        assert acme.get(f"/v1/sessions/{session}/budget").json() == {
            "session": session,
            "tokens": None,
            "used": 0,
            "left": None,
            "resumed": [],
        }
        assert acme.get(f"/v1/forks/{acme_fork}").json()["status"] == "queued"
        assert acme.get(f"/v1/forks/{acme_mate}").json()["status"] == "queued"
        launch(acme, parent)
        assert beta.post("/v1/forks", json={"parent": parent, "agent": FORK}).status_code == 409  # its tombstone
        # and the transcript names the session as the caller named it, with its tenant
        seed = acme.get(f"/v1/forks/{acme_fork}/transcript").json()["seed"]
        assert (seed["parent_session"], seed["tenant"]) == (session, "acme")


def test_a_launch_by_a_bare_token_belongs_to_the_default_tenant_and_the_client_launches_as_forkq_tenant(
    tenants: Api, parent: dict[str, Any], make_settings: Callable[..., Any]
) -> None:
    with tenants.client(TOKEN) as plain, tenants.client(ACME) as acme:
        fork_id = launch(plain, parent)
        assert plain.get(f"/v1/forks/{fork_id}").json()["tenant"] == "default"
        assert acme.get(f"/v1/forks/{fork_id}").status_code == 404

        with ForkClient(make_settings(tenant="acme")) as as_acme:
            handle = as_acme.launch(parent, {"description": "t", "prompt": "p", "subagent_type": "fork"})
        assert acme.get(f"/v1/forks/{handle.fork_id}").json()["tenant"] == "acme"
        assert plain.get(f"/v1/forks/{handle.fork_id}").status_code == 404


def test_an_approval_records_who_decided_their_tenant_and_when_and_inspect_shows_it(
    tenants: Api,
    parent: dict[str, Any],
    scripted_worker: Callable[[list[dict[str, Any]]], Any],
    client: ForkClient,
    tmp_path: Path,
) -> None:
    # Given a fork of tenant acme parked on a file write
    scripted_worker([step(call("w1", "write_file", path="a.txt", content="x")), step("done")])
    work = tmp_path / "work"
    work.mkdir()
    with tenants.client(ACME) as acme, tenants.client(BETA) as beta:
        parked = {**parent, "cwd": str(work), "approval_mode": "default"}
        fork_id = launch(acme, parked, approval_policy="park", workspace="shared")
        wait_status(acme, fork_id, "awaiting_approval")

        # When beta tries to approve it, and then acme approves it
        assert beta.post(f"/v1/forks/{fork_id}/approvals/w1", json={"decision": "approve"}).status_code == 404
        before = int(time.time() * 1000)
        assert acme.post(f"/v1/forks/{fork_id}/approvals/w1", json={"decision": "approve"}).status_code == 200
        after = int(time.time() * 1000)
        wait_status(acme, fork_id, "succeeded")
        steps = acme.get(f"/v1/forks/{fork_id}/transcript").json()["steps"]

    # Then the journal says who decided (acme's token, by its id), of which tenant, and when
    caller = TokenSet.parse(SecretStr(f"acme={ACME}")).match(ACME.encode())
    assert caller is not None
    (decided,) = [s for s in steps if s["kind"] == "approval"]
    assert (decided["decided_by"], decided["decided_tenant"]) == (f"token:{caller.token_id}", "acme")
    assert before <= decided["decided_ms"] <= after
    (audited,) = client.inspect(fork_id)["approvals"]
    assert {k: audited[k] for k in ("call_id", "decision", "decided_by", "decided_tenant", "decided_ms")} == {
        "call_id": "w1",
        "decision": "approve",
        "decided_by": decided["decided_by"],
        "decided_tenant": "acme",
        "decided_ms": decided["decided_ms"],
    }
    assert (work / "a.txt").read_text() == "x"


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("FORKQ_API_TOKENS", "Acme Corp=tok", "entry 1 of FORKQ_API_TOKENS"),
        ("FORKQ_API_TOKENS", "good, beta=", "entry 2 of FORKQ_API_TOKENS"),
        ("FORKQ_API_ADMIN_TOKENS", "sha256:abc", "FORKQ_API_ADMIN_TOKENS"),
        ("FORKQ_TENANT", "Not A Tenant", "FORKQ_TENANT"),
        ("FORKQ_API_TOKENS", "k9x2q7w4abc==", "entry 1 of FORKQ_API_TOKENS"),
        ("FORKQ_API_TOKENS", "acme=same-token,beta=same-token", "entry 2 of FORKQ_API_TOKENS"),
    ],
)
def test_a_malformed_token_entry_or_tenant_exits_2_naming_it(variable: str, value: str, named: str) -> None:
    env = {**os.environ, variable: value}
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "status", "f-any"], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 2, done.stderr
    assert named in done.stderr, done.stderr


def test_an_httpx_request_without_a_tenants_token_is_still_401(tenants: Api) -> None:
    with httpx.Client(base_url=tenants.url) as anonymous:
        assert anonymous.get("/v1/forks/f-any").status_code == 401


def test_a_tenants_token_cannot_choose_a_fork_id_that_could_meet_another_tenants(
    tenants: Api, parent: dict[str, Any]
) -> None:
    with tenants.client(ACME) as acme, tenants.client(BETA) as beta, tenants.client(TOKEN) as plain:
        taken = launch(acme, parent)
        refused = beta.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": {"fork_id": taken}})
        error = error_of(refused, 422)
        assert error["field"] == "fork_id" and "Idempotency-Key" in error["message"]
        # a fresh id is refused the same way: the answer says nothing of whether the id is taken
        fresh = beta.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": {"fork_id": "f-free-1"}})
        assert error_of(fresh, 422) == error_of(refused, 422)
        # the default tenant's tokens keep the option (settings from before tenants)
        assert (
            plain.post(
                "/v1/forks", json={"parent": parent, "agent": FORK, "options": {"fork_id": "f-mine-1"}}
            ).status_code
            == 202
        )

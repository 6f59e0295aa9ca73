"""The web view (`/ui`) in a real headless browser: Playwright driving the system's chromium against uvicorn serving
`make_api`, a live worker with a scripted model, and the private Redis.

Signing in (a wrong token refused, the right one kept for the tab), a fork followed from queued to succeeded with
its transcript and usage, a continued fork's delivered message, a parked call approved and denied from the page,
a cancel, fork text shown as text only; and, without a browser, what `/ui` serves (no token, a
Content-Security-Policy, no inline script).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery.worker import WorkController
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright

from tests.api_support import FORK, TOKEN, Api, wait_status
from tests.cli_support import call, step
from tests.conftest import missing_tool
from workers.api.ui import CONTENT_SECURITY_POLICY
from workers.base.keys import Keys
from workers.store.lease import Claim, Leases

CHROMIUM = "/usr/bin/chromium"  # Debian's; Playwright's own browser downloads are never used
EXPECT_TIMEOUT_MS = 20_000
# records every status the fork's view shows, in order, however briefly: a page-side observer, not test polling
WATCH_STATUS = """() => {
  window.seenStatuses = [];
  const status = document.getElementById("fork-status");
  const note = () => {
    const shown = status.textContent;
    if (shown && window.seenStatuses.at(-1) !== shown) window.seenStatuses.push(shown);
  };
  note();
  new MutationObserver(note).observe(status, {childList: true, characterData: true, subtree: true});
}"""


def chromium_executable() -> str:
    """The chromium binary; skips the test when there is none, or fails it when the CI variable is set."""
    found = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    if found is None:
        missing_tool("chromium", f"no chromium at {CHROMIUM} or on PATH: install Debian's (apt-get install chromium)")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """A headless chromium shared by the module's tests (each gets its own context: its own sessionStorage)."""
    executable = chromium_executable()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page in a fresh browser context; the page's script errors fail the test."""
    context = browser.new_context()
    context.set_default_timeout(EXPECT_TIMEOUT_MS)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.on("dialog", lambda dialog: dialog.accept())  # the cancel button asks to confirm
    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    yield opened
    context.close()
    assert errors == [], f"the page's script failed: {errors}"


@dataclass
class Web:
    """The page of a browser, and the API server it is pointed at."""

    page: Page
    api: Api


@pytest.fixture
def web(api: Api, page: Page) -> Web:
    """The fresh page, and the API with the test tokens."""
    return Web(page, api)


def launch(http: httpx.Client, parent: dict[str, Any], agent: dict[str, Any] | None = None, **options: Any) -> str:
    """POST /v1/forks; the new fork's id."""
    response = http.post("/v1/forks", json={"parent": parent, "agent": agent or FORK, "options": options})
    assert response.status_code == 202, response.text
    return str(response.json()["fork_id"])


def sign_in(page: Page, api: Api, session: str | None = None, token: str = TOKEN) -> None:
    """Open the page (with `?session=`), and sign in with `token` through the login form."""
    page.goto(f"{api.url}/ui" + (f"?session={session}" if session else ""))
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Sign in").click()


def open_fork(page: Page, fork_id: str) -> Locator:
    """Click the fork in the session's list; its row."""
    row = page.locator(f'#forks li[data-fork-id="{fork_id}"]')
    row.get_by_role("button").click()
    expect(page.locator("#fork-id")).to_have_text(fork_id)
    return row


def steps_shown(page: Page) -> list[str]:
    """The transcript's step headings, as the page shows them."""
    return page.locator("#steps .step-head").all_text_contents()


def park(http: httpx.Client, parent: dict[str, Any], work: Path) -> str:
    """A fork parked on a file edit (approval mode default, approval policy park), acting on `work` in place."""
    parked = {**parent, "cwd": str(work), "approval_mode": "default"}
    fork_id = launch(http, parked, approval_policy="park", workspace="shared")
    wait_status(http, fork_id, "awaiting_approval")
    return fork_id


# ── what /ui serves ───────────────────────────────────────────────────────────────────────────


def test_the_page_and_its_files_are_served_without_a_token_with_a_policy_that_forbids_inline_script(api: Api) -> None:
    with api.client(token=None) as anonymous:
        page = anonymous.get("/ui")
        script = anonymous.get("/ui/ui.js")
        style = anonymous.get("/ui/ui.css")
        data = anonymous.get("/v1/sessions/s-1/forks")
        other = anonymous.get("/ui/elsewhere")

    for response, media in ((page, "text/html"), (script, "text/javascript"), (style, "text/css")):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith(media)
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert response.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert re.findall(r"<script[^>]*>", page.text) == ['<script src="ui/ui.js" defer>']  # no inline script
    assert " on" not in " ".join(re.findall(r"<[^>]+>", page.text))  # no inline event handler either
    assert "innerHTML" not in script.text and "insertAdjacentHTML" not in script.text
    assert data.status_code == 401 and other.status_code == 401  # the data, and any other path, need the token


def test_the_web_view_is_not_in_the_openapi_document(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]

    assert not [path for path in paths if path.startswith("/ui")]


# ── signing in ────────────────────────────────────────────────────────────────────────────────


def test_a_wrong_token_is_refused_on_the_login_form_and_the_right_one_is_kept_for_the_tab(api: Api, page: Page) -> None:
    # Given the page, signed out
    page.goto(f"{api.url}/ui")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()

    # When a wrong token is given, it is refused with the server's reason, and not kept
    page.get_by_label("API token").fill("not-the-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#login-error")).to_have_text(
        "The server refused this token: the bearer token is not one this server accepts: "
        "send `Authorization: Bearer <token>` with a token of FORKQ_API_TOKENS"
    )
    expect(page.locator("#main")).to_be_hidden()
    assert page.evaluate("sessionStorage.getItem('forkq.token')") is None

    # Then the right one opens the page, and stays for the tab (a reload), not for another tab
    page.get_by_label("API token").fill(TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_label("Session id")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('forkq.token')") == TOKEN
    page.reload()
    expect(page.get_by_label("Session id")).to_be_visible()
    other_tab = page.context.new_page()
    other_tab.goto(f"{api.url}/ui")
    expect(other_tab.get_by_role("heading", name="Sign in")).to_be_visible()

    # And signing out forgets it
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('forkq.token')") is None


def test_an_empty_token_or_session_is_refused_on_the_page_saying_what_to_enter(api: Api, page: Page) -> None:
    page.goto(f"{api.url}/ui")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#login-error")).to_have_text("Enter a token: one of the server's FORKQ_API_TOKENS.")

    sign_in(page, api)
    page.get_by_role("button", name="Show forks").click()
    expect(page.locator("#main-error")).to_contain_text("Enter a session id")
    page.get_by_label("Session id").fill("has spaces")
    page.get_by_role("button", name="Show forks").click()
    expect(page.locator("#main-error")).to_contain_text("path field 'session_id'")


def test_a_server_without_tokens_opens_the_page_without_signing_in(
    serve_api: Callable[..., Api], page: Page, parent: dict[str, Any]
) -> None:
    api = serve_api(require_auth=False)
    with api.client(token=None) as http:
        fork_id = launch(http, parent)

    page.goto(f"{api.url}/ui?session={parent['session_id']}")

    expect(page.locator(f'#forks li[data-fork-id="{fork_id}"] .status')).to_have_text("queued")
    expect(page.get_by_role("heading", name="Sign in")).to_be_hidden()
    expect(page.get_by_role("button", name="Sign out")).to_be_hidden()


# ── following a fork ──────────────────────────────────────────────────────────────────────────


def test_the_page_follows_a_fork_from_queued_to_succeeded_with_its_transcript_and_usage(
    http: httpx.Client,
    web: Web,
    scripted_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    work: Path,
) -> None:
    page, api = web.page, web.api
    # Given a fork launched with no worker running (it stays queued), whose model reads a file, then answers
    (work / "notes.txt").write_text("the limit is 10 per second\n", encoding="utf-8")
    fork_id = launch(http, {**parent, "cwd": str(work)}, workspace="shared")
    sign_in(page, api, session=parent["session_id"])
    row = open_fork(page, fork_id)
    expect(row.locator(".status")).to_have_text("queued")
    expect(page.locator("#fork-status")).to_have_text("queued")
    expect(page.locator("#fork-stream")).to_have_text(re.compile("^live"))
    page.evaluate(WATCH_STATUS)

    # When a worker starts
    scripted_worker([step(call("r1", "read_file", path="notes.txt"), delay_s=1.0), step("The limiter is fine.")])

    # Then the page shows the fork running, then succeeded, with every step, the output and the usage
    expect(page.locator("#fork-status")).to_have_text("succeeded")
    expect(row.locator(".status")).to_have_text("succeeded")
    assert page.evaluate("window.seenStatuses") == ["queued", "running", "succeeded"]
    expect(page.locator("#output")).to_have_text("The limiter is fine.")
    expect(page.locator("#steps .step")).to_have_count(3)
    heads = steps_shown(page)
    assert heads[0].startswith("Step 1 · model: ") and heads[2].startswith("Step 2 · model: ")
    assert heads[1] == "Step 1 · result of read_file (r1)"
    expect(page.locator("#steps .step.tool_result pre")).to_contain_text("the limit is 10 per second")
    expect(page.locator("#steps .step.model pre.call")).to_contain_text('→ read_file (r1) {\n  "path": "notes.txt"\n}')
    result = http.get(f"/v1/forks/{fork_id}/result").json()
    for name in ("input_tokens", "output_tokens", "model_calls", "tool_uses"):
        expect(page.locator(f'#usage dd[data-usage="{name}"]')).to_have_text(str(result["usage"][name]))
    assert result["usage"]["model_calls"] == 2 and result["usage"]["input_tokens"] > 0
    expect(page.locator("#fork-stream")).to_have_text("ended")
    expect(page.get_by_role("button", name="Cancel fork")).to_be_hidden()


def test_fork_text_is_shown_as_text_never_as_markup(
    http: httpx.Client, api: Api, page: Page, scripted_worker: Callable[..., WorkController], parent: dict[str, Any]
) -> None:
    markup = '<img src="x" onerror="window.pwned = 1"><b>bold</b>'
    scripted_worker([step(f"<script>window.pwned = 2</script>{markup}")])
    fork_id = launch(http, parent, {**FORK, "description": markup})
    wait_status(http, fork_id, "succeeded")

    sign_in(page, api, session=parent["session_id"])
    open_fork(page, fork_id)

    expect(page.locator("#output")).to_have_text(f"<script>window.pwned = 2</script>{markup}")
    expect(page.locator("#fork-title")).to_have_text(markup)
    expect(page.locator(f'#forks li[data-fork-id="{fork_id}"] .description')).to_have_text(markup)
    assert page.locator("main img, main b, main script").count() == 0
    assert page.evaluate("window.pwned") is None


def test_a_continued_forks_transcript_shows_the_message_it_was_given_between_its_answers(
    http: httpx.Client, web: Web, scripted_worker: Callable[..., WorkController], parent: dict[str, Any]
) -> None:
    page, api = web.page, web.api
    # Given a fork that answered, was sent a message, and answered again
    scripted_worker([step("first answer"), step("second answer")])
    fork_id = launch(http, parent)
    assert http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20}).json()["output"] == "first answer"
    assert http.post(f"/v1/forks/{fork_id}/messages", json={"text": "And then?"}).status_code == 202
    assert http.get(f"/v1/forks/{fork_id}/result", params={"wait": 20}).json()["output"] == "second answer"

    # When its page is opened
    sign_in(page, api, session=parent["session_id"])
    open_fork(page, fork_id)

    # Then the message stands between the two answers, as text
    expect(page.locator("#steps .step")).to_have_count(3)
    assert steps_shown(page)[1] == "Step 2 · message delivered to the fork"
    expect(page.locator("#steps .step.message pre")).to_have_text("And then?")
    expect(page.locator("#output")).to_have_text("second answer")


# ── acting on a fork ──────────────────────────────────────────────────────────────────────────


PARKING = [step(call("w1", "write_file", path="a.txt", content="approved text")), step("all done")]


def test_a_parked_call_is_approved_from_the_page_and_the_fork_resumes_to_succeeded(
    http: httpx.Client,
    web: Web,
    scripted_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    work: Path,
) -> None:
    page, api = web.page, web.api
    # Given a fork parked on a write_file call, whose next model call takes a second (long enough to be seen)
    scripted_worker([PARKING[0], step("all done", delay_s=1.0)])
    fork_id = park(http, parent, work)
    sign_in(page, api, session=parent["session_id"])
    open_fork(page, fork_id)
    expect(page.locator("#fork-status")).to_have_text("awaiting_approval")
    pending = page.locator('#pending-calls li[data-call-id="w1"]')
    expect(pending).to_contain_text("write_file")
    expect(pending.locator("pre")).to_have_text('{\n  "path": "a.txt",\n  "content": "approved text"\n}')
    # what it waits for is said in the page's words, and is no error
    expect(page.locator("#fork-waiting")).to_have_text(
        "Waiting for your approval of write_file (w1): approve or deny below."
    )
    expect(page.locator("#fork-error")).to_have_text("—")
    page.evaluate(WATCH_STATUS)

    # When a person approves it on the page
    pending.get_by_role("button", name="Approve").click()

    # Then the fork goes on, writes the file, and succeeds; the transcript shows the decision and what followed
    expect(page.locator("#fork-message")).to_have_text("Approved w1: the fork goes on.")
    expect(page.locator("#fork-status")).to_have_text("succeeded")
    expect(page.locator("#pending")).to_be_hidden()
    expect(page.locator("#fork-waiting")).to_be_hidden()
    seen = page.evaluate("window.seenStatuses")
    assert seen[0] == "awaiting_approval" and "running" in seen[1:-1] and seen[-1] == "succeeded", seen
    assert (work / "a.txt").read_text() == "approved text"
    expect(page.locator("#output")).to_have_text("all done")
    expect(page.locator("#steps .step")).to_have_count(4)
    approved, result = steps_shown(page)[1:3]
    # the audit: the API token's id, its tenant and when
    assert re.fullmatch(
        r"Step 1 · approved write_file \(w1\) by token:[0-9a-f]{16} \(default\) at 20\d\d-\S+Z", approved
    )
    assert result == "Step 1 · result of write_file (w1)"
    expect(page.locator("#fork-tenant")).to_have_text("default")


def test_a_paused_fork_shows_why_it_waits_and_how_to_resume_it_not_an_error(
    http: httpx.Client, web: Web, parent: dict[str, Any], redis_client: redis.Redis
) -> None:
    page, api = web.page, web.api
    # Given a fork a worker paused (no worker runs here: the test claims it and pauses it as a worker's run does)
    fork_id = launch(http, parent)
    leases = Leases(redis_client, Keys(api.settings.namespace), ttl_ms=10_000, retention_s=60)
    claim = leases.claim(fork_id, "worker-test")
    assert isinstance(claim, Claim), claim
    leases.pause(claim, "declared tool(s) count not available on this worker")
    wait_status(http, fork_id, "paused")

    # When a person opens it on the page
    sign_in(page, api, session=parent["session_id"])
    open_fork(page, fork_id)

    # Then the page says why it waits and how it goes on, with no error and no calls to decide
    expect(page.locator("#fork-status")).to_have_text("paused")
    expect(page.locator("#fork-waiting")).to_have_text(
        f"Paused: declared tool(s) count not available on this worker. Once that is fixed, resume it "
        f"(forkq resume {fork_id})."
    )
    expect(page.locator("#fork-error")).to_have_text("—")
    expect(page.locator("#pending")).to_be_hidden()


def test_a_fork_paused_at_its_session_budget_shows_each_budget_and_goes_on_when_the_budget_is_raised(
    http: httpx.Client,
    web: Web,
    scripted_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    work: Path,
) -> None:
    page, api = web.page, web.api
    # Given a session budget of 150 tokens, and a fork (max_tokens 1000) whose every response reports 100 tokens
    usage = {"input_tokens": 80, "output_tokens": 20}
    answers = [
        step(call("l1", "list_directory", dir_path=".")),
        step(call("l2", "list_directory", dir_path=".")),
        step("done"),
    ]
    scripted_worker([{**answer, "usage": usage} for answer in answers])
    session = parent["session_id"]
    assert http.put(f"/v1/sessions/{session}/budget", json={"tokens": 150}).status_code == 200
    fork_id = launch(http, {**parent, "cwd": str(work), "approval_mode": "yolo"}, workspace="shared", max_tokens=1000)

    # When it has paused at the budget, and a person opens it
    wait_status(http, fork_id, "paused")
    sign_in(page, api, session=session)
    open_fork(page, fork_id)

    # Then the page shows why (the budget, the numbers, the command), and each budget with what was used and is left
    expect(page.locator("#fork-waiting")).to_contain_text(
        f"Paused: budget_reached: the budget of session {session} is reached: used 200 of 150 tokens."
    )
    expect(page.locator("#fork-waiting")).to_contain_text(f"forkq budget --session {session} --tokens N")
    expect(page.locator('#budget dd[data-budget="max_tokens"]')).to_have_text("used 200 of 1000 tokens, 800 left")
    expect(page.locator('#budget dd[data-budget="session"]')).to_have_text("used 200 of 150 tokens, 0 left")
    expect(page.locator("#fork-error")).to_have_text("—")

    # When the session's budget is raised
    assert http.put(f"/v1/sessions/{session}/budget", json={"tokens": 10000}).json()["resumed"] == [fork_id]

    # Then the page follows the fork to its end, and shows the budgets it ended with
    expect(page.locator("#fork-status")).to_have_text("succeeded")
    expect(page.locator("#fork-waiting")).to_be_hidden()
    expect(page.locator('#budget dd[data-budget="session"]')).to_have_text("used 300 of 10000 tokens, 9700 left")
    expect(page.locator('#budget dd[data-budget="max_tokens"]')).to_have_text("used 300 of 1000 tokens, 700 left")


def test_a_parked_call_is_denied_with_a_reason_and_another_fork_cancelled_from_the_page(
    http: httpx.Client,
    web: Web,
    scripted_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    work: Path,
) -> None:
    page, api = web.page, web.api
    # Given two forks parked on the same write_file call
    scripted_worker(PARKING)
    denied, cancelled = park(http, parent, work), park(http, parent, work)
    sign_in(page, api, session=parent["session_id"])

    # When a person denies the first one's call, with a reason
    open_fork(page, denied)
    pending = page.locator('#pending-calls li[data-call-id="w1"]')
    pending.get_by_label("Reason for denying w1").fill("not in this repository")
    pending.get_by_role("button", name="Deny").click()

    # Then that fork goes on without the write, its model told why, and succeeds
    expect(page.locator("#fork-message")).to_have_text("Denied w1: the fork goes on.")
    expect(page.locator("#fork-status")).to_have_text("succeeded")
    assert steps_shown(page)[1].startswith("Step 1 · denied write_file (w1) by token:")
    expect(page.locator("#steps .step.approval pre")).to_have_text("not in this repository")
    expect(page.locator("#steps .step.tool_result pre")).to_contain_text("not in this repository")
    assert not (work / "a.txt").exists()

    # And when the person cancels the second one, it ends cancelled, its pending call gone
    row = open_fork(page, cancelled)
    expect(page.locator("#fork-status")).to_have_text("awaiting_approval")
    page.get_by_role("button", name="Cancel fork").click()
    expect(page.locator("#fork-message")).to_have_text("Cancel sent: the fork is cancelled.")
    expect(page.locator("#fork-status")).to_have_text("cancelled")
    expect(row.locator(".status")).to_have_text("cancelled")
    expect(page.locator("#pending")).to_be_hidden()
    expect(page.get_by_role("button", name="Cancel fork")).to_be_hidden()
    assert http.get(f"/v1/forks/{cancelled}").json()["status"] == "cancelled"


def test_a_whole_session_is_cancelled_from_the_page_and_then_refuses_launches(
    http: httpx.Client,
    web: Web,
    scripted_worker: Callable[..., WorkController],
    parent: dict[str, Any],
    work: Path,
) -> None:
    page, api = web.page, web.api
    # Given two forks of the session parked on a call
    scripted_worker(PARKING)
    forks = [park(http, parent, work), park(http, parent, work)]
    sign_in(page, api, session=parent["session_id"])
    rows = [page.locator(f'#forks li[data-fork-id="{fork_id}"]') for fork_id in forks]
    for row in rows:
        expect(row.locator(".status")).to_have_text("awaiting_approval")

    # When a person cancels the whole session
    page.get_by_role("button", name="Cancel session").click()

    # Then both forks end cancelled, the page says so, and a launch into the session is refused
    expect(page.locator("#session-message")).to_have_text("Session cancelled: 2 forks cancelled, 0 had already ended.")
    for row in rows:
        expect(row.locator(".status")).to_have_text("cancelled")
    refused = http.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": {"workspace": "shared"}})
    assert refused.status_code == 409 and refused.json()["error"]["field"] == "session_id"


def test_a_snapshot_forks_changed_files_and_its_diff_are_shown_once_it_ended(
    http: httpx.Client, web: Web, scripted_worker: Callable[..., WorkController], parent: dict[str, Any]
) -> None:
    # Given a snapshot fork (an empty workspace: nothing was uploaded) whose command writes a file, then answers
    scripted_worker(
        [step(call("s1", "run_shell_command", command="printf 'hi\\n' > hello.txt")), step("Wrote hello.txt.")]
    )
    fork_id = launch(http, {**parent, "approval_mode": "yolo"}, workspace="snapshot")
    wait_status(http, fork_id, "succeeded")

    # When the page shows it
    sign_in(web.page, web.api, session=parent["session_id"])
    open_fork(web.page, fork_id)

    # Then its changes follow the output: the file, its line counts, and the patch as text
    expect(web.page.locator("#changes-panel")).to_be_visible()
    expect(web.page.locator("#changed-files li")).to_have_count(1)
    expect(web.page.locator("#changed-files li")).to_contain_text("added hello.txt +1 −0")
    expect(web.page.locator("#diff")).to_contain_text("+++ b/hello.txt")
    expect(web.page.locator("#steps .step.tool_result .changed")).to_have_text("changed: hello.txt")


def test_a_shared_fork_shows_no_changes_panel(
    http: httpx.Client, web: Web, scripted_worker: Callable[..., WorkController], parent: dict[str, Any], work: Path
) -> None:
    scripted_worker([step("Nothing to change.")])
    fork_id = launch(http, {**parent, "cwd": str(work)}, workspace="shared")
    wait_status(http, fork_id, "succeeded")
    sign_in(web.page, web.api, session=parent["session_id"])
    open_fork(web.page, fork_id)
    expect(web.page.locator("#output")).to_have_text("Nothing to change.")
    expect(web.page.locator("#changes-panel")).to_be_hidden()


def test_each_tenant_signed_in_to_the_page_sees_its_own_forks_of_one_session_id_with_its_tenant(
    serve_api: Callable[..., Api], page: Page, browser: Browser, parent: dict[str, Any]
) -> None:
    # Given tenants acme and beta, each with a fork launched from the same session id
    api = serve_api(api_tokens=f"{TOKEN}, acme=ui-acme-token, beta=ui-beta-token")
    with api.client("ui-acme-token") as acme, api.client("ui-beta-token") as beta:
        ours, theirs = launch(acme, parent), launch(beta, parent)

    # When acme signs in to the page with that session
    sign_in(page, api, session=parent["session_id"], token="ui-acme-token")

    # Then it lists its own fork only, and shows the fork's tenant
    open_fork(page, ours)
    expect(page.locator("#forks li")).to_have_count(1)
    expect(page.locator("#fork-tenant")).to_have_text("acme")

    # And beta, in another browser context, sees its own fork only
    other = browser.new_context().new_page()
    sign_in(other, api, session=parent["session_id"], token="ui-beta-token")
    expect(other.locator(f'#forks li[data-fork-id="{theirs}"]')).to_have_count(1)
    expect(other.locator("#forks li")).to_have_count(1)
    other.context.close()

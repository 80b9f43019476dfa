"""The approvals inbox and edit-and-approve as people use them, in headless Chromium against real processes: a
waiting call appears in the inbox live and leaves it when decided, the GET filters, an approver's edit runs the call
with the edited arguments exactly once, and a refused edit changes nothing."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.browser.conftest import LIVE, Stack, no_sideways_scroll, screenshot, sign_in, tab_to, wait_until
from tests.support.api import COMMENT, journal_count, script

pytestmark = pytest.mark.browser

ORIGINAL = {"repository": "acme/api", "issue": 7, "body": "Fixed"}


def submit(stack: Stack, name: str, given: dict[str, Any] = COMMENT) -> dict[str, Any]:
    """A new agent whose scripted model (by default) asks to comment ``ORIGINAL`` on GitHub (a call that needs
    approval)."""
    with stack.api.http(stack.api.token("producer")) as http:
        agent: dict[str, Any] = http.post("/v1/agents", json={"name": name}).json()
        submitted = http.post(
            f"/v1/agents/{agent['id']}/requests", json={"input": given}, headers={"Idempotency-Key": f"{name}-r1"}
        )
        assert submitted.status_code == 201, submitted.text
    return agent


def state(stack: Stack, agent_id: str) -> dict[str, Any]:
    with stack.api.http(stack.api.token("auditor")) as http:
        found: dict[str, Any] = http.get(f"/v1/agents/{agent_id}").json()
    return found


def approve_details(stack: Stack, agent_id: str) -> list[dict[str, Any]]:
    with stack.api.db.connection() as conn:
        rows = conn.execute(
            "SELECT details FROM audit.journal WHERE agent_id = %s AND event = 'approve' AND kind = 'transition'",
            (agent_id,),
        ).fetchall()
        conn.rollback()
    return [r[0] for r in rows]


def test_a_waiting_call_appears_in_the_inbox_live_and_the_filters_hide_and_show_it(chromium: Any, stack: Stack) -> None:
    carol = sign_in(chromium, stack, stack.api.token("approver", name="carol"))
    carol.get_by_role("navigation", name="Console").get_by_role("link", name="Inbox").click()
    carol.wait_for_url(re.compile(r"/inbox$"))
    carol.locator("[data-live-status]", has_text="Live").wait_for(timeout=LIVE)
    assert carol.locator("#inbox-empty").is_visible()
    agent = submit(stack, "inboxed")

    # It appears without a reload, with its tool, request and round, age and arguments (expandable).
    row = carol.locator("tr[data-call='inboxed']")
    row.wait_for(timeout=LIVE)
    assert row.locator("td[data-label='Tool']").inner_text() == "github_comment"
    assert "inboxed-r1 · round 1" in row.locator("td[data-label='Request · round']").inner_text()
    assert "since" in row.locator("td[data-label='Waiting']").inner_text()
    assert row.locator("td[data-label='Approval timeout']").inner_text() == "none"
    row.locator("summary").click()
    assert json.loads(row.locator("details pre").inner_text()) == ORIGINAL

    # A call whose tool has an approval timeout says when it will be rejected; the older call stays first.
    train = {"tool_calls": [{"name": "release_train", "arguments": {"service": "api"}}]}
    submit(stack, "timed", script(train, {"content": "Released."}))
    timed = carol.locator("tr[data-call='timed']")
    timed.wait_for(timeout=LIVE)
    assert carol.locator("tr[data-call]").evaluate_all("rows => rows.map(r => r.dataset.call)") == ["inboxed", "timed"]
    timeout = timed.locator("td[data-label='Approval timeout']").inner_text()
    assert re.search(r"rejected in (59m \d+s|1h 0m) \(limit 1h 0m\)", timeout), timeout
    assert row.locator("details").get_attribute("open") is not None, "a live redraw keeps what was opened open"
    screenshot(carol, "inbox")

    # The filters are a GET form, sent from the keyboard.
    carol.get_by_label("Tool").fill("slack_post")
    carol.get_by_label("Tool").press("Enter")
    carol.wait_for_url(re.compile(r"/inbox\?tool=slack_post&"))  # the form's blank fields come along: any
    assert row.count() == 0
    assert "No call is waiting for approval that matches these filters" in carol.locator("#inbox-empty").inner_text()
    carol.get_by_label("Tool").fill("github_comment")
    carol.get_by_label("Agent name starts with").fill("inbox")
    carol.get_by_role("button", name="Filter").click()
    carol.wait_for_url(re.compile(r"/inbox\?tool=github_comment&min_age=&agent_prefix=inbox$"))
    row.wait_for()
    assert timed.count() == 0
    carol.get_by_label("Waiting at least").fill("soon")
    carol.get_by_label("Waiting at least").press("Enter")
    error = carol.locator("#inbox-error")
    error.wait_for()
    assert "Bad filter: min_age 'soon' is not an age" in error.inner_text()
    assert carol.get_by_label("Waiting at least").input_value() == "soon"  # kept, to be fixed
    screenshot(carol, "inbox-bad-filter")
    carol.get_by_role("link", name="Clear").click()
    carol.wait_for_url(re.compile(r"/inbox$"))
    row.wait_for()

    phone = carol.context.new_page()
    phone.set_viewport_size({"width": 360, "height": 740})
    phone.goto(f"{stack.api.url}/inbox")
    phone.locator("tr[data-call='inboxed']").wait_for()
    assert no_sideways_scroll(phone), "the inbox scrolls sideways at 360px"
    screenshot(phone, "inbox-narrow")

    # The link opens the agent's page at its call.
    row.get_by_role("link", name="inboxed").click()
    carol.wait_for_url(f"**/agents/{agent['id']}#approval")
    carol.get_by_role("heading", name="Waiting for approval").wait_for()


def test_edit_and_approve_runs_the_edited_call_once_and_the_journal_keeps_both(chromium: Any, stack: Stack) -> None:
    erin = sign_in(chromium, stack, stack.api.token("approver", name="erin"))
    inbox = erin.context.new_page()
    inbox.goto(f"{stack.api.url}/inbox")
    inbox.locator("[data-live-status]", has_text="Live").wait_for(timeout=LIVE)
    agent = submit(stack, "edited")
    inbox.locator("tr[data-call='edited']").wait_for(timeout=LIVE)

    erin.goto(f"{stack.api.url}/agents/{agent['id']}")
    erin.get_by_role("heading", name="Waiting for approval").wait_for()
    drawn = int(erin.locator("#revision").inner_text())
    tab_to(erin, "Edit the arguments, then approve")  # keyboard only: Tab to the disclosure, Enter opens it
    erin.keyboard.press("Enter")
    arguments = erin.get_by_label("Arguments for github_comment (JSON)")
    assert json.loads(arguments.input_value()) == ORIGINAL
    edited = {"repository": "acme/api", "issue": 8, "body": "Fixed in v2.1"}
    arguments.fill(json.dumps(edited, indent=2))
    screenshot(erin, "agent-edit")
    erin.once("dialog", lambda dialog: dialog.accept())
    erin.get_by_role("button", name=f"Approve with these arguments at revision {drawn}").click()
    erin.wait_for_url(f"**/agents/{agent['id']}?decided=approve*")  # the page confirms the decision
    erin.locator("#decided-notice", has_text="Approved at revision").wait_for()
    erin.locator("#phase", has_text="done").wait_for(timeout=LIVE)  # the edited call ran; live to done

    # The fake GitHub got the edited comment, on the edited issue, once; nothing on the model's.
    wait_until("the edited comment", lambda: stack.github.comments.get("acme/api#8"))
    erin.wait_for_timeout(3000)  # a second delivery would have to come from a duplicate send: none may
    (comment,) = stack.github.comments["acme/api#8"]
    assert "Fixed in v2.1" in comment["body"]
    assert "acme/api#7" not in stack.github.comments and len(stack.github.accepted) == 1

    # The journal keeps both versions, and the timeline shows what changed.
    (details,) = approve_details(stack, agent["id"])
    assert details["call"]["arguments"] == ORIGINAL and details["edited_arguments"] == edited
    changes = erin.locator("table.changes")
    changes.wait_for()
    assert changes.locator("tr", has_text="body").inner_text().split("\t")[1:] == ['"Fixed"', '"Fixed in v2.1"']
    assert changes.locator("tr", has_text="issue").inner_text().split("\t")[1:] == ["7", "8"]
    screenshot(erin, "agent-edited-done")

    # The decided call left the inbox without a reload.
    inbox.locator("tr[data-call='edited']").wait_for(state="detached", timeout=LIVE)
    assert inbox.locator("#inbox-empty").is_visible()


def test_an_invalid_edit_shows_the_error_and_the_agent_stays_waiting_at_its_revision(
    chromium: Any, stack: Stack
) -> None:
    agent = submit(stack, "mistyped")
    erin = sign_in(chromium, stack, stack.api.token("approver", name="erin"))
    erin.locator("tr[data-agent='mistyped'] .phase-waiting_approval").wait_for(timeout=LIVE)
    erin.goto(f"{stack.api.url}/agents/{agent['id']}")
    drawn = int(erin.locator("#revision").inner_text())
    before = journal_count(stack.api.db)
    erin.get_by_text("Edit the arguments, then approve").click()
    typed = '{"repository": "acme/api", "issue": 0, "body": "Fixed"}'
    erin.get_by_label("Arguments for github_comment (JSON)").fill(typed)
    erin.once("dialog", lambda dialog: dialog.accept())
    erin.get_by_role("button", name=f"Approve with these arguments at revision {drawn}").click()

    error = erin.locator("#edit-error")
    error.wait_for()
    assert "issue: Input should be greater than or equal to 1" in error.inner_text()
    assert "Nothing was changed" in error.inner_text()
    arguments = erin.get_by_label("Arguments for github_comment (JSON)")
    assert arguments.input_value() == typed and arguments.get_attribute("aria-invalid") == "true"
    assert erin.locator("#revision").inner_text() == str(drawn)
    assert erin.locator("#phase").inner_text() == "waiting_approval"
    screenshot(erin, "agent-edit-error")
    now = state(stack, agent["id"])
    assert (now["phase"], now["revision"]) == ("waiting_approval", drawn)
    assert journal_count(stack.api.db) == before and approve_details(stack, agent["id"]) == []
    assert stack.github.accepted == []

    phone = erin.context.new_page()
    phone.set_viewport_size({"width": 360, "height": 740})
    phone.goto(f"{stack.api.url}/agents/{agent['id']}")
    phone.get_by_text("Edit the arguments, then approve").click()
    assert no_sideways_scroll(phone), "the edit form scrolls sideways at 360px"
    screenshot(phone, "agent-edit-narrow")

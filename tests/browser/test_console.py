"""The console as people use it, in headless Chromium against real processes: live updates, approvals, stale
refusals, the outbox's retry, sign-in refusals and a read-only auditor."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser.conftest import LIVE, Stack, screenshot, sign_in, tab_to, wait_until
from tests.support.api import COMMENT

pytestmark = pytest.mark.browser


def _approvals(stack: Stack, agent_id: str) -> list[tuple[str, str]]:
    with stack.api.db.connection() as conn:
        rows = conn.execute(
            "SELECT kind, actor FROM audit.journal WHERE agent_id = %s AND event = 'approve' ORDER BY seq", (agent_id,)
        ).fetchall()
        conn.rollback()
    return [(r[0], r[1]) for r in rows]


def test_approving_live_a_stale_second_approval_and_retrying_a_dead_letter(chromium: Any, stack: Stack) -> None:
    stack.github.refusing = True  # the approved comment's first send is refused for good: a dead letter
    alice = sign_in(chromium, stack, stack.api.token("approver", "operator", name="alice"))
    bob = sign_in(chromium, stack, stack.api.token("approver", name="bob"))
    alice.locator("[data-live-status]", has_text="Live").wait_for(timeout=LIVE)  # following the journal
    with stack.api.http(stack.api.token("producer")) as http:
        agent = http.post("/v1/agents", json={"name": "commenter"}).json()
        submitted = http.post(
            f"/v1/agents/{agent['id']}/requests", json={"input": COMMENT}, headers={"Idempotency-Key": "browser-r1"}
        )
        assert submitted.status_code == 201, submitted.text

    # The list shows the agent waiting for approval without a reload.
    row = alice.locator("tr[data-agent='commenter']")
    row.locator(".phase-waiting_approval").wait_for(timeout=LIVE)
    screenshot(alice, "agents")

    alice.get_by_role("link", name="commenter").click()
    bob.goto(f"{stack.api.url}/agents/{agent['id']}")
    drawn = int(alice.locator("#revision").inner_text())
    assert bob.get_by_role("button", name=f"Approve at revision {drawn}").is_visible()
    screenshot(alice, "agent-waiting")

    alice.once("dialog", lambda dialog: dialog.accept())
    tab_to(alice, f"Approve at revision {drawn}")  # keyboard only: Tab to the button, Enter
    alice.keyboard.press("Enter")
    alice.wait_for_url(f"**/agents/{agent['id']}?decided=approve*")  # the page confirms the decision
    alice.locator("#decided-notice", has_text="Approved at revision").wait_for()
    alice.locator("#phase", has_text="done").wait_for(timeout=LIVE)  # the held call ran; live to done
    screenshot(alice, "agent-done")

    bob.once("dialog", lambda dialog: dialog.accept())
    bob.get_by_role("button", name=f"Approve at revision {drawn}").click()
    notice = bob.locator("#stale-notice")
    notice.wait_for()
    text = notice.inner_text()
    assert "Not approved: the agent moved since this page was drawn" in text
    assert f"made on revision {drawn}" in text
    assert f"alice — approve, waiting_approval → executing, to revision {drawn + 1}" in text
    assert f"now at revision {bob.locator('#revision').inner_text()}" in text
    screenshot(bob, "agent-stale")
    assert _approvals(stack, agent["id"]) == [("transition", "alice"), ("rejected", "bob")]

    # The comment was refused for good: dead on the Outbox page, with the receiver's reason; Retry delivers it once.
    alice.goto(f"{stack.api.url}/outbox")
    dead = alice.locator("tr.status-dead")
    wait_until("the dead letter", lambda: (alice.reload(), dead.count() == 1)[1])
    assert "422" in dead.inner_text()
    screenshot(alice, "outbox-dead")
    stack.github.refusing = False
    alice.once("dialog", lambda dialog: dialog.accept())
    dead.get_by_role("button", name="Retry").click()
    alice.locator("#outbox-notice").wait_for()
    wait_until("the delivery", lambda: len(stack.github.accepted) == 1)
    alice.wait_for_timeout(3000)  # a second delivery would have to come from a duplicate send: none may
    assert len(stack.github.accepted) == 1
    alice.goto(f"{stack.api.url}/kpis")
    alice.get_by_role("heading", name="KPIs").wait_for()
    screenshot(alice, "kpis")


def test_a_wrong_token_cannot_sign_in_and_an_auditor_can_only_read(chromium: Any, stack: Stack) -> None:
    page = chromium.new_context().new_page()
    page.goto(f"{stack.api.url}/agents")
    page.wait_for_url("**/signin?next=%2Fagents")
    page.get_by_label("API token").fill("keel_" + "x" * 43)
    page.get_by_role("button", name="Sign in").click()
    assert "unknown or revoked" in page.locator("#signin-error").inner_text()
    assert not [c for c in page.context.cookies() if c["name"] == "keel_session"]
    screenshot(page, "signin-refused")

    with stack.api.http(stack.api.token("producer")) as http:
        agent = http.post("/v1/agents", json={"name": "watched"}).json()
        http.post(f"/v1/agents/{agent['id']}/requests", json={"input": COMMENT}, headers={"Idempotency-Key": "a-r1"})
    auditor = sign_in(chromium, stack, stack.api.token("auditor", name="audrey"))
    auditor.locator("tr[data-agent='watched'] .phase-waiting_approval").wait_for(timeout=LIVE)
    auditor.get_by_role("link", name="watched").click()
    auditor.get_by_role("heading", name="Waiting for approval").wait_for()
    assert auditor.locator("main button").count() == 0
    screenshot(auditor, "agent-auditor")
    phone = auditor.context.new_page()
    phone.set_viewport_size({"width": 360, "height": 740})
    for path, name in ((f"/agents/{agent['id']}", "agent-narrow"), ("/agents", "agents-narrow")):
        phone.goto(f"{stack.api.url}{path}")
        assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), f"{path} scrolls sideways"
        screenshot(phone, name)
    csrf = auditor.locator("input[name=csrf]").first.get_attribute("value")
    revision = auditor.locator("#revision").inner_text()
    scope = auditor.request.post(
        f"{stack.api.url}/agents/{agent['id']}/approve", form={"csrf": csrf, "revision": revision}
    )
    assert scope.status == 403 and "may not approve" in scope.text()
    forged = auditor.request.post(f"{stack.api.url}/agents/{agent['id']}/approve", form={"revision": revision})
    assert forged.status == 403 and "CSRF" in forged.text()
    assert _approvals(stack, agent["id"]) == []

"""Approving, editing and rejecting from an agent's page, against a real ``keel serve``: journaled under the
token's name, a stale decision refused naming who moved the agent, an invalid edit refused naming the field,
and no form (and no effect of a forged POST) for a token that may not decide."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest

from models.jobs_sql import job_row
from tests.support.api import Api, journal_count, waiting_agent
from tests.support.console import Browsers, csrf_of, inbox_rows
from tests.support.keys import scoped

pytestmark = pytest.mark.integration


@pytest.fixture
def browsers(api: Api) -> Iterator[Browsers]:
    found = Browsers(api)
    yield found
    found.close()


def _journal(api: Api, agent_id: str) -> list[tuple[str, str, str, int]]:
    with api.db.connection() as conn:
        rows = conn.execute(
            "SELECT kind, event, actor, revision FROM audit.journal WHERE agent_id = %s ORDER BY seq", (agent_id,)
        ).fetchall()
        conn.rollback()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def test_approve_from_the_console_is_journaled_under_the_tokens_name(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    client = browsers.signed_in(api.token("approver", name="alice"))
    listing = client.get("/agents")
    assert re.search(r'class="phase-waiting_approval" data-agent="commenter"', listing.text)
    page = client.get(f"/agents/{state['id']}")
    assert "github_comment" in page.text and f"Approve at revision {state['revision']}" in page.text
    done = client.post(
        f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page), "revision": str(state["revision"])}
    )
    assert done.status_code == 303, done.text
    assert ("transition", "approve", "alice", state["revision"] + 1) in _journal(api, state["id"])


def test_a_stale_approval_is_refused_and_says_who_moved_the_agent(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    first = browsers.signed_in(api.token("approver", name="alice"))
    second = browsers.signed_in(api.token("approver", name="bob"))
    page_one, page_two = first.get(f"/agents/{state['id']}"), second.get(f"/agents/{state['id']}")
    drawn = str(state["revision"])
    assert first.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page_one), "revision": drawn}).is_redirect
    stale = second.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page_two), "revision": drawn})
    assert stale.status_code == 412
    assert "Not approved: the agent moved since this page was drawn" in stale.text
    assert f'now at <strong id="stale-current">revision {state["revision"] + 1}</strong>' in stale.text
    assert f"<strong>alice</strong> — approve, waiting_approval → executing, to revision {state['revision'] + 1}" in (
        stale.text
    )
    journal = _journal(api, state["id"])
    assert [e for e in journal if e[1] == "approve"] == [
        ("transition", "approve", "alice", state["revision"] + 1),
        ("rejected", "approve", "bob", state["revision"] + 1),
    ]


def test_an_auditor_sees_no_buttons_and_forged_posts_change_nothing(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    auditor = browsers.signed_in(api.token("auditor", name="audrey"))
    page = auditor.get(f"/agents/{state['id']}")
    assert page.status_code == 200 and "github_comment" in page.text
    assert "Approve at revision" not in page.text and "<button" not in page.text.split("</header>")[1]
    before = journal_count(api.db)
    forged = auditor.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page), "revision": "2"})
    assert forged.status_code == 403 and "may not approve" in forged.text
    approver = browsers.signed_in(api.token("approver"))
    no_csrf = approver.post(f"/agents/{state['id']}/approve", data={"revision": str(state["revision"])})
    assert no_csrf.status_code == 403 and "CSRF" in no_csrf.text
    wrong_csrf = approver.post(
        f"/agents/{state['id']}/approve", data={"csrf": "forged", "revision": str(state["revision"])}
    )
    assert wrong_csrf.status_code == 403
    assert journal_count(api.db) == before


def test_reject_with_a_reason_and_the_phase_filter(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
        http.post("/v1/agents", json={"name": "resting"})
    client = browsers.signed_in(api.token("approver", name="rita"))
    waiting = client.get("/agents?phase=waiting_approval").text
    assert 'data-agent="commenter"' in waiting and 'data-agent="resting"' not in waiting
    idle = client.get("/agents?phase=idle").text
    assert 'data-agent="resting"' in idle and 'data-agent="commenter"' not in idle
    bogus = client.get("/agents?phase=sleeping")
    assert bogus.status_code == 400 and "There is no phase &#39;sleeping&#39;: the phases are idle" in bogus.text
    page = client.get(f"/agents/{state['id']}")
    done = client.post(
        f"/agents/{state['id']}/reject",
        data={"csrf": csrf_of(page), "revision": str(state["revision"]), "reason": "not on a Friday"},
    )
    assert done.status_code == 303, done.text
    after = client.get(f"/agents/{state['id']}").text
    assert "by <strong>rita</strong>" in after and "not on a Friday" in after
    assert ("transition", "reject", "rita", state["revision"] + 1) in _journal(api, state["id"])


def _approve_details(api: Api, agent_id: str) -> list[dict[str, Any]]:
    with api.db.connection() as conn:
        rows = conn.execute(
            "SELECT details FROM audit.journal WHERE agent_id = %s AND event = 'approve' AND kind = 'transition'",
            (agent_id,),
        ).fetchall()
        conn.rollback()
    return [r[0] for r in rows]


def test_edit_and_approve_runs_the_call_with_the_edited_arguments(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    client = browsers.signed_in(api.token("approver", name="erin"))
    page = client.get(f"/agents/{state['id']}")
    form = page.text.split('<details class="edit" id="edit">')[1].split("</details>")[0]
    assert f'<input type="hidden" name="revision" value="{state["revision"]}">' in form and 'name="csrf"' in form
    assert '<label for="arguments">Arguments for github_comment (JSON)</label>' in form
    textarea = re.search(r'<textarea id="arguments" name="arguments"[^>]*>(.*?)</textarea>', form, re.S)
    assert textarea is not None
    assert json.loads(html.unescape(textarea.group(1))) == {"repository": "acme/api", "issue": 7, "body": "Fixed"}
    assert html.unescape(textarea.group(1)).startswith('{\n  "')  # indented, for a person to edit
    assert f"Approve with these arguments at revision {state['revision']}" in form

    edited = {"repository": "acme/api", "issue": 7, "body": "Fixed in v2.1 — ünïcode"}
    done = client.post(
        f"/agents/{state['id']}/approve",
        data={"csrf": csrf_of(page), "revision": str(state["revision"]), "arguments": json.dumps(edited, indent=2)},
    )
    assert done.status_code == 303, done.text
    (details,) = _approve_details(api, state["id"])
    assert details["call"]["arguments"]["body"] == "Fixed" and details["edited_arguments"] == edited
    job = job_row(api.db, scoped(UUID(state["id"]), "commenter-r1:tool:github_comment:1.call_0_0"))
    assert job is not None and job["payload"]["arguments"] == edited
    after = client.get(f"/agents/{state['id']}").text
    changes = after.split('<table class="changes">')[1].split("</table>")[0]
    assert '<th scope="col">erin\'s</th>' in changes
    assert '<th scope="row" class="mono">body</th>' in changes
    assert "&#34;Fixed&#34;" in changes and "&#34;Fixed in v2.1 — ünïcode&#34;" in changes
    assert "issue" not in changes  # only what changed


@pytest.mark.parametrize(
    ("typed", "named"),
    [
        ('{"repository": "acme/api", "issue": 7, "body": "x",}', "arguments: not valid JSON: Expecting property"),
        ('{"repository": "acme/api",\n "issue": seven}', "arguments: not valid JSON: Expecting value (line 2"),
        ("[1, 2]", "arguments must be a JSON object"),
        ("   ", "arguments: give the call&#39;s arguments as a JSON object (the field is empty)"),
        ('{"repository": "acme/api", "issue": NaN, "body": "x"}', "NaN is not a JSON value"),
        (
            '{"repository": "acme/api", "issue": 0, "body": "x"}',
            "edited arguments refused: tool github_comment: issue: Input should be greater than or equal to 1.",
        ),
        ('{"repository": "acme/api", "body": "x"}', "tool github_comment: issue: Field required"),
    ],
)
def test_an_invalid_edit_is_refused_naming_the_field_and_changes_nothing(
    api: Api, browsers: Browsers, typed: str, named: str
) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    client = browsers.signed_in(api.token("approver", name="erin"))
    page = client.get(f"/agents/{state['id']}")
    before = journal_count(api.db)
    refused = client.post(
        f"/agents/{state['id']}/approve",
        data={"csrf": csrf_of(page), "revision": str(state["revision"]), "arguments": typed},
    )
    assert refused.status_code == 422, refused.text
    error = refused.text.split('id="edit-error">')[1].split("</p>")[0]
    assert named in error and "Nothing was changed" in error, error
    assert '<details class="edit" id="edit" open>' in refused.text  # the form open, with what was typed
    textarea = re.search(r'<textarea id="arguments" name="arguments"[^>]*>(.*?)</textarea>', refused.text, re.S)
    assert textarea is not None and html.unescape(textarea.group(1)) == typed
    assert 'aria-invalid="true"' in refused.text
    assert f'name="revision" value="{state["revision"]}"' in refused.text
    assert journal_count(api.db) == before, "a refused edit journals nothing, as over the API"
    with api.http(api.token("auditor")) as http:
        now = http.get(f"/v1/agents/{state['id']}").json()
    assert (now["phase"], now["revision"]) == ("waiting_approval", state["revision"])


def test_a_stale_edit_shows_the_stale_notice(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    first = browsers.signed_in(api.token("approver", name="alice"))
    second = browsers.signed_in(api.token("approver", name="bob"))
    page_one, page_two = first.get(f"/agents/{state['id']}"), second.get(f"/agents/{state['id']}")
    drawn = str(state["revision"])
    assert first.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page_one), "revision": drawn}).is_redirect
    edited = json.dumps({"repository": "acme/api", "issue": 7, "body": "Too late"})
    stale = second.post(
        f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page_two), "revision": drawn, "arguments": edited}
    )
    assert stale.status_code == 412
    assert "Not approved: the agent moved since this page was drawn" in stale.text
    assert f"<strong>alice</strong> — approve, waiting_approval → executing, to revision {state['revision'] + 1}" in (
        stale.text
    )
    assert [e for e in _journal(api, state["id"]) if e[1] == "approve"] == [
        ("transition", "approve", "alice", state["revision"] + 1),
        ("rejected", "approve", "bob", state["revision"] + 1),
    ]
    assert "edited_arguments" not in _approve_details(api, state["id"])[0]
    before = journal_count(api.db)
    late = second.post(
        f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page_two), "revision": drawn, "arguments": "{oops"}
    )
    assert late.status_code == 422
    assert f"The agent has moved since, to revision {state['revision'] + 1}" in late.text
    assert "{oops" not in late.text  # what was typed was for a call no longer waiting: the forms are drawn anew
    assert journal_count(api.db) == before


def test_an_auditor_sees_no_edit_form_and_a_forged_edit_changes_nothing(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    auditor = browsers.signed_in(api.token("auditor", name="audrey"))
    page = auditor.get(f"/agents/{state['id']}")
    assert page.status_code == 200 and 'name="arguments"' not in page.text and "Edit the arguments" not in page.text
    inbox = auditor.get("/inbox")
    assert inbox.status_code == 200 and inbox_rows(inbox) == ["commenter"]  # reading the inbox is allowed
    before = journal_count(api.db)
    edited = json.dumps({"repository": "acme/api", "issue": 7, "body": "forged"})
    url = f"/agents/{state['id']}/approve"
    revision = str(state["revision"])
    forged = auditor.post(url, data={"csrf": csrf_of(page), "revision": revision, "arguments": edited})
    assert forged.status_code == 403 and "may not approve" in forged.text
    approver = browsers.signed_in(api.token("approver"))
    no_csrf = approver.post(url, data={"revision": revision, "arguments": edited})
    assert no_csrf.status_code == 403 and "CSRF" in no_csrf.text
    other = approver.post(url, data={"csrf": csrf_of(page), "revision": revision, "arguments": edited})
    assert other.status_code == 403 and "CSRF" in other.text  # the auditor's session's token is not the approver's
    assert journal_count(api.db) == before
    operator_only = browsers.signed_in(api.token("operator"))
    assert 'name="arguments"' not in operator_only.get(f"/agents/{state['id']}").text  # operators do not approve


def test_a_decision_is_confirmed_and_the_panel_warns_of_a_move_only_over_decision_forms(
    api: Api, browsers: Browsers
) -> None:
    """After an approval the page confirms it (issue 37: it showed a banner about forms no longer there), to the
    session that made it only; the live panel warns that the agent moved only when the page drew decision forms."""
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    client = browsers.signed_in(api.token("approver", name="alice"))
    page = client.get(f"/agents/{state['id']}")
    drawn = state["revision"]
    done = client.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page), "revision": str(drawn)})
    assert done.status_code == 303, done.text
    after = client.get(done.headers["location"])
    assert f"Approved at revision {drawn}: the call runs next." in after.text
    assert 'id="moved-notice"' not in after.text
    crafted = client.get(f"/agents/{state['id']}?decided=reject:{drawn}&proof=00")
    assert 'id="decided-notice"' not in crafted.text, "a link someone made shows no notice"
    over_forms = client.get(f"/agents/{state['id']}/panel?drawn={drawn}&forms=true")
    assert 'id="moved-notice"' in over_forms.text
    no_forms = client.get(f"/agents/{state['id']}/panel?drawn={drawn}")
    assert 'id="moved-notice"' not in no_forms.text

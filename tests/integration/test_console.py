"""The operator console over HTTP, against a real ``keel serve``: sign-in, the pages, decisions, stale refusals,
CSRF and scopes. (tests/browser/ drives the same console in a real browser.)"""

from __future__ import annotations

import html
import json
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, Field

from agents.client import Client
from agents.ingress.tokens import revoke_token
from agents.runtime.approvals import enforce_timeouts
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.approvals_sql import calls_past_approval_timeout
from models.db import Database
from models.jobs_sql import job_row
from models.schemas import AgentState
from models.settings import Settings
from tests.support.api import Api, journal_count, script, waiting_agent
from tests.support.console import Browsers, csrf_of
from tests.support.runs import run_all


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


def test_sign_in_sets_a_strict_http_only_session_and_sign_out_ends_it(api: Api, browsers: Browsers) -> None:
    client, answer = browsers.sign_in(api.token("approver", name="alice"))
    assert answer.status_code == 303 and answer.headers["location"] == "/agents"
    cookie = next(v for k, v in answer.headers.multi_items() if k == "set-cookie" and v.startswith("keel_session="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Secure" not in cookie  # KEEL_ENVIRONMENT defaults to development: plain http on 127.0.0.1
    page = client.get("/agents")
    assert page.status_code == 200 and "alice" in page.text and "Agents" in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy  # nothing from elsewhere
    out = client.post("/signout", data={"csrf": csrf_of(page)})
    assert out.status_code == 303
    again = client.get("/agents")
    assert again.status_code == 303 and again.headers["location"].startswith("/signin")


def test_a_wrong_token_or_a_producer_token_cannot_sign_in(api: Api, browsers: Browsers) -> None:
    _, wrong = browsers.sign_in("keel_" + "x" * 43)
    assert wrong.status_code == 401 and "unknown or revoked" in wrong.text
    assert "keel_session" not in wrong.headers.get("set-cookie", "")
    _, producer = browsers.sign_in(api.token("producer", name="robot"))
    assert producer.status_code == 403 and "producer token" in producer.text
    assert "keel_session" not in producer.headers.get("set-cookie", "")


def test_a_page_without_a_session_sends_to_the_sign_in_form(api: Api, browsers: Browsers) -> None:
    answer = browsers.new().get("/agents?phase=done")
    assert answer.status_code == 303
    assert answer.headers["location"] == "/signin?next=%2Fagents%3Fphase%3Ddone"


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


def test_the_outbox_and_kpi_pages_render_for_an_operator(api: Api, browsers: Browsers) -> None:
    client = browsers.signed_in(api.token("operator"))
    outbox = client.get("/outbox")
    assert outbox.status_code == 200 and "<h1>Outbox</h1>" in outbox.text
    kpis = client.get("/kpis")
    assert kpis.status_code == 200 and "Failure rate" in kpis.text and "<svg" in kpis.text
    approver = browsers.signed_in(api.token("approver"))
    assert approver.get("/outbox").status_code == 403


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


def test_revoking_the_token_ends_its_console_sessions(api: Api, browsers: Browsers) -> None:
    client = browsers.signed_in(api.token("operator", name="temp"))
    assert client.get("/agents").status_code == 200
    revoke_token(api.db, "temp", actor="test")
    gone = client.get("/agents")
    assert gone.status_code == 303 and gone.headers["location"].startswith("/signin")


# --- the inbox ----------------------------------------------------------------------------------------------------


class Release(BaseModel):
    service: str = Field(min_length=1)


@tool("console_release", needs_approval=True, approval_timeout=timedelta(hours=4))
def console_release(args: Release, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"released {args.service}")


@tool("console_page", needs_approval=True, approval_timeout=timedelta(seconds=1), on_timeout="escalate")
def console_page(args: Release, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"paged for {args.service}")


def _to_approval(client: Client, db: Database, name: str, tool_name: str) -> AgentState:
    """An agent whose scripted model calls ``tool_name`` (a tool of this module) and waits for approval, run here."""
    agent = client.create_agent(name)
    call = {"name": tool_name, "arguments": {"service": "api"}}
    client.submit(agent.id, f"{name}-r1", script({"tool_calls": [call]}, {"content": "Done."}))
    run_all(db)
    state = client.get_state(agent.id)
    assert state.phase == "waiting_approval", state
    return state


def _rows(page: httpx.Response) -> list[str]:
    """The agents of the inbox's rows, in order."""
    return re.findall(r'<tr data-call="([^"]+)"', page.text)


def test_the_inbox_lists_every_waiting_call_oldest_first_and_filters_it(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        first = waiting_agent(api, http, "team-a-one")
        waiting_agent(api, http, "team-b-two")
        http.post("/v1/agents", json={"name": "team-a-idle"})
    client = browsers.signed_in(api.token("approver", name="alice"))
    page = client.get("/inbox")
    assert page.status_code == 200, page.text
    assert '<a href="/inbox">Inbox</a>' in page.text  # in the navigation
    assert _rows(page) == ["team-a-one", "team-b-two"]
    row = page.text.split('<tr data-call="team-a-one"')[1].split("</tr>")[0]
    assert f'href="/agents/{first["id"]}#approval"' in row and f"r{first['revision']}" in row
    assert "github_comment" in row and "team-a-one-r1</span> · round 1" in row
    assert "&#34;body&#34;: &#34;Fixed&#34;" in row  # the arguments, expandable
    assert "since <time" in row and "none" in row  # github_comment has no approval timeout
    assert 'data-live-list="/agents/live" data-rows="/inbox/rows"' in page.text  # live, as the agents page

    assert _rows(client.get("/inbox?tool=github_comment")) == ["team-a-one", "team-b-two"]
    no_match = client.get("/inbox?tool=slack_post")
    assert _rows(no_match) == [] and "No call is waiting for approval that matches these filters" in no_match.text
    assert 'value="slack_post"' in no_match.text  # the form keeps what was asked
    assert _rows(client.get("/inbox?agent_prefix=team-b-")) == ["team-b-two"]
    assert _rows(client.get("/inbox?min_age=1h")) == []
    assert _rows(client.get("/inbox?min_age=0&tool=&agent_prefix=")) == ["team-a-one", "team-b-two"]  # blank: any
    assert _rows(client.get("/inbox/rows?agent_prefix=team-a-")) == ["team-a-one"]

    # One call a page: the next page's link carries the filters and the API's keyset cursor.
    one = client.get("/inbox?limit=1&tool=github_comment")
    assert _rows(one) == ["team-a-one"]
    found = re.search(r'<a href="([^"]+)" id="inbox-next"', one.text)
    assert found is not None, one.text
    following = html.unescape(found.group(1))
    assert "tool=github_comment" in following and "limit=1" in following and "cursor=" in following
    second = client.get(following)
    assert _rows(second) == ["team-b-two"]
    assert 'id="inbox-next"' not in second.text and 'id="inbox-first"' in second.text

    # A decided call leaves the inbox.
    with api.http(api.token("approver")) as http:
        decided = http.post(f"/v1/agents/{first['id']}/approve", headers={"If-Match": f'"r{first["revision"]}"'})
        assert decided.status_code == 200, decided.text
    assert _rows(client.get("/inbox")) == ["team-b-two"]


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("min_age=soon", "min_age &#39;soon&#39; is not an age: give a number with s, m, h or d"),
        ("min_age=-5m", "min_age &#39;-5m&#39; is not an age"),
        ("min_age=99999d", "min_age must be at most 3650 days"),
        ("tool=" + "t" * 201, "tool must be at most 200 characters, got 201"),
        ("agent_prefix=" + "a" * 201, "agent_prefix must be at most 200 characters, got 201"),
        ("tool=%00x", "tool must not contain NUL characters"),
        ("limit=0", "limit must be a whole number from 1 to 200, got &#39;0&#39;"),
        ("limit=many", "limit must be a whole number from 1 to 200"),
        ("cursor=nonsense", "cursor &#39;nonsense&#39; is not the &#39;next&#39; of a page of approvals"),
    ],
)
def test_a_bad_inbox_filter_is_a_400_naming_it(api: Api, browsers: Browsers, query: str, named: str) -> None:
    client = browsers.signed_in(api.token("auditor"))
    for path in ("/inbox", "/inbox/rows"):
        page = client.get(f"{path}?{query}")
        assert page.status_code == 400, page.text
        assert "Bad filter: " + named in page.text, page.text
        assert "Traceback" not in page.text
    form = client.get(f"/inbox?{query}").text
    assert 'id="min_age"' in form  # the form is there to fix it, the refused field marked
    field = query.split("=")[0]
    if field in ("tool", "min_age", "agent_prefix"):
        assert re.search(rf'<input id="{field}"[^>]* aria-invalid="true" aria-errormessage="inbox-error"', form)
    assert form.count('aria-invalid="true"') == (1 if field in ("tool", "min_age", "agent_prefix") else 0)


def test_the_inbox_shows_approval_timeouts_and_escalations(
    api: Api, browsers: Browsers, client: Client, db: Database
) -> None:
    _to_approval(client, db, "releaser", "console_release")
    paging = _to_approval(client, db, "pager", "console_page")
    viewer = browsers.signed_in(api.token("approver"))
    page = viewer.get("/inbox").text
    release = page.split('<tr data-call="releaser"')[1].split("</tr>")[0]
    assert re.search(r"rejected in 3h 59m \(limit 4h 0m\)", release), release
    assert 'class="due"' not in release
    deadline = time.monotonic() + 30
    while not calls_past_approval_timeout(db):
        assert time.monotonic() < deadline, "the approval timeout never passed"
        time.sleep(0.2)
    page = viewer.get("/inbox").text
    due = page.split('<tr data-call="pager"')[1].split("</tr>")[0]
    assert "limit 1s passed" in due and "escalating at the beat&#39;s next check" in due
    assert enforce_timeouts(db, Settings()).escalated == [paging.id]
    page = viewer.get("/inbox").text
    escalated = page.split('<tr data-call="pager"')[1].split("</tr>")[0]
    assert "escalated after 1s; still waiting for a person" in escalated
    listed = {a.agent: a for a in client.approvals().approvals}
    assert listed["pager"].escalated and listed["pager"].on_timeout == "escalate"
    assert listed["releaser"].approval_timeout_seconds == 4 * 3600 and not listed["releaser"].escalated
    assert listed["releaser"].times_out_at == listed["releaser"].since + timedelta(hours=4)


def test_a_token_limited_to_a_prefix_sees_its_agents_calls_only(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        waiting_agent(api, http, "team-a-bot")
        waiting_agent(api, http, "team-b-bot")
    client = browsers.signed_in(api.token("approver", prefix="team-a-", name="team-a-approver"))
    assert _rows(client.get("/inbox")) == ["team-a-bot"]
    assert _rows(client.get("/inbox?agent_prefix=team-b-")) == []
    assert _rows(client.get("/inbox?agent_prefix=team")) == ["team-a-bot"]


# --- edit and approve ---------------------------------------------------------------------------------------------


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
    job = job_row(api.db, "commenter-r1:tool:github_comment:1.call_0_0")
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
        ('{"repository": "acme/api", "issue": 7, "body": "x",}', "arguments are not valid JSON: Expecting property"),
        ('{"repository": "acme/api",\n "issue": seven}', "arguments are not valid JSON: Expecting value (line 2"),
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
    assert inbox.status_code == 200 and _rows(inbox) == ["commenter"]  # reading the inbox is allowed
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

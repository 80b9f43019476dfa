"""The operator console over HTTP, against a real ``keel serve``: sign-in, the pages, decisions, stale refusals,
CSRF and scopes. (tests/browser/ drives the same console in a real browser.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.ingress.tokens import revoke_token
from models.urls import libpq_url
from tests.support.api import Api, journal_count, waiting_agent
from tests.support.audit import as_superuser
from tests.support.console import Browsers, csrf_of


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


def test_the_agent_page_says_whether_its_keyed_chain_holds(api: Api, browsers: Browsers, db_url: str) -> None:
    client = Client(api.db)
    intact = client.create_agent("intact")
    edited = client.create_agent("edited")
    foreign = client.create_agent("foreign")
    with psycopg.connect(libpq_url(db_url), autocommit=True) as raw:
        as_superuser(
            raw,
            ("UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s", (edited.id,)),
            ("UPDATE audit.journal SET key_id = 'mallory-1' WHERE agent_id = %s", (foreign.id,)),
        )
    auditor = browsers.signed_in(api.token("auditor"))

    def status(agent_id: Any) -> str:
        page = auditor.get(f"/agents/{agent_id}")
        found = re.search(r'id="chain-status">([^<]*)</p>', page.text)
        assert page.status_code == 200 and found, page.text
        return found.group(1)

    assert status(intact.id) == "Chain verified: 1 events, intact from genesis to head."
    assert status(edited.id).startswith("Chain broken at event 1: the event&#39;s content does not match its HMAC")
    assert status(foreign.id) == (
        "Chain not checked: 1 events from event 1 on are linked with audit key mallory-1, which this API does not hold."
    )


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

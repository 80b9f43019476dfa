"""The operator console over HTTP, against a real ``keel serve``: sign-in, the pages, decisions, stale refusals,
CSRF and scopes. (tests/browser/ drives the same console in a real browser.)"""

from __future__ import annotations

import html
import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from html import unescape
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest
from pydantic import BaseModel, Field

from agents.audit.archive import check_archivable, insert_record_txn, sealed_record
from agents.audit.ship import ship
from agents.audit.store import FileStore
from agents.audit.verify import verify_and_record
from agents.client import Client
from agents.core.errors import StaleRevision
from agents.ingress.tokens import revoke_token
from agents.runtime.approvals import enforce_timeouts
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models import console_sql
from models.approvals_sql import calls_past_approval_timeout
from models.db import Database
from models.jobs_sql import job_row
from models.schemas import AgentState
from models.settings import Settings
from models.urls import libpq_url
from tests.support.api import Api, journal_count, problem, running_api, script, waiting_agent
from tests.support.audit import TEST_KEYS as KEYS
from tests.support.audit import as_superuser
from tests.support.broker import Broker
from tests.support.console import Browsers, csrf_of
from tests.support.keys import scoped
from tests.support.runs import run_all

#: Starts ``keel serve`` with these KEEL_* settings on the test's database and Redis prefix; stopped after the test.
Serve = Callable[[dict[str, str]], Api]
Browse = Callable[[Api], Browsers]


@pytest.fixture
def browsers(api: Api) -> Iterator[Browsers]:
    found = Browsers(api)
    yield found
    found.close()


@pytest.fixture
def serve(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> Iterator[Serve]:
    with ExitStack() as stack:

        def start(env: dict[str, str]) -> Api:
            return stack.enter_context(running_api(db, db_url, broker, tmp_path, env=env))

        yield start


@pytest.fixture
def browse() -> Iterator[Browse]:
    """Browsers of an API started by ``serve``, closed after the test."""
    made: list[Browsers] = []

    def of(api: Api) -> Browsers:
        made.append(Browsers(api))
        return made[-1]

    yield of
    for browsers in made:
        browsers.close()


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
        found = re.search(r'id="chain-status">(.*?)</p>', page.text, re.S)
        assert page.status_code == 200 and found, page.text
        return found.group(1)

    assert status(intact.id).startswith("Chain verified for the events shown, #1 to #1: each matches its hash")
    assert status(edited.id).startswith("Chain broken at event 1: the event&#39;s content does not match its HMAC")
    assert status(foreign.id).startswith(
        "Chain not checked for 1 of the events shown, #1 to #1: they are linked with an audit key this API does not"
        " hold"
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


# --- the sign-in limit --------------------------------------------------------------------------------------------


def _token_used(api: Api, name: str) -> bool:
    with api.db.connection() as conn:
        row = conn.execute("SELECT last_used_at FROM api_tokens WHERE name = %s", (name,)).fetchone()
        conn.rollback()
    assert row is not None
    return row[0] is not None


def test_failed_sign_ins_from_one_address_are_refused_until_the_allowance_comes_back(
    serve: Serve, browse: Browse
) -> None:
    # Three failures at once, then one more every 10 s; X-Forwarded-For believed from no one (the default).
    api = serve({"KEEL_CONSOLE_SIGNIN_BURST": "3", "KEEL_CONSOLE_SIGNIN_PER_MINUTE": "6"})
    browsers = browse(api)
    alice, bob = api.token("approver", name="alice"), api.token("approver", name="bob")
    guesser = browsers.new()  # from 127.0.0.1
    for _ in range(3):
        _, wrong = browsers.sign_in("keel_" + "x" * 43, client=guesser)
        assert wrong.status_code == 401 and "unknown or revoked" in wrong.text
    _, limited = browsers.sign_in("keel_" + "y" * 43, client=guesser)
    assert limited.status_code == 429
    wait = int(limited.headers["retry-after"])
    assert 1 <= wait <= 10
    assert f"Too many failed sign-ins from your address: wait {wait} seconds, then try again" in unescape(limited.text)
    assert limited.headers["ratelimit-policy"] == '"signin-address";q=3;w=30'

    # Over the limit a correct token is refused too, without being looked up (its last use is not noted).
    _, refused = browsers.sign_in(alice, client=guesser)
    assert refused.status_code == 429 and "keel_session" not in refused.headers.get("set-cookie", "")
    assert not _token_used(api, "alice")
    # Claiming another address is no way round it: no proxy is trusted.
    _, spoofed = browsers.sign_in(alice, client=guesser, headers={"X-Forwarded-For": "203.0.113.9"})
    assert spoofed.status_code == 429

    # Someone at another address signs in as if nothing happened.
    _, elsewhere = browsers.sign_in(bob, client=browsers.new(source="127.0.0.2"))
    assert elsewhere.status_code == 303 and elsewhere.headers["location"] == "/agents"

    time.sleep(int(refused.headers["retry-after"]))  # what the page told the person to do
    _, back = browsers.sign_in(alice, client=guesser)
    assert back.status_code == 303, back.text
    assert guesser.get("/agents").status_code == 200


def test_a_spray_from_many_addresses_never_locks_out_a_correct_token_at_a_console_or_the_api(
    serve: Serve, browse: Browse
) -> None:
    # Behind a trusted proxy each forwarded address counts; every address together may fail 3 times, then 1 a minute.
    api = serve(
        {
            "KEEL_API_FORWARDED_ALLOW_IPS": '["127.0.0.1"]',
            "KEEL_CONSOLE_SIGNIN_BURST": "2",
            "KEEL_CONSOLE_SIGNIN_PER_MINUTE": "1",
            "KEEL_CONSOLE_SIGNIN_GLOBAL_BURST": "3",
            "KEEL_CONSOLE_SIGNIN_GLOBAL_PER_MINUTE": "1",
        }
    )
    browsers = browse(api)
    secret = api.token("operator", name="olga")
    wrong = "keel_" + "x" * 43

    def sign_in(address: str, token: str) -> httpx.Response:
        return browsers.sign_in(token, headers={"X-Forwarded-For": address})[1]

    def call(address: str, token: str) -> int:
        with api.http(token) as http:
            return http.get("/v1/agents", headers={"X-Forwarded-For": address}).status_code

    assert [sign_in("203.0.113.5", wrong).status_code for _ in range(2)] == [401, 401]
    own = sign_in("203.0.113.5", secret)
    assert own.status_code == 429 and "from your address" in own.text  # the address's own failures
    assert own.headers["ratelimit-policy"].startswith('"signin-address";q=2')
    assert call("203.0.113.5", secret) == 429  # the same allowance at the API's door
    assert sign_in("203.0.113.6", secret).status_code == 303  # its own bucket; a success counts nowhere
    assert call("203.0.113.7", wrong) == 401  # the third failure over every address: the ceiling is reached
    # Sprayed from more addresses: each gets one failure, then its address is out of allowance.
    for n in range(10, 14):
        assert sign_in(f"203.0.113.{n}", wrong).status_code == 401
        assert call(f"203.0.113.{n}", wrong) == 429
        assert sign_in(f"203.0.113.{n}", secret).status_code == 429
    # Every operator at an address of their own still signs in and calls the API: successes are charged nowhere.
    for n in range(20, 24):
        assert sign_in(f"203.0.113.{n}", secret).status_code == 303
        assert call(f"203.0.113.{n}", secret) == 200


def test_failed_api_tokens_from_one_address_are_refused_before_the_lookup(serve: Serve) -> None:
    api = serve({"KEEL_CONSOLE_SIGNIN_BURST": "3", "KEEL_CONSOLE_SIGNIN_PER_MINUTE": "1"})
    secret = api.token("auditor", name="ada")
    with api.http("keel_" + "z" * 43) as guesser:
        assert [guesser.get("/v1/agents").status_code for _ in range(3)] == [401, 401, 401]
        over = guesser.get("/v1/agents")
    refused = problem(over, 429, "rate-limited")
    assert "too many failed tokens from your address" in refused["detail"]
    assert int(over.headers["retry-after"]) >= 1
    with api.http(secret) as http:
        assert http.get("/v1/agents").status_code == 429
    assert not _token_used(api, "ada")  # not looked up


def test_console_posts_count_against_the_tokens_rate_like_its_api_calls(serve: Serve, browse: Browse) -> None:
    api = serve({"KEEL_API_RATE_LIMITS": '{"approver": {"rate": 0.001, "burst": 2}}'})
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    browsers = browse(api)
    secret = api.token("approver", name="alice")
    client = browsers.signed_in(secret)  # signing in and reading pages cost nothing
    page = client.get(f"/agents/{state['id']}")
    assert client.get("/agents").status_code == 200
    drawn = str(state["revision"])
    forged = [client.post(f"/agents/{state['id']}/approve", data={"csrf": "forged", "revision": drawn}) for _ in "ab"]
    assert [f.status_code for f in forged] == [403, 403]  # refused, but counted: the API counts before it checks
    before = journal_count(api.db)
    over = client.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page), "revision": drawn})
    assert over.status_code == 429 and int(over.headers["retry-after"]) > 1
    assert "Token &#39;alice&#39; is over its rate" in over.text and "Nothing was changed" in over.text
    assert journal_count(api.db) == before
    for path in ("/outbox/retry", "/signout"):
        assert client.post(path, data={"csrf": csrf_of(page), "key": "k"}).status_code == 429
    with api.http(secret) as http:
        assert http.get("/v1/agents").status_code == 429  # one bucket for the token, console and API alike
    with api.http(api.token("operator")) as http:
        assert http.get(f"/v1/agents/{state['id']}").json()["revision"] == state["revision"]


# --- paging -------------------------------------------------------------------------------------------------------

_ROW = re.compile(r'<tr class="phase-(\w+)" data-agent="([^"]+)"')
_NEXT = re.compile(r'<a href="([^"]+)" rel="next"')


def _walk(client: httpx.Client, url: str, row: re.Pattern[str]) -> list[tuple[list[tuple[str, ...]], str]]:
    """Every page of a list from ``url`` by its "next" links: each page's rows and its text."""
    pages = []
    while True:
        page = client.get(url)
        assert page.status_code == 200, page.text
        pages.append(([tuple(m) if isinstance(m, tuple) else (m,) for m in row.findall(page.text)], page.text))
        found = _NEXT.search(page.text)
        if found is None:
            return pages
        url = unescape(found.group(1))
        assert len(pages) < 50, "the pages do not end"


def test_the_agents_list_pages_through_every_agent_once_waiting_first_and_keeps_the_filter(
    serve: Serve, browse: Browse
) -> None:
    api = serve({"KEEL_CONSOLE_PAGE_SIZE": "3"})
    with api.http(api.token("operator")) as http:
        for n in range(7):
            assert http.post("/v1/agents", json={"name": f"idle-{n}"}).status_code == 201
        waiting_agent(api, http, "waits-longest")
        waiting_agent(api, http, "waits-less")
    browsers = browse(api)
    client = browsers.signed_in(api.token("approver"))

    pages = _walk(client, "/agents", _ROW)
    names = [name for rows, _ in pages for _, name in rows]
    everyone = [f"idle-{n}" for n in range(7)] + ["waits-longest", "waits-less"]
    assert len(pages) == 3 and sorted(names) == sorted(everyone)
    assert len(set(names)) == len(names) == 9
    assert names[:2] == ["waits-longest", "waits-less"]  # waiting first, longest waiting first
    assert names[2:] == [f"idle-{n}" for n in reversed(range(7))]  # then newest first
    first, *later = [text for _, text in pages]
    assert "data-live-list" in first and 'id="paging-notice"' not in first
    for text in later:
        assert "data-live-list" not in text and "Not live: this is a later page" in text

    idle = _walk(client, "/agents?phase=idle", _ROW)
    assert [name for rows, _ in idle for _, name in rows] == [f"idle-{n}" for n in reversed(range(7))]
    assert {phase for rows, _ in idle for phase, _ in rows} == {"idle"}
    assert all("phase=idle" in unescape(link) for _, text in idle[:-1] for link in _NEXT.findall(text))
    assert 'option value="idle" selected' in idle[1][1]

    rows = client.get("/agents/rows")  # what the live script redraws: the first page, with its link onwards
    assert [name for _, name in _ROW.findall(rows.text)] == names[:3] and _NEXT.search(rows.text)

    bogus = client.get("/agents?cursor=garbage")
    assert bogus.status_code == 400 and "The page cursor &#39;garbage&#39; is not one this list made" in bogus.text
    from_idle = unescape(_NEXT.findall(idle[0][1])[0]).split("cursor=")[1]
    other_filter = client.get(f"/agents?phase=waiting_approval&cursor={from_idle}")
    assert other_filter.status_code == 400 and "from another list or filter" in other_filter.text


_MESSAGE = re.compile(r'<tr class="status-(\w+)" data-key="([^"]+)"')


def test_the_outbox_pages_through_every_unsent_message_once_and_keeps_the_status_filter(
    serve: Serve, browse: Browse
) -> None:
    api = serve({"KEEL_CONSOLE_PAGE_SIZE": "3"})
    agent = Client(api.db).create_agent("sender")
    statuses = ["pending", "dead", "sent", "dead", "pending", "sending", "sent", "dead", "pending", "dead", "pending"]
    with api.db.connection() as conn:
        for n, status in enumerate(statuses):
            conn.execute(
                "INSERT INTO outbox (key, agent_id, request_id, channel, destination, payload, status,"
                " next_attempt_at, external_id) VALUES (%s, %s, 'r1', 'slack', %s, '{}', %s, now(), %s)",
                (f"r1:slack:{n}", agent.id, f"C0{n % 2}", status, "ts" if status == "sent" else None),
            )
        conn.commit()
    browsers = browse(api)
    client = browsers.signed_in(api.token("operator"))
    unsent = [(status, f"r1:slack:{n}") for n, status in enumerate(statuses) if status != "sent"]

    pages = _walk(client, "/outbox", _MESSAGE)
    shown = [row for rows, _ in pages for row in rows]
    assert sorted(shown, key=lambda r: r[1]) == sorted(unsent, key=lambda r: r[1]) and len(shown) == len(unsent)
    assert [len(rows) for rows, _ in pages] == [3, 3, 3]
    newest = [key for _, key in unsent][::-1][:3]
    assert sorted(key for _, key in pages[0][0]) == sorted(newest)  # newest first, page by page
    assert "the counts below are of this page" in pages[0][1]

    dead = _walk(client, "/outbox?status=dead", _MESSAGE)
    assert sorted(key for rows, _ in dead for _, key in rows) == sorted(k for s, k in unsent if s == "dead")
    assert {status for rows, _ in dead for status, _ in rows} == {"dead"}
    assert all("status=dead" in unescape(link) for _, text in dead[:-1] for link in _NEXT.findall(text))

    bogus = client.get("/outbox?cursor=x1")
    assert bogus.status_code == 400 and "The page cursor &#39;x1&#39; is not one this list made" in bogus.text
    sleeping = client.get("/outbox?status=sent")
    assert sleeping.status_code == 400 and "lists pending, sending, dead" in sleeping.text


_EVENT = re.compile(r'<span class="seq">#(\d+)</span>')


HMAC_BROKEN = (
    "the event's content does not match its HMAC under key 'test-1': it was changed or forged (or KEEL_AUDIT_KEYS"
    " holds another secret under that id)"
)


def _tamper(api: Api, agent_id: str, seq: int) -> None:
    with api.db.connection() as conn:
        conn.execute("ALTER TABLE audit.journal DISABLE TRIGGER USER")
        conn.execute("UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = %s", (agent_id, seq))
        conn.execute("ALTER TABLE audit.journal ENABLE TRIGGER USER")
        conn.commit()


def _status(text: str) -> str:
    found = re.search(r'<p class="notice[^"]*"[^>]*id="chain-status">(.*?)</p>', text, re.S)
    assert found is not None, text
    return re.sub(r"<[^>]+>", "", unescape(found.group(1)))


def test_the_journal_pages_and_verifies_only_the_events_it_shows(serve: Serve, browse: Browse) -> None:
    api = serve({"KEEL_CONSOLE_PAGE_SIZE": "5"})
    client = Client(api.db)
    agent = client.create_agent("chatty")
    for _ in range(11):  # each stale approval is journaled as refused: events 2..12
        with pytest.raises(StaleRevision):
            client.approve(agent.id, expected_revision=99, actor="bob")
    browsers = browse(api)
    viewer = browsers.signed_in(api.token("auditor"))
    url = f"/agents/{agent.id}"

    pages = _walk(viewer, url, _EVENT)
    assert [[int(seq) for (seq,) in rows] for rows, _ in pages] == [
        [12, 11, 10, 9, 8], [7, 6, 5, 4, 3], [2, 1]
    ]  # fmt: skip
    latest, middle, oldest = (text for _, text in pages)
    assert _status(latest) == (
        "Chain verified for the events shown, #8 to #12: each matches its hash and links to the one before (#8 to"
        " #7's stored hash); #12 is the agent's head. Events before #8 were not checked here. Full check: keel audit"
        " verify."
    )
    assert "from the chain's start" in _status(oldest) and "Events before" not in _status(oldest)
    assert "does not grow as events are added" in middle and 'data-panel="/agents/' in middle
    assert "No full check of every chain has run yet." in latest

    _tamper(api, str(agent.id), 2)  # outside the latest page: not claimed either way there
    latest = viewer.get(url).text
    assert _status(latest).startswith("Chain verified for the events shown, #8 to #12")
    assert "Events before #8 were not checked here" in _status(latest)
    oldest = viewer.get(f"{url}?cursor=3").text
    # The window judges an event as keel audit verify does: the same check, the same words.
    assert _status(oldest) == f"Chain broken at event 2: {HMAC_BROKEN}"
    panel = viewer.get(f"{url}/panel?drawn=1&cursor=3").text  # the live redraw keeps the page it shows
    assert _status(panel).startswith("Chain broken at event 2")

    verify_and_record(api.db, "cli")
    latest = viewer.get(url).text
    assert "found 1 broken chain, this agent's among them, at event 2." in latest
    with api.db.autocommit() as cur:  # an "ok" inserted with the database's credentials, without the audit key
        cur.execute(
            "INSERT INTO audit_verifications (source, ok, agents, events, breaks, details, key_id, seal)"
            " VALUES ('cli', true, 1, 12, 0, '{}', 'test-1', 'forged')"
        )
    latest = viewer.get(url).text
    assert "found every chain intact" not in latest
    assert "cannot be believed: its seal does not match its content" in latest

    _tamper(api, str(agent.id), 10)  # inside the latest page
    assert _status(viewer.get(url).text) == f"Chain broken at event 10: {HMAC_BROKEN}"

    for bad in ("abc", "1", "-4"):
        answer = viewer.get(f"{url}?cursor={bad}")
        assert answer.status_code == 400 and f"The page cursor &#39;{bad}&#39; is not one this list made" in answer.text


def test_a_chain_whose_early_events_were_archived_is_checked_from_its_archived_head(
    serve: Serve, browse: Browse, tmp_path: Path
) -> None:
    api = serve({"KEEL_CONSOLE_PAGE_SIZE": "5"})
    client = Client(api.db)
    agent = client.create_agent("long-lived")
    for _ in range(7):  # events 2..8
        with pytest.raises(StaleRevision):
            client.approve(agent.id, expected_revision=99, actor="bob")
    store = FileStore(tmp_path / "store")
    ship(api.db, store, KEYS, destination="here", segment_events=3, segment_age=timedelta(minutes=9), flush=True)
    with api.db.connection() as conn:  # archive events 1..4 as a real archive leaves them: the record, rows gone
        upto = conn.execute("SELECT id FROM audit.journal WHERE agent_id = %s AND seq = 4", (agent.id,)).fetchone()
        assert upto is not None
        proved = check_archivable(
            conn, store, KEYS, what="test", destination="here", first_id=1, last_id=upto[0], events=4
        )
        now = datetime.now(UTC)
        insert_record_txn(
            conn,
            sealed_record(
                KEYS, proved, partition="journal_legacy", from_at=None, to_at=now, archived_by="t", archived_at=now
            ),
        )
        conn.commit()
    with api.db.connection() as conn:
        as_superuser(conn, ("DELETE FROM audit.journal WHERE id <= %s", (upto[0],)))
    viewer = browse(api).signed_in(api.token("auditor"))
    url = f"/agents/{agent.id}"
    pages = _walk(viewer, url, _EVENT)
    assert [[int(seq) for (seq,) in rows] for rows, _ in pages] == [[8, 7, 6, 5]]  # nothing older to page to
    assert _status(pages[0][1]) == (
        "Chain verified for the events shown, #5 to #8: each matches its hash and links to the one before (#5 to the"
        " head of the chain's archived part, events #1 to #4, as its sealed archive record says); #8 is the agent's"
        " head. Full check: keel audit verify."
    )
    with api.db.connection() as conn:  # a forged record: the window says so, as verify does
        as_superuser(conn, ("UPDATE audit.archived_partitions SET archived_by = 'mallory'", ()))
    assert _status(viewer.get(url).text) == (
        "Chain broken at event 4: archive record journal_legacy does not match its seal under key 'test-1': it was"
        " altered, or not written by keel audit archive"
    )


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


# --- found in review (issue 13) -----------------------------------------------------------------------------------


def test_odd_characters_in_a_form_are_refused_naming_the_problem_not_an_internal_error(
    api: Api, browsers: Browsers
) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    before = journal_count(api.db)
    # Before anyone signs in: a sign-in form whose CSRF token is not ASCII.
    visitor = browsers.new()
    visitor.get("/signin")
    signin = visitor.post("/signin", data={"csrf": "é", "token": api.token("approver"), "next": "/agents"})
    assert signin.status_code == 403 and "The sign-in form expired" in signin.text
    client = browsers.signed_in(api.token("approver", "operator", name="alice"))
    page = client.get(f"/agents/{state['id']}")
    approve = client.post(f"/agents/{state['id']}/approve", data={"csrf": "é", "revision": str(state["revision"])})
    assert approve.status_code == 403 and "CSRF" in approve.text
    assert client.post("/signout", data={"csrf": "ü"}).status_code == 403
    retry = client.post("/outbox/retry", data={"csrf": csrf_of(page), "key": "a\x00b"})
    assert retry.status_code == 400 and "key" in retry.text
    assert journal_count(api.db) == before
    assert "unexpected error" not in api.log()


def test_an_escalated_call_still_says_since_when_it_has_waited(
    api: Api, browsers: Browsers, client: Client, db: Database
) -> None:
    paging = _to_approval(client, db, "pager", "console_page")
    (call,) = client.approvals().approvals
    deadline = time.monotonic() + 30
    while not calls_past_approval_timeout(db):
        assert time.monotonic() < deadline, "the approval timeout never passed"
        time.sleep(0.2)
    assert enforce_timeouts(db, Settings()).escalated == [paging.id]  # a move: the agent's updated_at is now
    viewer = browsers.signed_in(api.token("approver"))
    page = viewer.get(f"/agents/{paging.id}").text
    since = re.search(r"<dt>Waiting since</dt><dd><time datetime=\"([^\"]+)\"", page)
    assert since is not None and since.group(1) == call.since.isoformat(), (since, call.since)


def test_signing_out_ends_the_session_even_for_a_copy_of_its_cookie(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    secret = api.token("approver", name="alice")
    client = browsers.signed_in(secret)
    elsewhere = browsers.signed_in(secret)  # the same token signed in on another machine
    cookie = client.cookies["keel_session"]
    page = client.get(f"/agents/{state['id']}")
    assert client.post("/signout", data={"csrf": csrf_of(page)}).status_code == 303
    copy = browsers.new()  # whoever kept the cookie (a shared machine, a proxy's log) after the person signed out
    copy.cookies.set("keel_session", cookie)
    again = copy.get("/agents")
    assert again.status_code == 303 and again.headers["location"].startswith("/signin")
    before = journal_count(api.db)
    forged = copy.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page), "revision": "3"})
    assert forged.status_code == 401 and journal_count(api.db) == before
    assert elsewhere.get("/agents").status_code == 200  # signing out ends that session, not the token's others


# --- found in review, follow-up (issue 13) ------------------------------------------------------------------------


def test_an_escalated_call_keeps_its_place_in_the_agents_list(serve: Serve, browse: Browse, db: Database) -> None:
    api = serve({"KEEL_CONSOLE_PAGE_SIZE": "1"})
    client = Client(db)
    paging = _to_approval(client, db, "pager", "console_page")  # waits longest; its tool escalates after 1s
    _to_approval(client, db, "releaser", "console_release")
    client.create_agent("idle-one")
    deadline = time.monotonic() + 30
    while not calls_past_approval_timeout(db):
        assert time.monotonic() < deadline, "the approval timeout never passed"
        time.sleep(0.2)
    assert enforce_timeouts(db, Settings()).escalated == [paging.id]  # a move within the wait
    assert client.get_state(paging.id).updated_at > client.get_state("releaser").updated_at
    viewer = browse(api).signed_in(api.token("approver"))
    pages = _walk(viewer, "/agents", _ROW)
    assert [name for rows, _ in pages for _, name in rows] == ["pager", "releaser", "idle-one"]  # a page each
    assert [name for rows, _ in _walk(viewer, "/agents?phase=waiting_approval", _ROW) for _, name in rows] == [
        "pager",
        "releaser",
    ]
    inbox = [call.agent for call in client.approvals().approvals]
    assert inbox == ["pager", "releaser"]  # the same order as the inbox: by when the call started waiting


def test_the_waiting_run_of_the_agents_list_is_read_by_its_index(db: Database) -> None:
    """A few thousand agents, most of them waiting: a page after a cursor is an index scan, never a sort."""
    with db.connection() as conn:
        conn.execute(
            "INSERT INTO agents (name, phase, request_id, revision, created_at, updated_at, waiting_since)"
            " SELECT 'w-' || n, 'waiting_approval', 'r-' || n, 3, now() - interval '1 day', now(),"
            " now() - n * interval '1 second' FROM generate_series(1, 3000) n"
        )
        conn.execute(
            "INSERT INTO agents (name, phase, created_at, updated_at)"
            " SELECT 'i-' || n, 'idle', now(), now() FROM generate_series(1, 2000) n"
        )
        conn.execute("ANALYZE agents")
        conn.commit()
    rows, key = console_sql.agents_page(db, limit=50)
    assert len(rows) == 50 and key is not None
    assert [r.name for r in rows[:3]] == ["w-3000", "w-2999", "w-2998"]  # longest waiting first
    sql = console_sql._run_sql(console_sql.WAITING, after=True, prefix=False)
    params = {"at": key.at, "id": key.id, "limit": 51, "phase": key.phase, "prefix": None}
    with db.connection() as conn:
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql, params))
        conn.rollback()
    assert "ix_agents_waiting_since" in plan and "Sort" not in plan, plan
    later, _ = console_sql.agents_page(db, after=key, limit=50)
    assert [r.name for r in later[:2]] == ["w-2950", "w-2949"]


def test_the_outbox_notice_is_one_the_server_made_for_this_session(api: Api, browsers: Browsers) -> None:
    agent = Client(api.db).create_agent("sender")
    with api.db.connection() as conn:
        conn.execute(
            "INSERT INTO outbox (key, agent_id, request_id, channel, destination, payload, status, next_attempt_at)"
            " VALUES ('r1:slack:dead', %s, 'r1', 'slack', 'C01', '{\"text\": \"hi\"}', 'dead', now())",
            (agent.id,),
        )
        conn.commit()
    operator = browsers.signed_in(api.token("operator", name="olga"))
    crafted = operator.get("/outbox", params={"notice": "Your session ended: sign in again at https://evil.example"})
    assert crafted.status_code == 200 and "evil.example" not in crafted.text and "outbox-notice" not in crafted.text

    page = operator.get("/outbox")
    retried = operator.post("/outbox/retry", data={"csrf": csrf_of(page), "key": "r1:slack:dead"})
    assert retried.status_code == 303, retried.text
    shown = operator.get(retried.headers["location"])
    notice = re.search(r'<p class="notice ok" role="status" id="outbox-notice">([^<]*)</p>', shown.text)
    assert notice is not None and notice.group(1) == "Retrying r1:slack:dead: it is back in line to be sent.", (
        shown.text
    )

    # The same link in another session, or with another key, shows nothing.
    other = browsers.signed_in(api.token("operator", name="otto"))
    assert "outbox-notice" not in other.get(retried.headers["location"]).text
    forged = retried.headers["location"].replace("r1%3Aslack%3Adead", "r1%3Aslack%3Aother")
    assert forged != retried.headers["location"] and "outbox-notice" not in operator.get(forged).text


#: What every console answer carries, error pages included.
_SECURITY_HEADERS = {
    "content-security-policy": "frame-ancestors 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def _secured(answer: httpx.Response) -> None:
    for name, value in _SECURITY_HEADERS.items():
        assert value in answer.headers.get(name, ""), (answer.status_code, answer.request.url, name, answer.headers)


def test_every_console_answer_carries_the_security_headers_errors_included(serve: Serve, browse: Browse) -> None:
    api = serve({"KEEL_API_RATE_LIMITS": '{"approver": {"rate": 0.001, "burst": 1}}'})
    browsers = browse(api)
    signed_out = browsers.new()
    unauthorized = signed_out.post("/agents/x/approve", data={"csrf": "c", "revision": "1"})
    assert unauthorized.status_code == 401 and "Sign in again" in unauthorized.text
    _secured(unauthorized)
    _secured(signed_out.get("/agents"))  # the redirect to the sign-in form
    _secured(signed_out.get("/signin"))
    client = browsers.signed_in(api.token("approver"))
    page = client.get("/agents")
    _secured(page)
    for path, status in (
        ("/agents?cursor=garbage", 400),
        ("/agents?phase=sleeping", 400),
        ("/agents/nobody", 404),
        ("/agents/nobody/panel?drawn=-1", 422),  # refused by the query's own validation (a problem document)
        ("/agents/a/b/c", 404),  # no such console page
        ("/static/console.css", 200),
    ):
        answer = client.get(path)
        assert answer.status_code == status, (path, answer.text)
        _secured(answer)
    assert client.post("/signout", data={"csrf": "forged"}).status_code == 403  # counted: the token's burst is spent
    over = client.post("/signout", data={"csrf": csrf_of(page)})
    assert over.status_code == 429
    _secured(over)
    with api.http() as http:  # the API's docs are not the console's: Swagger UI loads its assets from elsewhere
        assert "content-security-policy" not in http.get("/docs").headers


def test_the_live_list_wakes_only_for_the_tokens_own_agents(api: Api, browsers: Browsers, client: Client) -> None:
    """Another tenant's journal writes neither wake a prefixed token's live list nor tell it that they happened."""
    other = client.create_agent("team-b-bot")
    mine = browsers.signed_in(api.token("approver", prefix="team-a-", name="team-a-watcher"))
    theirs = browsers.signed_in(api.token("approver", prefix="team-b-"))
    timeout = httpx.Timeout(30, read=30)
    with (
        mine.stream("GET", "/agents/live", timeout=timeout) as quiet,
        theirs.stream("GET", "/agents/live", timeout=timeout) as woken,
    ):
        assert quiet.status_code == woken.status_code == 200
        client.submit(other.id, "b-1", script({"content": "hi"}), actor="producer")
        # team-b's list hears of it; by then the listener has dispatched it to every list.
        assert "event: changed" in next(woken.iter_text())
        revoke_token(api.db, "team-a-watcher", actor="test")  # ends the quiet stream: it must have sent nothing
        assert [line for line in quiet.iter_lines() if line.startswith("event:")] == []

"""The console's agents list, against a real ``keel serve``: its pages and phase filter, waiting agents first
(read by their index), and its live redraw that wakes only for the token's own agents."""

from __future__ import annotations

import time
from collections.abc import Iterator
from html import unescape
from pathlib import Path

import httpx
import pytest

from agents.client import Client
from agents.ingress.tokens import revoke_token
from agents.runtime.approvals import enforce_timeouts
from models import console_sql
from models.approvals_sql import calls_past_approval_timeout
from models.db import Database
from models.settings import Settings
from tests.support.api import Api, script, waiting_agent
from tests.support.broker import Broker
from tests.support.console import AGENT_ROW, NEXT_PAGE, Browse, Browsers, Serve, browsing, serving, walk
from tests.support.console_tools import to_approval

pytestmark = pytest.mark.integration


@pytest.fixture
def browsers(api: Api) -> Iterator[Browsers]:
    found = Browsers(api)
    yield found
    found.close()


@pytest.fixture
def serve(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> Iterator[Serve]:
    with serving(db, db_url, broker, tmp_path) as start:
        yield start


@pytest.fixture
def browse() -> Iterator[Browse]:
    """Browsers of an API started by ``serve``, closed after the test."""
    with browsing() as of:
        yield of


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

    pages = walk(client, "/agents", AGENT_ROW)
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

    idle = walk(client, "/agents?phase=idle", AGENT_ROW)
    assert [name for rows, _ in idle for _, name in rows] == [f"idle-{n}" for n in reversed(range(7))]
    assert {phase for rows, _ in idle for phase, _ in rows} == {"idle"}
    assert all("phase=idle" in unescape(link) for _, text in idle[:-1] for link in NEXT_PAGE.findall(text))
    assert 'option value="idle" selected' in idle[1][1]

    rows = client.get("/agents/rows")  # what the live script redraws: the first page, with its link onwards
    assert [name for _, name in AGENT_ROW.findall(rows.text)] == names[:3] and NEXT_PAGE.search(rows.text)

    bogus = client.get("/agents?cursor=garbage")
    assert bogus.status_code == 400 and "The page cursor &#39;garbage&#39; is not one this list made" in bogus.text
    from_idle = unescape(NEXT_PAGE.findall(idle[0][1])[0]).split("cursor=")[1]
    other_filter = client.get(f"/agents?phase=waiting_approval&cursor={from_idle}")
    assert other_filter.status_code == 400 and "from another list or filter" in other_filter.text


def test_an_escalated_call_keeps_its_place_in_the_agents_list(serve: Serve, browse: Browse, db: Database) -> None:
    api = serve({"KEEL_CONSOLE_PAGE_SIZE": "1"})
    client = Client(db)
    paging = to_approval(client, db, "pager", "console_page")  # waits longest; its tool escalates after 1s
    to_approval(client, db, "releaser", "console_release")
    client.create_agent("idle-one")
    deadline = time.monotonic() + 30
    while not calls_past_approval_timeout(db):
        assert time.monotonic() < deadline, "the approval timeout never passed"
        time.sleep(0.2)
    assert enforce_timeouts(db, Settings()).escalated == [paging.id]  # a move within the wait
    assert client.get_state(paging.id).updated_at > client.get_state("releaser").updated_at
    viewer = browse(api).signed_in(api.token("approver"))
    pages = walk(viewer, "/agents", AGENT_ROW)
    assert [name for rows, _ in pages for _, name in rows] == ["pager", "releaser", "idle-one"]  # a page each
    assert [name for rows, _ in walk(viewer, "/agents?phase=waiting_approval", AGENT_ROW) for _, name in rows] == [
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

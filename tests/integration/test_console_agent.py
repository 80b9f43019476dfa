"""One agent's page in the console, against a real ``keel serve``: its journal a page at a time, what was
verified of the events it shows (its archived part included), and since when its call has waited."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from html import unescape
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agents.audit.archive import check_archivable, insert_record_txn, sealed_record
from agents.audit.ship import ship
from agents.audit.store import FileStore
from agents.audit.verify import verify_and_record
from agents.client import Client
from agents.core.errors import StaleRevision
from agents.runtime.approvals import enforce_timeouts
from models.approvals_sql import calls_past_approval_timeout
from models.db import Database
from models.settings import Settings
from models.urls import libpq_url
from tests.support.api import Api
from tests.support.audit import TEST_KEYS as KEYS
from tests.support.audit import as_superuser
from tests.support.broker import Broker
from tests.support.console import Browse, Browsers, Serve, browsing, serving, walk
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

    pages = walk(viewer, url, _EVENT)
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
    pages = walk(viewer, url, _EVENT)
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


def test_an_escalated_call_still_says_since_when_it_has_waited(
    api: Api, browsers: Browsers, client: Client, db: Database
) -> None:
    paging = to_approval(client, db, "pager", "console_page")
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


def test_the_agent_page_shows_the_requests_outcome_and_its_dead_side_effects(
    api: Api, browsers: Browsers, client: Client, db: Database
) -> None:
    """Before: the page said `done` while the request's Slack message was dead (`slack is not configured`), and the
    answer sat in a job nobody opened."""
    from tests.support.api import script
    from tests.support.outbox import one_pass
    from tests.support.runs import run_all

    poster = client.create_agent("poster")
    post = {"name": "slack_post", "arguments": {"channel": "C0OPS", "text": "deploy done"}}
    client.submit(poster.id, "P1", script({"tool_calls": [post]}, {"content": "Posted <the> note."}))
    for _ in range(4):
        run_all(db)
    one_pass(db)  # no senders: the Slack message goes dead
    page = browsers.signed_in(api.token("operator")).get(f"/agents/{poster.id}").text
    answer = re.search(r'<dd id="outcome-answer">(.*?)</dd>', page)
    assert answer is not None and answer.group(1) == "Posted &lt;the&gt; note.", page  # escaped, as every value
    effects = re.search(r'<dd id="outcome-effects">(.*?)</dd>', page, re.S)
    assert effects is not None and "slack C0OPS: dead (slack is not configured" in unescape(effects.group(1))
    assert 'id="outcome-dead"' in page and "never arrived, though the request is done" in page
    assert "<dt>Spent</dt><dd>200 tokens, $0.0020</dd>" in page  # as the state's spend says it
    assert re.search(r'id="agent-dead">1 of this agent\'s Slack/GitHub messages is dead', page), page

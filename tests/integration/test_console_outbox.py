"""The console's outbox (and KPIs) pages, against a real ``keel serve``: the messages not sent, a page at a
time with a status filter, and the notice after a Retry, shown only to the session that retried."""

from __future__ import annotations

import re
from collections.abc import Iterator
from html import unescape
from pathlib import Path

import pytest

from agents.client import Client
from models.db import Database
from tests.support.api import Api
from tests.support.broker import Broker
from tests.support.console import NEXT_PAGE, Browse, Browsers, Serve, browsing, csrf_of, serving, walk

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


def test_the_outbox_and_kpi_pages_render_for_an_operator(api: Api, browsers: Browsers) -> None:
    client = browsers.signed_in(api.token("operator"))
    outbox = client.get("/outbox")
    assert outbox.status_code == 200 and "<h1>Outbox</h1>" in outbox.text
    kpis = client.get("/kpis")
    assert kpis.status_code == 200 and "Failure rate" in kpis.text and "<svg" in kpis.text
    approver = browsers.signed_in(api.token("approver"))
    assert approver.get("/outbox").status_code == 403


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

    pages = walk(client, "/outbox", _MESSAGE)
    shown = [row for rows, _ in pages for row in rows]
    assert sorted(shown, key=lambda r: r[1]) == sorted(unsent, key=lambda r: r[1]) and len(shown) == len(unsent)
    assert [len(rows) for rows, _ in pages] == [3, 3, 3]
    newest = [key for _, key in unsent][::-1][:3]
    assert sorted(key for _, key in pages[0][0]) == sorted(newest)  # newest first, page by page
    assert "the counts below are of this page" in pages[0][1]

    dead = walk(client, "/outbox?status=dead", _MESSAGE)
    assert sorted(key for rows, _ in dead for _, key in rows) == sorted(k for s, k in unsent if s == "dead")
    assert {status for rows, _ in dead for status, _ in rows} == {"dead"}
    assert all("status=dead" in unescape(link) for _, text in dead[:-1] for link in NEXT_PAGE.findall(text))

    bogus = client.get("/outbox?cursor=x1")
    assert bogus.status_code == 400 and "The page cursor &#39;x1&#39; is not one this list made" in bogus.text
    sleeping = client.get("/outbox?status=sent")
    assert sleeping.status_code == 400 and "lists pending, sending, dead" in sleeping.text


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

"""The console's inbox, against a real ``keel serve``: every call waiting for approval, oldest first, its
filters (a bad one named), its pages, approval timeouts and escalations, and a prefixed token's share."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from agents.client import Client
from agents.runtime.approvals import enforce_timeouts
from models.approvals_sql import calls_past_approval_timeout
from models.db import Database
from models.settings import Settings
from tests.support.api import Api, waiting_agent
from tests.support.console import Browsers, inbox_rows
from tests.support.console_tools import to_approval

pytestmark = pytest.mark.integration


@pytest.fixture
def browsers(api: Api) -> Iterator[Browsers]:
    found = Browsers(api)
    yield found
    found.close()


def test_the_inbox_lists_every_waiting_call_oldest_first_and_filters_it(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        first = waiting_agent(api, http, "team-a-one")
        waiting_agent(api, http, "team-b-two")
        http.post("/v1/agents", json={"name": "team-a-idle"})
    client = browsers.signed_in(api.token("approver", name="alice"))
    page = client.get("/inbox")
    assert page.status_code == 200, page.text
    assert '<a href="/inbox">Inbox</a>' in page.text  # in the navigation
    assert inbox_rows(page) == ["team-a-one", "team-b-two"]
    row = page.text.split('<tr data-call="team-a-one"')[1].split("</tr>")[0]
    assert f'href="/agents/{first["id"]}#approval"' in row and f"r{first['revision']}" in row
    assert "github_comment" in row and "team-a-one-r1</span> · round 1" in row
    assert "&#34;body&#34;: &#34;Fixed&#34;" in row  # the arguments, expandable
    assert "since <time" in row and "none" in row  # github_comment has no approval timeout
    assert 'data-live-list="/agents/live" data-rows="/inbox/rows"' in page.text  # live, as the agents page

    assert inbox_rows(client.get("/inbox?tool=github_comment")) == ["team-a-one", "team-b-two"]
    no_match = client.get("/inbox?tool=slack_post")
    assert inbox_rows(no_match) == [] and "No call is waiting for approval that matches these filters" in no_match.text
    assert 'value="slack_post"' in no_match.text  # the form keeps what was asked
    assert inbox_rows(client.get("/inbox?agent_prefix=team-b-")) == ["team-b-two"]
    assert inbox_rows(client.get("/inbox?min_age=1h")) == []
    assert inbox_rows(client.get("/inbox?min_age=0&tool=&agent_prefix=")) == ["team-a-one", "team-b-two"]  # blank: any
    assert inbox_rows(client.get("/inbox/rows?agent_prefix=team-a-")) == ["team-a-one"]

    # One call a page: the next page's link carries the filters and the API's keyset cursor.
    one = client.get("/inbox?limit=1&tool=github_comment")
    assert inbox_rows(one) == ["team-a-one"]
    found = re.search(r'<a href="([^"]+)" id="inbox-next"', one.text)
    assert found is not None, one.text
    following = html.unescape(found.group(1))
    assert "tool=github_comment" in following and "limit=1" in following and "cursor=" in following
    second = client.get(following)
    assert inbox_rows(second) == ["team-b-two"]
    assert 'id="inbox-next"' not in second.text and 'id="inbox-first"' in second.text

    # A decided call leaves the inbox.
    with api.http(api.token("approver")) as http:
        decided = http.post(f"/v1/agents/{first['id']}/approve", headers={"If-Match": f'"r{first["revision"]}"'})
        assert decided.status_code == 200, decided.text
    assert inbox_rows(client.get("/inbox")) == ["team-b-two"]


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
    to_approval(client, db, "releaser", "console_release")
    paging = to_approval(client, db, "pager", "console_page")
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
    assert inbox_rows(client.get("/inbox")) == ["team-a-bot"]
    assert inbox_rows(client.get("/inbox?agent_prefix=team-b-")) == []
    assert inbox_rows(client.get("/inbox?agent_prefix=team")) == ["team-a-bot"]

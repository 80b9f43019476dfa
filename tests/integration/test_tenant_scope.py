"""Request ids are each agent's own, and every request-scoped read takes the agent it reads for: one tenant can
neither occupy, block, read nor learn of another's requests — through the API, the console, the Client and the
scheduler alike (ARCHITECTURE invariant 15)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest

from agents.client import Client
from agents.core.errors import InvalidInput
from agents.jobs import schedules
from tests.support.api import Api, problem, script
from tests.support.console import Browsers
from tests.support.runs import run_all

pytestmark = pytest.mark.integration

SECRET_CHANNEL = "C0BSECRET"
POST = script(
    {"tool_calls": [{"name": "slack_post", "arguments": {"channel": SECRET_CHANNEL, "text": "refund approved"}}]},
    {"content": "Posted."},
)


@pytest.fixture
def browsers(api: Api) -> Iterator[Browsers]:
    found = Browsers(api)
    yield found
    found.close()


def _agent(http: httpx.Client, name: str) -> dict[str, Any]:
    created = http.post("/v1/agents", json={"name": name})
    assert created.status_code == 201, created.text
    return created.json()  # type: ignore[no-any-return]


def _submit(http: httpx.Client, agent: dict[str, Any], request_id: str, body: Any, **headers: str) -> httpx.Response:
    return http.post(
        f"/v1/agents/{agent['id']}/requests", json={"input": body}, headers={"Idempotency-Key": request_id, **headers}
    )


def test_the_console_shows_only_its_own_agents_request_whoever_else_used_the_id(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as ops:
        a, b = _agent(ops, "a-shop"), _agent(ops, "b-shop")
    with api.http(api.token("producer", prefix="a-")) as tenant_a:
        stale = _submit(tenant_a, a, "order-1001", POST, **{"If-Match": '"r99"'})
        problem(stale, 412, "stale-revision")  # journaled on A's agent, naming the request id
    with api.http(api.token("producer", prefix="b-")) as tenant_b:
        assert _submit(tenant_b, b, "order-1001", POST).status_code == 201
    run_all(api.db)
    page = browsers.signed_in(api.token("operator", prefix="a-")).get(f"/agents/{a['id']}")
    assert page.status_code == 200, page.text
    for secret in (SECRET_CHANNEL, "slack_post", b["id"].replace("-", ""), "b-shop", "Posted"):
        assert secret not in page.text, f"A's agent page shows {secret!r} of B's request"
    with api.http(api.token("auditor", prefix="a-")) as reader:
        problem(reader.get(f"/v1/agents/{a['id']}/requests/order-1001/story"), 404, "request-not-found")


def test_a_request_id_is_each_agents_own_and_runs_apart(api: Api) -> None:
    with api.http(api.token("operator")) as ops:
        a, b = _agent(ops, "a-bot"), _agent(ops, "b-bot")
    with api.http(api.token("producer", prefix="a-")) as tenant_a, api.http(api.token("producer", prefix="b-")) as tb:
        first = _submit(tenant_a, a, "order-1001", script({"content": "A's answer"}))
        second = _submit(tb, b, "order-1001", POST)
        assert (first.status_code, second.status_code) == (201, 201), (first.text, second.text)
        assert "Idempotent-Replayed" not in second.headers
        run_all(api.db)
        # Each agent's own request, to the end; neither token learns of the other's.
        assert tenant_a.get(f"/v1/agents/{a['id']}").json()["phase"] == "done"
        assert tb.get(f"/v1/agents/{b['id']}").json()["phase"] == "done"
        found = tenant_a.get("/v1/requests/order-1001")
        assert found.status_code == 200 and found.json()["agent_id"] == a["id"], found.text
        problem(tenant_a.get("/v1/requests/order-2002"), 404, "request-not-found")
        assert _submit(tb, b, "order-2002", script({"content": "B only"})).status_code == 201
        problem(tenant_a.get("/v1/requests/order-2002"), 404, "request-not-found")
    with api.http(api.token("auditor")) as auditor:
        stories = {x["id"]: auditor.get(f"/v1/agents/{x['id']}/requests/order-1001/story").json() for x in (a, b)}
        ambiguous = problem(auditor.get("/v1/requests/order-1001"), 409, "request-conflict")
        assert sorted(ambiguous["agents"]) == sorted([a["id"], b["id"]])
    for agent_id, story in stories.items():
        hexed = agent_id.replace("-", "")
        assert story["jobs"] and all(j["key"].startswith(f"{hexed}~order-1001:") for j in story["jobs"]), story
        assert all(e["agent_id"] == agent_id for e in story["journal"])
        assert all(m["key"].startswith(f"{hexed}~") for m in story["outbox"])
    assert [m["destination"] for m in stories[b["id"]]["outbox"]] == [SECRET_CHANNEL]
    assert stories[a["id"]]["outbox"] == []


def test_a_replay_is_still_a_replay_and_a_changed_body_still_a_conflict_on_the_same_agent(api: Api) -> None:
    with api.http(api.token("operator")) as ops:
        a = _agent(ops, "replayer")
        body = script({"content": "once"})
        assert _submit(ops, a, "r-1", body).status_code == 201
        again = _submit(ops, a, "r-1", body)
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        changed = problem(_submit(ops, a, "r-1", script({"content": "twice"})), 409, "request-conflict")
        assert changed["differs"] == ["input"]


def test_a_tenant_cannot_pre_empt_another_tenants_schedule_fire(api: Api, client: Client) -> None:
    with api.http(api.token("operator")) as ops:
        a, b = _agent(ops, "a-clock"), _agent(ops, "b-clock")
    schedule, _ = schedules.ensure_schedule(
        api.db, "b-nightly", UUID(b["id"]), every=timedelta(hours=1), input=script({"content": "nightly"})
    )
    fire = schedules.fire_request_id("b-nightly", schedule.next_fire_at)
    with api.http(api.token("producer", prefix="a-")) as tenant_a:
        # The fire's id is predictable: A takes it on its own agent first.
        assert _submit(tenant_a, a, fire, script({"content": "squatting"})).status_code == 201
    assert schedules.fire_due(api.db, at=schedule.next_fire_at + timedelta(seconds=1)) == [fire]
    fired = client.get_state(b["id"])
    assert (fired.request_id, fired.phase) == (fire, "planning")
    assert client.get_request(b["id"], fire).submitted_by == "scheduler"
    assert client.get_request(a["id"], fire).submitted_by != "scheduler"


def test_every_request_scoped_read_names_its_agent(client: Client) -> None:
    agent = client.create_agent("reader")
    with pytest.raises(InvalidInput, match="names a request of one agent"):
        client.journal(request_id="r-1")
    with pytest.raises(InvalidInput, match="names a request of one agent"):
        client.journal_page(request_id="r-1")
    with pytest.raises(InvalidInput, match="names a request of one agent"):
        client.follow_journal(request_id="r-1")
    assert client.journal(agent_id=agent.id, request_id="r-1") == []
    assert client.request_jobs(agent.id, "r-1") == []


def test_a_requests_key_changes_only_with_a_journaled_transition(client: Client, raw: Any) -> None:
    agent = client.create_agent("keyed")
    client.submit(agent.id, "r-1", script({"content": "hi"}))
    with pytest.raises(psycopg.errors.RaiseException, match="a change of state must bump the revision"):
        raw.execute("UPDATE agents SET request_key = 'elsewhere' WHERE id = %s", (agent.id,))
    (stored,) = raw.execute("SELECT request_key FROM agents WHERE id = %s", (agent.id,)).fetchone()
    assert stored == f"{agent.id.hex}~r-1"

"""Races through HTTP against a real uvicorn process: eight people approving one call with the same ``If-Match``,
eight producers retrying one submit under the same ``Idempotency-Key`` at once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from uuid import UUID

import httpx
import pytest

from agents.client import Client
from tests.support.api import Api, script, waiting_agent
from tests.support.keys import scoped

pytestmark = pytest.mark.integration
CLIENTS = 8


def at_once(calls: list[Any]) -> list[httpx.Response]:
    """Run the calls on as many threads, released together."""
    start = threading.Barrier(len(calls))

    def run(call: Any) -> httpx.Response:
        start.wait()
        response: httpx.Response = call()
        return response

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def test_eight_approvals_with_one_if_match_apply_exactly_once(api: Api, client: Client) -> None:
    secret = api.token("approver", "operator", name="team")
    with api.http(secret) as http:
        state = waiting_agent(api, http)
    people = [api.http(secret) for _ in range(CLIENTS)]
    try:
        url = f"/v1/agents/{state['id']}/approve"
        tag = f'"r{state["revision"]}"'
        answers = at_once([lambda h=h: h.post(url, headers={"If-Match": tag}) for h in people])
    finally:
        for h in people:
            h.close()
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200] + [412] * (CLIENTS - 1), [r.text for r in answers]
    for refused in (r for r in answers if r.status_code == 412):
        assert refused.json()["current_state"]["revision"] == state["revision"] + 1
    approvals = [e for e in client.journal(agent_id=state["id"]) if e.kind == "transition" and e.event == "approve"]
    assert len(approvals) == 1 and approvals[0].revision == state["revision"] + 1
    stale = [e for e in client.journal(agent_id=state["id"]) if e.decision == "stale_revision"]
    assert len(stale) == CLIENTS - 1  # each refusal is on record, and changed nothing else


def test_eight_submits_with_one_idempotency_key_make_one_request(api: Api, client: Client) -> None:
    secret = api.token("producer", name="ingest")
    with api.http(secret) as http:
        agent = http.post("/v1/agents", json={"name": "racer"}).json()
    producers = [api.http(secret) for _ in range(CLIENTS)]
    body = {"input": script({"content": "once"}), "hard_deadline_seconds": 600}
    try:
        url = f"/v1/agents/{agent['id']}/requests"
        answers = at_once(
            [lambda h=h: h.post(url, json=body, headers={"Idempotency-Key": "once-1"}) for h in producers]
        )
    finally:
        for h in producers:
            h.close()
    assert {r.status_code for r in answers} == {201}, [r.text for r in answers]
    assert len({r.content for r in answers}) == 1  # byte for byte the same response
    assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in answers) == CLIENTS - 1
    submits = [e for e in client.journal(agent_id=agent["id"]) if e.kind == "transition" and e.event == "submit"]
    assert len(submits) == 1
    assert [j.key for j in client.request_jobs(agent["id"], "once-1")] == [scoped(UUID(agent["id"]), "once-1:plan:1")]
    assert client.get_state(agent["id"]).revision == 1

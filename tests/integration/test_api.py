"""The HTTP API against a real ``keel serve`` (uvicorn) process on the test's own database and Redis prefix:
revisions as ETags, idempotent submits, problem details, refusals that change nothing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest
import sqlalchemy
from sqlalchemy.engine import make_url

from agents.client import Client
from agents.ingress.app import create_app
from models import migrations
from models.db import Database
from models.urls import libpq_url, with_database
from tests.support.api import Api, free_port, journal_count, problem, running_api, script, waiting_agent
from tests.support.broker import Broker
from tests.support.keys import scoped
from tests.support.runs import run_all

pytestmark = pytest.mark.integration
POST = {"channel": "C1", "text": "hi"}


def test_create_get_and_list_agents(api: Api) -> None:
    with api.http(api.token("operator")) as http:
        created = http.post("/v1/agents", json={"name": "alpha", "budget_tokens": 1000, "budget_cost": "2.5"})
        assert created.status_code == 201
        body = created.json()
        assert created.headers["Location"] == f"/v1/agents/{body['id']}"
        assert created.headers["ETag"] == '"r0"'
        assert (body["name"], body["phase"], body["revision"]) == ("alpha", "idle", 0)

        taken = problem(http.post("/v1/agents", json={"name": "alpha"}), 409, "agent-exists")
        assert "alpha" in taken["detail"]

        got = http.get("/v1/agents/alpha")
        assert got.status_code == 200 and got.json()["id"] == body["id"] and got.headers["ETag"] == '"r0"'
        not_modified = http.get(f"/v1/agents/{body['id']}", headers={"If-None-Match": '"r0"'})
        assert not_modified.status_code == 304 and not_modified.content == b""

        for n in range(5):
            assert http.post("/v1/agents", json={"name": f"bulk-{n}"}).status_code == 201
        first = http.get("/v1/agents", params={"limit": 4}).json()
        assert [a["name"] for a in first["agents"]] == ["bulk-4", "bulk-3", "bulk-2", "bulk-1"]
        rest = http.get("/v1/agents", params={"limit": 4, "cursor": first["next"]}).json()
        assert [a["name"] for a in rest["agents"]] == ["bulk-0", "alpha"] and rest["next"] is None
        idle = http.get("/v1/agents", params={"phase": "planning"}).json()
        assert idle["agents"] == []


def test_submit_is_idempotent_by_key_and_a_different_body_is_a_conflict(api: Api) -> None:
    with api.http(api.token("producer", name="ingest")) as http:
        agent = http.post("/v1/agents", json={"name": "worker-1"}).json()
        url = f"/v1/agents/{agent['id']}/requests"
        first = http.post(url, json={"input": script({"content": "hi"})}, headers={"Idempotency-Key": "r-1"})
        assert first.status_code == 201, first.text
        assert first.headers["Location"] == f"/v1/agents/{agent['id']}/requests/r-1"
        assert "Idempotent-Replayed" not in first.headers
        body = first.json()
        assert (body["request_id"], body["operation"], body["submitted_by"], body["revision"]) == (
            "r-1",
            "plan",
            "ingest",
            1,
        )
        again = http.post(url, json={"input": script({"content": "hi"})}, headers={"Idempotency-Key": "r-1"})
        assert again.status_code == 201 and again.json() == body
        assert again.headers["Idempotent-Replayed"] == "true"

        # The original response, byte for byte: input keys in an order JSONB does not keep, a deadline given in
        # another offset — the answer to the first submit and to its retry are the same bytes.
        other_agent = http.post("/v1/agents", json={"name": "worker-2"}).json()
        step = {"tokens": 5, "content": "hi", "cost": "0.1"}
        asked = {"input": {"script": [step], "prompt": "p"}, "hard_deadline": "2099-01-01T02:00:00.5+02:00"}
        url2 = f"/v1/agents/{other_agent['id']}/requests"
        fresh = http.post(url2, json=asked, headers={"Idempotency-Key": "r-2"})
        replay = http.post(url2, json=asked, headers={"Idempotency-Key": "r-2"})
        assert fresh.status_code == replay.status_code == 201
        assert fresh.content == replay.content, (fresh.text, replay.text)
        assert fresh.json()["hard_deadline"] == "2099-01-01T00:00:00.500000Z"
        before = journal_count(api.db)
        other = problem(
            http.post(url, json={"input": script({"content": "bye"})}, headers={"Idempotency-Key": "r-1"}),
            409,
            "request-conflict",
        )
        assert other["differs"] == ["input"]
        assert journal_count(api.db) == before + 1  # the refusal is journaled, nothing else changes
        state = http.get(f"/v1/agents/{agent['id']}").json()
        assert (state["revision"], state["request_id"]) == (1, "r-1")

        missing = problem(http.post(url, json={"input": script({"content": "x"})}), 400, "bad-request")
        assert "Idempotency-Key" in missing["detail"]
        bad_key = problem(
            http.post(url, json={"input": script({"content": "x"})}, headers={"Idempotency-Key": "a b"}),
            422,
            "invalid-input",
        )
        assert "request_id" in bad_key["detail"]


def test_bad_input_names_the_field_and_changes_nothing(api: Api) -> None:
    with api.http(api.token("producer")) as http:
        agent = http.post("/v1/agents", json={"name": "strict"}).json()
        before = journal_count(api.db)
        unknown = problem(http.post("/v1/agents", json={"name": "x", "colour": "red"}), 422, "invalid-input")
        assert unknown["errors"][0]["path"] == "body.colour"
        nested = problem(
            http.post(
                f"/v1/agents/{agent['id']}/requests",
                json={"input": {"prompt": 5}},
                headers={"Idempotency-Key": "r-2"},
            ),
            422,
            "invalid-input",
        )
        assert "prompt" in nested["detail"]
        assert {"path": "input.prompt", "message": "must be a string, got a number"} in nested["errors"]
        not_json = problem(
            http.post("/v1/agents", content=b"{nope", headers={"content-type": "application/json"}),
            422,
            "invalid-input",
        )
        assert not_json["errors"]
        huge = problem(
            http.post("/v1/agents", content=b'{"name": "' + b"x" * 300_000 + b'"}'),
            413,
            "payload-too-large",
        )
        assert "bytes" in huge["detail"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the body is counted as it streams in
            yield b'{"name": "'
            for _ in range(30):
                yield b"x" * 10_000
            yield b'"}'

        streamed = problem(
            http.post("/v1/agents", content=chunks(), headers={"content-type": "application/json"}),
            413,
            "payload-too-large",
        )
        assert "bytes" in streamed["detail"]
        assert journal_count(api.db) == before
        assert http.get(f"/v1/agents/{agent['id']}").json()["revision"] == 0


@pytest.mark.parametrize("cursor", ["²", "١٢", "-1", "1e3", " 7", "9" * 20, "x" * 40, "%00"])
def test_a_page_cursor_the_api_did_not_make_is_a_400_naming_it(api: Api, cursor: str) -> None:
    with api.http(api.token("operator")) as http:
        for path in ("/v1/outbox", "/v1/agents", "/v1/approvals"):
            answer = http.get(path, params={"cursor": cursor})
            assert answer.status_code in (400, 422), (path, answer.status_code, answer.text)
            body = problem(answer, answer.status_code, "invalid-input")
            assert "cursor" in body["detail"] or any("cursor" in e.get("path", "") for e in body.get("errors", []))


def test_approve_needs_if_match_and_a_stale_one_is_412_with_the_current_state(api: Api) -> None:
    with api.http(api.token("operator", "approver", name="alice")) as http:
        state = waiting_agent(api, http)
        url = f"/v1/agents/{state['id']}"
        problem(http.post(f"{url}/approve"), 428, "precondition-required")
        problem(http.post(f"{url}/approve", headers={"If-Match": "*"}), 400, "bad-request")
        problem(http.post(f"{url}/approve", headers={"If-Match": "7"}), 400, "bad-request")
        stale = problem(http.post(f"{url}/approve", headers={"If-Match": '"r1"'}), 412, "stale-revision")
        assert stale["current_state"]["revision"] == state["revision"]
        assert stale["etag"] == f'"r{state["revision"]}"' and stale["current_state"]["phase"] == "waiting_approval"

        approved = http.post(f"{url}/approve", headers={"If-Match": f'"r{state["revision"]}"'})
        assert approved.status_code == 200, approved.text
        assert approved.json()["phase"] == "executing"
        assert approved.headers["ETag"] == f'"r{state["revision"] + 1}"'
        illegal = problem(
            http.post(f"{url}/reject", headers={"If-Match": approved.headers["ETag"]}, json={"reason": "late"}),
            409,
            "illegal-transition",
        )
        assert "cancel" in illegal["allowed"]
        events = http.get(f"{url}/journal", params={"revision": state["revision"] + 1}).json()["events"]
        assert [(e["event"], e["actor"]) for e in events if e["kind"] == "transition"] == [("approve", "alice")]


def test_the_actor_is_the_tokens_name_never_the_callers_word(api: Api, client: Client) -> None:
    with api.http(api.token("operator", name="ops-bot")) as http:
        agent = http.post("/v1/agents", json={"name": "named", "actor": "mallory"})
        problem(agent, 422, "invalid-input")
        agent = http.post("/v1/agents", json={"name": "named"}).json()
        http.post(
            f"/v1/agents/{agent['id']}/requests",
            json={"input": script({"content": "hi"})},
            headers={"Idempotency-Key": "n-1", "X-Actor": "mallory"},
        )
        http.post(f"/v1/agents/{agent['id']}/cancel", json={"reason": "enough"})
    actors = {e.actor for e in client.journal(agent_id=agent["id"])}
    assert actors == {"ops-bot"}


def test_tokens_prefix_hides_other_tenants_agents_like_missing_ones(api: Api, client: Client) -> None:
    client.create_agent("acme-1")
    other = client.create_agent("globex-1")
    with api.http(api.token("operator", prefix="acme-")) as http:
        listed = [a["name"] for a in http.get("/v1/agents").json()["agents"]]
        assert listed == ["acme-1"]
        hidden = problem(http.get(f"/v1/agents/{other.id}"), 404, "agent-not-found")
        missing = problem(http.get("/v1/agents/00000000-0000-4000-8000-000000000000"), 404, "agent-not-found")
        assert hidden.keys() == missing.keys()
        assert str(other.id) in hidden["detail"] and "globex" not in hidden["detail"]
        problem(http.post("/v1/agents", json={"name": "globex-2"}), 403, "forbidden")
        assert http.post("/v1/agents", json={"name": "acme-2"}).status_code == 201


def test_authentication_and_scopes(api: Api) -> None:
    with api.http() as anonymous:
        body = problem(anonymous.get("/v1/agents"), 401, "unauthorized")
        assert "Bearer" in body["detail"]
    with api.http("keel_not-a-token") as wrong:
        assert problem(wrong.get("/v1/agents"), 401, "unauthorized")["detail"] == "the API token is unknown or revoked"
    with api.http(api.token("auditor")) as auditor:
        refused = problem(auditor.post("/v1/agents", json={"name": "nope"}), 403, "forbidden")
        assert refused["permission"] == "create_agent"
    with api.http(api.token("producer")) as producer:
        assert producer.get("/v1/tokens/me").json()["scopes"] == ["producer"]


def test_the_token_and_its_scope_are_checked_before_the_body_is_read(api: Api) -> None:
    bad = {"content": b"{bad", "headers": {"content-type": "application/json"}}
    huge = {"content": b'{"name": "' + b"x" * 300_000 + b'"}', "headers": {"content-type": "application/json"}}
    before = journal_count(api.db)
    with api.http() as anonymous:
        for body in (bad, huge):
            problem(anonymous.post("/v1/agents", **body), 401, "unauthorized")  # type: ignore[arg-type]
    with api.http(api.token("auditor")) as auditor:
        for body in (bad, huge):
            refused = problem(auditor.post("/v1/agents", **body), 403, "forbidden")  # type: ignore[arg-type]
            assert refused["permission"] == "create_agent"
    with api.http(api.token("producer")) as producer:  # allowed: now the body is read, and refused
        problem(producer.post("/v1/agents", **bad), 422, "invalid-input")  # type: ignore[arg-type]
        problem(producer.post("/v1/agents", **huge), 413, "payload-too-large")  # type: ignore[arg-type]
    assert journal_count(api.db) == before


def test_every_answer_to_a_token_within_its_rate_carries_its_ratelimit_headers(api: Api) -> None:
    with api.http(api.token("producer")) as http:
        created = http.post("/v1/agents", json={"name": "limited"})
        submit = {"json": {"input": script({"content": "hi"})}}
        answers = {
            201: created,
            200: http.get("/v1/agents"),
            404: http.get("/v1/agents/nobody"),
            403: http.post("/v1/agents/nobody/approve", headers={"If-Match": '"r1"'}),
            422: http.post("/v1/agents", json={"name": 5}),
            400: http.post(f"/v1/agents/{created.json()['id']}/requests", **submit),  # no Idempotency-Key
            412: http.post(
                f"/v1/agents/{created.json()['id']}/requests",
                headers={"Idempotency-Key": "l-1", "If-Match": '"r7"'},
                **submit,
            ),
        }
        for status, answer in answers.items():
            assert answer.status_code == status, answer.text
            assert answer.headers["RateLimit-Policy"].startswith('"producer";'), status
            assert answer.headers["RateLimit"].startswith('"producer";r='), status
    with api.http() as anonymous:  # no token: no rate is counted, so none is told
        refused = anonymous.get("/v1/agents")
        problem(refused, 401, "unauthorized")
        assert "RateLimit" not in refused.headers and "RateLimit-Policy" not in refused.headers


def test_story_jobs_and_request_lookup(api: Api) -> None:
    with api.http(api.token("operator")) as http:
        agent = http.post("/v1/agents", json={"name": "storyteller"}).json()
        http.post(
            f"/v1/agents/{agent['id']}/requests",
            json={
                "input": script(
                    {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "hi"}}]},
                    {"content": "done"},
                )
            },
            headers={"Idempotency-Key": "s-1"},
        )
        run_all(api.db)
        found = http.get("/v1/requests/s-1").json()
        assert found["agent_id"] == agent["id"]
        story = http.get(found["links"]["story"]).json()
        plan, message = (
            scoped(UUID(agent["id"]), "s-1:plan:1"),
            scoped(UUID(agent["id"]), "s-1:slack:tool.slack_post:1.call_0_0@post"),
        )
        assert story["jobs"][0]["key"] == plan
        assert story["journal"][0]["event"] == "submit" and story["journal"][-1]["to_phase"] == "done"
        assert [m["key"] for m in story["outbox"]] == [message]
        job = http.get(f"/v1/jobs/{plan}").json()
        assert job["status"] == "succeeded" and job["result"] is not None
        problem(http.get("/v1/jobs/nope:plan:1"), 404, "not-found")
        outbox = http.get("/v1/outbox", params={"status": "pending"}).json()
        assert [m["key"] for m in outbox["messages"]] == [message]
        problem(http.post(f"/v1/outbox/{message}/retry"), 409, "outbox-message-not-dead")


def test_health_and_readiness(api: Api) -> None:
    with api.http() as http:
        assert http.get("/healthz").json() == {"status": "ok", "checks": {}}
        ready = http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok"}
        schema = http.get("/openapi.json").json()
        assert "/v1/agents/{agent}/requests" in schema["paths"]
        assert http.get("/docs").status_code == 200


def test_readiness_probes_share_one_check_per_second_or_two(db_url: str, broker: Broker) -> None:
    """Unauthenticated probes cannot make every call cost a connection, a schema read and a Redis ping: concurrent
    ones share the check in flight, later ones reuse its answer for a moment, and then it is checked again."""
    app = create_app(broker.settings(database_url=db_url))
    schema_reads: list[str] = []

    def counted(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith("SELECT version_num FROM alembic_version"):
            schema_reads.append(statement)

    async def probe() -> list[int]:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://keel.test") as http,
        ):
            sqlalchemy.event.listen(app.state.ingress.db.engine, "before_cursor_execute", counted)
            answers = await asyncio.gather(*(http.get("/readyz") for _ in range(20)))
            assert len(schema_reads) == 1, "twenty probes at once: one check"
            answers.append(await http.get("/readyz"))
            assert len(schema_reads) == 1, "right after: the same answer"
            deadline = time.monotonic() + 30
            while len(schema_reads) == 1 and time.monotonic() < deadline:
                answers.append(await http.get("/readyz"))
                await asyncio.sleep(0.1)
            assert len(schema_reads) == 2, "a moment later it is checked again"
            return [answer.status_code for answer in answers]

    assert set(asyncio.run(probe())) == {200}


def test_over_its_rate_a_token_gets_429_with_retry_after_and_ratelimit_headers(
    db: Database, db_url: str, broker: Broker, tmp_path: Path
) -> None:
    tight = {"KEEL_API_RATE_LIMITS": json.dumps({"producer": {"rate": 0.5, "burst": 2}})}
    with running_api(db, db_url, broker, tmp_path, env=tight) as server, server.http(server.token("producer")) as http:
        first = http.get("/v1/agents")
        assert first.status_code == 200
        assert first.headers["RateLimit-Policy"] == '"producer";q=2;w=4'
        assert first.headers["RateLimit"].startswith('"producer";r=1;')
        assert http.get("/v1/agents").status_code == 200
        before = journal_count(db)
        over = problem(http.post("/v1/agents", json={"name": "too-fast"}), 429, "rate-limited")
        assert int(over["status"]) == 429 and 1 <= int(http.get("/v1/agents").headers["Retry-After"]) <= 2
        assert journal_count(db) == before  # refused before anything was written
        # Over its rate, the body is not even read: a broken one is refused with the same 429.
        broken = http.post("/v1/agents", content=b"{bad", headers={"content-type": "application/json"})
        problem(broken, 429, "rate-limited")
        assert broken.headers["RateLimit"].startswith('"producer";r=0;') and broken.headers["Retry-After"]
        with server.http(server.token("producer")) as other:  # the limit is per token
            assert other.get("/v1/agents").status_code == 200


def test_readiness_names_what_is_missing(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> None:
    dead_broker = {"KEEL_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}
    with running_api(db, db_url, broker, tmp_path, env=dead_broker, ready="/healthz") as server, server.http() as http:
        answer = http.get("/readyz")
        assert answer.status_code == 503
        checks = answer.json()["checks"]
        assert checks["database"] == "ok" and checks["broker"].startswith("unreachable")
        assert http.get("/healthz").status_code == 200
        # The schema moved under a running API (a rollback, a deploy in the wrong order): no longer ready.
        behind = migrations.revisions()[-2]
        with db.connection() as conn:
            conn.execute("UPDATE alembic_version SET version_num = %s", (behind,))
            conn.commit()
        deadline = time.monotonic() + 30  # the last answer is reused for a second or two
        while (answer := http.get("/readyz")).json()["checks"]["database"] == "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answer.status_code == 503
        expected = f"database at {behind}, code at {migrations.head()}: run 'keel db upgrade'"
        assert answer.json()["checks"]["database"] == expected


def test_a_submit_with_a_stale_if_match_is_412_with_the_current_state(api: Api) -> None:
    with api.http(api.token("producer")) as http:
        agent = http.post("/v1/agents", json={"name": "guarded"}).json()
        url = f"/v1/agents/{agent['id']}/requests"
        body = {"input": script({"content": "hi"})}
        stale = problem(
            http.post(url, json=body, headers={"Idempotency-Key": "g-1", "If-Match": '"r3"'}), 412, "stale-revision"
        )
        assert (stale["current_state"]["revision"], stale["etag"]) == (0, '"r0"')
        assert http.get(f"/v1/agents/{agent['id']}").json()["revision"] == 0
        fresh = http.post(url, json=body, headers={"Idempotency-Key": "g-1", "If-Match": '"r0"'})
        assert fresh.status_code == 201 and fresh.json()["revision"] == 1


def test_entity_tags_follow_http(api: Api) -> None:
    with api.http(api.token("operator", "approver")) as http:
        state = waiting_agent(api, http, name="tagged")
        url, tag = f"/v1/agents/{state['id']}", f'"r{state["revision"]}"'
        assert http.get(url, headers={"If-None-Match": "*"}).status_code == 304
        assert http.get(url, headers={"If-None-Match": f'"r0", W/{tag}'}).status_code == 304
        assert http.get(url, headers={"If-None-Match": '"r0"'}).status_code == 200
        problem(http.get(url, headers={"If-None-Match": "nonsense"}), 400, "bad-request")
        weak = problem(http.post(f"{url}/approve", headers={"If-Match": f"W/{tag}"}), 400, "bad-request")
        assert "strongly" in weak["detail"]
        star = problem(http.post(f"{url}/approve", headers={"If-Match": "*"}), 400, "bad-request")
        assert "not *" in star["detail"]
        extra = problem(http.post(f"{url}/approve", headers={"If-Match": tag}, json={"foo": 1}), 422, "invalid-input")
        assert extra["errors"][0]["path"] == "body.foo"
        assert http.get(url).json()["revision"] == state["revision"]  # none of it changed anything
        assert http.post(f"{url}/approve", headers={"If-Match": tag}, json={}).status_code == 200


def test_a_database_outage_is_a_503_that_names_no_host_or_database(api: Api, db_url: str) -> None:
    secret = api.token("producer")
    name = make_url(db_url).database
    admin = psycopg.connect(libpq_url(with_database(db_url, "postgres")), autocommit=True)
    try:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        with api.http(secret) as http:
            answer = problem(http.get("/v1/agents"), 503, "store-unavailable")
        assert answer["detail"].startswith("the database is unavailable (incident ")
        assert answer["incident"] in api.log()  # the log has the driver's text, under that incident
        assert str(name) not in answer["detail"] and "127.0.0.1" not in json.dumps(answer)
    finally:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        admin.close()

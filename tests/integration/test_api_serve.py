"""``keel serve`` as operators run it: what reaches its log (no secret, Keel's own lines, one trace per incident),
submits while Redis is away, and a SIGTERM with live event streams open."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest
from httpx_sse import connect_sse

from agents.client import Client
from models.db import Database, libpq_url
from tests.support.api import free_port, journal_count, problem, running_api, script
from tests.support.broker import Broker
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

FAKE_SECRET = "keel_" + "Zq7" * 14  # shaped like a token `keel token create` makes; no such token exists


def test_secrets_in_paths_queries_and_headers_never_reach_the_log_and_keel_lines_do(
    db: Database, db_url: str, broker: Broker, tmp_path: Any
) -> None:
    with running_api(db, db_url, broker, tmp_path, args=["-l", "info"]) as api:
        with api.http(api.token("auditor")) as http:
            by_path = http.get(f"/v1/agents/{FAKE_SECRET}")
            body = problem(by_path, 404, "agent-not-found")
            assert FAKE_SECRET not in json.dumps(body)  # nor in `instance`, which echoes the path
            assert http.get("/v1/agents", params={"token": FAKE_SECRET}).status_code == 200
        with api.http(FAKE_SECRET) as stranger:
            assert stranger.get("/v1/agents").status_code == 401
        log = api.log()
    assert FAKE_SECRET not in log
    assert FAKE_SECRET[:20] not in log
    assert "/v1/agents/***" in log  # the access line is there, masked
    assert "listening for journal events" in log  # Keel's own INFO lines are kept
    assert "keel.ingress.events" in log  # … with the logger's name


def test_a_submit_while_redis_is_down_is_answered_201_and_its_job_waits_for_the_dispatcher(
    db: Database, db_url: str, broker: Broker, tmp_path: Any
) -> None:
    gone = f"redis://127.0.0.1:{free_port()}/0"
    with running_api(db, db_url, broker, tmp_path, env={"KEEL_BROKER_URL": gone}, ready="/healthz") as api:
        with api.http(api.token("producer")) as http:
            agent = http.post("/v1/agents", json={"name": "offline"}).json()
            started = time.monotonic()
            submitted = http.post(
                f"/v1/agents/{agent['id']}/requests",
                json={"input": script({"content": "hi"})},
                headers={"Idempotency-Key": "offline-r1"},
            )
            took = time.monotonic() - started
            assert submitted.status_code == 201, submitted.text
            other = http.post("/v1/agents", json={"name": "offline-2"}).json()
            again = http.post(  # a second one while Redis is still away: no second warning
                f"/v1/agents/{other['id']}/requests",
                json={"input": script({"content": "hi"})},
                headers={"Idempotency-Key": "offline-r2"},
            )
            assert again.status_code == 201, again.text
        log = api.log()
    assert took < 3, f"the submit took {took:.1f}s"
    with db.connection() as conn:
        rows = conn.execute("SELECT key, status, enqueued_at FROM jobs ORDER BY key").fetchall()
        events = conn.execute("SELECT request_id, event FROM audit.journal WHERE event = 'submit'").fetchall()
        conn.rollback()
    # the dispatcher publishes them on its next pass, not after the enqueue timeout
    assert sorted(rows) == sorted(
        [
            (scoped(UUID(agent["id"]), "offline-r1:plan:1"), "pending", None),
            (scoped(UUID(other["id"]), "offline-r2:plan:1"), "pending", None),
        ]
    )
    assert sorted(events) == [("offline-r1", "submit"), ("offline-r2", "submit")]
    assert log.count("broker down") == 1, log
    assert "Traceback" not in log


def test_a_submit_through_client_when_the_publisher_fails_is_kept_and_handed_to_the_dispatcher(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    def unreachable(due: Any) -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    client = Client(db, publisher=unreachable)
    agent = client.create_agent("offline")
    submitted = client.submit(agent.id, "c-r1", script({"content": "hi"}), actor="producer")
    assert submitted.revision == 1
    with db.connection() as conn:
        (status,) = conn.execute(  # type: ignore[misc]
            "SELECT status FROM jobs WHERE key = %s", (scoped(agent.id, "c-r1:plan:1"),)
        ).fetchone()
        conn.rollback()
    assert status == "pending"
    assert journal_count(db) == 2  # created, submit
    assert any("broker down" in r.getMessage() for r in caplog.records)


def test_sigterm_with_open_event_streams_ends_them_cleanly_and_exits_at_once(
    db: Database, db_url: str, broker: Broker, tmp_path: Any
) -> None:
    client = Client(db)
    agent = client.create_agent("watched")
    ended: list[str] = []
    opened = threading.Barrier(4)

    def follow(http: httpx.Client) -> None:
        path = f"/v1/agents/{agent.id}/events"
        try:
            with connect_sse(http, "GET", path, headers={"Last-Event-ID": "0"}, timeout=60) as source:
                events = source.iter_sse()
                next(e for e in events if e.id)
                opened.wait(30)
                for _ in events:
                    pass
            ended.append("clean")
        except (httpx.HTTPError, StopIteration) as exc:
            ended.append(f"{type(exc).__name__}: {exc}")

    with running_api(db, db_url, broker, tmp_path, env={"KEEL_API_SHUTDOWN_SECONDS": "25"}) as api:
        with api.http(api.token("auditor")) as http:
            readers = [threading.Thread(target=follow, args=(http,)) for _ in range(3)]
            for r in readers:
                r.start()
            opened.wait(30)
            os.killpg(api.proc.pid, signal.SIGTERM)
            code = api.proc.wait(20)
            for r in readers:
                r.join(20)
        log = api.log()
    assert ended == ["clean"] * 3, ended
    assert code == 0, log
    assert "ERROR" not in log, log
    assert "graceful shutdown exceeded" not in log


BOOM_APP = """
import sys
import uvicorn
from fastapi import FastAPI
from agents.ingress import problems
from tasks.api import log_config

app = FastAPI()
app.add_exception_handler(Exception, problems.on_unexpected)


@app.get("/boom")
def boom() -> None:
    raise RuntimeError("the handler failed holding {secret}")


uvicorn.run(app, port=int(sys.argv[1]), log_config=log_config("info"))
"""


def test_an_unexpected_error_is_logged_once_with_its_incident_id_and_no_secret(tmp_path: Any) -> None:
    """Starlette hands an error to the app's 500 handler and then raises it again for the server to log: with Keel's
    log configuration uvicorn does not log it a second time (the app's handler did, with the incident id)."""
    import subprocess
    import sys

    from tests.support.api import ROOT

    app = tmp_path / "boom.py"
    app.write_text(BOOM_APP.replace("{secret}", FAKE_SECRET))
    port = free_port()
    log = tmp_path / "boom.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(app), str(port)],
            stdout=out,
            stderr=out,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/boom", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
    incident = problem(answer, 500, "internal-error")["incident"]
    text = log.read_text()
    assert text.count("Traceback") == 1, text
    assert f"unexpected error {incident} on GET /boom" in text
    assert "Exception in ASGI application" not in text
    assert FAKE_SECRET not in text


def test_keel_serve_exports_metrics_on_a_loopback_port_of_their_own_not_on_the_api_port(
    db: Database, db_url: str, broker: Broker, tmp_path: Any
) -> None:
    """They hold every tenant's spend and alerts: unauthenticated, only on ``KEEL_API_METRICS_PORT`` (loopback by
    default), served by keel serve's main process for its API processes; the public port answers 404."""
    port = free_port()
    with running_api(db, db_url, broker, tmp_path, env={"KEEL_API_METRICS_PORT": str(port)}) as api:
        with api.http() as http:
            assert http.get("/metrics").status_code == 404
            assert http.get("/healthz").status_code == 200
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert scraped.status_code == 200, scraped.text
        assert "keel_kpi_up 1.0" in scraped.text
        assert 'keel_http_request_seconds_count{method="GET",route="/healthz",status="200"}' in scraped.text
        assert 'route="/metrics"' not in scraped.text  # the 404 above: no route, no label
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)  # gone with keel serve


def test_the_api_app_closes_its_kpi_collectors_pool_when_it_stops(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape reads the domain KPIs on a pool of the collectors' own; stopping the app (a reload, an in-process
    app) closes it with the rest, leaving no connection open to the database."""
    from agents.core import observe
    from agents.observability import metrics
    from tasks.api import create

    secret = "scrape-secret-0123456789"
    for name, value in {"KEEL_DATABASE_URL": db_url, "KEEL_API_METRICS_TOKEN": secret, **broker.env}.items():
        monkeypatch.setenv(name, value)
    dbname = db_url.rsplit("/", 1)[1]
    before = observe.observers()
    monkeypatch.setattr(metrics, "_observer", None)

    def connections() -> int:
        with psycopg.connect(libpq_url(db_url.rsplit("/", 1)[0] + "/postgres"), autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,)
            ).fetchone()
        assert row is not None
        return int(row[0])

    app = create()

    async def scrape() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://k") as http,
        ):
            scraped = await http.get("/metrics", headers={"Authorization": f"Bearer {secret}"})
            assert scraped.status_code == 200 and "keel_kpi_up 1.0" in scraped.text, scraped.text[-2000:]
            assert connections() > 0

    try:
        asyncio.run(scrape())
    finally:  # the app registered this process's metrics observer: later tests expect none
        for observer in observe.observers():
            if observer not in before:
                observe.unregister(observer)
    assert connections() == 0

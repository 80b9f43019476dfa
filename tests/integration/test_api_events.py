"""Live state over Server-Sent Events from a real uvicorn process: every committed change once, in order; a client
that reconnects with ``Last-Event-ID`` gets exactly what it missed, then the live stream."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from httpx_sse import ServerSentEvent, connect_sse

from agents.client import Client
from agents.ingress.tokens import revoke_token
from tests.support.api import Api, problem, script

pytestmark = pytest.mark.integration


@contextmanager
def stream(http: httpx.Client, path: str, **headers: str) -> Iterator[Iterator[ServerSentEvent]]:
    with connect_sse(http, "GET", path, headers=headers, timeout=httpx.Timeout(30, read=30)) as source:
        assert source.response.status_code == 200, source.response.read()
        assert source.response.headers["content-type"].startswith("text/event-stream")
        yield (e for e in source.iter_sse() if e.id)  # keep-alive comments carry no id


def ten_transitions(client: Client, agent_id: Any, first: int) -> None:
    for n in range(first, first + 5):
        client.submit(agent_id, f"ev-{n}", script({"content": "hi"}), actor="producer")
        client.cancel(agent_id, actor="operator", reason="next")


def test_reconnect_with_last_event_id_gets_exactly_the_missed_events_then_live_ones(api: Api, client: Client) -> None:
    agent = client.create_agent("watched")
    with api.http(api.token("auditor")) as http:
        path = f"/v1/agents/{agent.id}/events"
        with stream(http, path, **{"Last-Event-ID": "0"}) as events:
            first = next(events)  # the agent's `created` event, from the journal
            assert (first.id, first.event, json.loads(first.data)["event"]) == ("1", "created", "create")
        # dropped: ten transitions commit while nobody listens
        ten_transitions(client, agent.id, 1)
        with stream(http, path, **{"Last-Event-ID": first.id}) as events:
            missed = [next(events) for _ in range(10)]
            assert [int(e.id) for e in missed] == list(range(2, 12))
            moves = [(json.loads(e.data)["event"], json.loads(e.data)["revision"]) for e in missed]
            assert moves == [(ev, rev) for rev, ev in enumerate(["submit", "cancel"] * 5, start=1)]

            # then live: a transition committed now is pushed as it commits
            later = threading.Thread(target=ten_transitions, args=(client, agent.id, 10))
            later.start()
            live = [next(events) for _ in range(10)]
            later.join()
            assert [int(e.id) for e in live] == list(range(12, 22))
            assert json.loads(live[-1].data)["phase"] == "failed"


def test_a_stream_without_last_event_id_starts_now_and_bad_ids_are_refused(api: Api, client: Client) -> None:
    agent = client.create_agent("fresh")
    ten_transitions(client, agent.id, 1)
    with api.http(api.token("producer")) as http:
        path = f"/v1/agents/{agent.id}/events"
        problem(http.get(path, headers={"Last-Event-ID": "abc"}), 400, "bad-request")
        with stream(http, path) as events:
            threading.Timer(0.5, client.submit, (agent.id, "ev-99", script({"content": "x"}))).start()
            event = next(events)
            assert int(event.id) == 12 and json.loads(event.data)["event"] == "submit"


def test_a_deleted_agents_stream_resumes_to_its_delete_event_then_ends(api: Api, client: Client) -> None:
    agent = client.create_agent("leaving")
    ten_transitions(client, agent.id, 1)  # seq 2..11
    client.archive(agent.id, actor="ops")  # 12
    client.delete_agent(agent.id, actor="ops")  # 13
    with api.http(api.token("auditor")) as http:
        path = f"/v1/agents/{agent.id}/events"
        with stream(http, path, **{"Last-Event-ID": "10"}) as events:
            rest = list(events)  # the stream ends by itself after the delete event
        assert [int(e.id) for e in rest] == [11, 12, 13]
        assert json.loads(rest[-1].data)["event"] == "delete"
        gone = problem(http.get(path, headers={"Last-Event-ID": "13"}), 404, "agent-not-found")
        assert "deleted" in gone["detail"]
        problem(http.get(path), 404, "agent-not-found")
        assert http.get(path, headers={"Last-Event-ID": ""}).status_code == 404  # empty is none at all


def test_a_revoked_tokens_open_streams_end_without_any_event_committed_after_the_revocation(
    api: Api, client: Client
) -> None:
    watched = client.create_agent("watched")
    quiet = client.create_agent("quiet")
    with api.http(api.token("auditor", name="leaked")) as http:
        with (
            stream(http, f"/v1/agents/{watched.id}/events") as events,
            stream(http, f"/v1/agents/{quiet.id}/events") as silent,
        ):
            client.submit(watched.id, "before", script({"content": "hi"}), actor="producer")
            assert json.loads(next(events).data)["event"] == "submit"  # live until the revocation
            revoke_token(api.db, "leaked", actor="test")
            client.cancel(watched.id, actor="operator", reason="after the revocation")
            # Its wake-up finds the token revoked: the stream ends, and the cancel is never sent on it.
            assert list(events) == []
            # Nothing wakes this one: its periodic re-check of the token ends it (within 5 s).
            assert list(silent) == []
        problem(http.get(f"/v1/agents/{watched.id}/events"), 401, "unauthorized")


def db_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    from models.urls import libpq_url

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def test_behind_pgbouncer_live_events_come_over_the_direct_connection(
    pgbouncer: Any, db: Any, db_url: str, broker: Any, tmp_path: Any, client: Client
) -> None:
    """The API behind PgBouncer in transaction mode: its queries go through the pooler, its one LISTEN connection
    to KEEL_DATABASE_DIRECT_URL (a LISTEN through the pooler would stay on a server connection nobody reads)."""
    from tests.support.api import running_api

    env = {
        "KEEL_DATABASE_URL": pgbouncer.url(db_url),
        "KEEL_DATABASE_POOLER": "transaction",
        "KEEL_DATABASE_DIRECT_URL": db_url,
    }
    with running_api(db, db_url, broker, tmp_path, env=env) as api:
        agent = client.create_agent("watched-through-pgbouncer")
        with api.http(api.token("auditor")) as http:
            with stream(http, f"/v1/agents/{agent.id}/events", **{"Last-Event-ID": "1"}) as events:
                later = threading.Thread(target=ten_transitions, args=(client, agent.id, 1))
                later.start()
                live = [next(events) for _ in range(10)]
                later.join()
            assert [int(e.id) for e in live] == list(range(2, 12))
            state = http.get(f"/v1/agents/{agent.id}")  # and a read through the pooler
            assert state.status_code == 200, state.text
        listening = {
            pid
            for (pid,) in db_rows(
                db_url,
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'",
            )
        }
        assert listening, "the API listens"
        assert not listening & pgbouncer.server_pids(), "its LISTEN session is its own, not one of PgBouncer's"

"""Live event streams are capped per token and per process (a 429 past either), and a token's open streams share
one liveness check: idle streams cost the database next to nothing, and a revoked token's streams all end from the
check that found it revoked."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest
import uvicorn
from httpx_sse import connect_sse

from agents.client import Client
from agents.ingress.app import create_app
from agents.ingress.tokens import create_token, revoke_token
from models import tokens_sql
from models.db import Database
from tests.support.api import free_port, problem, running_api
from tests.support.broker import Broker

pytestmark = pytest.mark.integration

LONG = httpx.Timeout(30, read=30)


class Reading:
    """An open stream read by a thread until it ends: the ids of the events it sent."""

    def __init__(self, source: Any) -> None:
        self.seen: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(source,), daemon=True)
        self.thread.start()

    def _read(self, source: Any) -> None:
        with contextlib.suppress(httpx.HTTPError):
            self.seen.extend(e.id for e in source.iter_sse() if e.id)

    def ended(self, timeout: float = 60) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


@contextmanager
def opened(http: httpx.Client, path: str) -> Iterator[Reading]:
    """An open stream (its 200 received), read by a thread until it ends or the block is left."""
    with connect_sse(http, "GET", path, timeout=LONG) as source:
        assert source.response.status_code == 200, source.response.read()
        yield Reading(source)


def refused(http: httpx.Client, path: str) -> httpx.Response:
    """The answer to opening a stream that should be refused (read whole; a stream that opened is closed at once)."""
    with http.stream("GET", path, timeout=LONG) as response:
        assert response.status_code != 200, "the stream was let open"
        response.read()
    return response


def test_streams_past_the_tokens_cap_or_the_processs_are_refused_with_a_429(
    db: Database, db_url: str, broker: Broker, tmp_path: Path, client: Client
) -> None:
    env = {"KEEL_API_MAX_STREAMS_PER_TOKEN": "2", "KEEL_API_MAX_STREAMS_PER_PROCESS": "3"}
    with running_api(db, db_url, broker, tmp_path, env=env) as api:
        agent = client.create_agent("watched")
        path = f"/v1/agents/{agent.id}/events"
        with api.http(api.token("producer", name="greedy")) as greedy, api.http(api.token("auditor")) as other:
            with ExitStack() as streams:
                streams.enter_context(opened(greedy, path))
                streams.enter_context(opened(greedy, path))
                over = refused(greedy, path)
                body = problem(over, 429, "too-many-streams")
                assert over.headers["Retry-After"].isdigit()
                assert "'greedy'" in body["detail"] and "KEEL_API_MAX_STREAMS_PER_TOKEN" in body["detail"]
                streams.enter_context(opened(other, path))  # another token: the process holds 3 now
                full = problem(refused(other, path), 429, "too-many-streams")
                assert "KEEL_API_MAX_STREAMS_PER_PROCESS" in full["detail"]
                assert other.get(f"/v1/agents/{agent.id}").status_code == 200  # plain requests go on
            # Closed streams free their places (once the server sees them gone: at the latest at its next ping).
            deadline = time.monotonic() + 60
            while (answer := refused_or_open(greedy, path)) != 200:
                assert answer == 429 and time.monotonic() < deadline, answer


def refused_or_open(http: httpx.Client, path: str) -> int:
    with http.stream("GET", path, timeout=LONG) as response:
        if response.status_code != 200:
            response.read()
        return response.status_code


@contextmanager
def serving(db_url: str, broker: Broker) -> Iterator[str]:
    """The API app in this process (uvicorn in a thread), so that a test can count what it asks the database."""
    server = uvicorn.Server(
        uvicorn.Config(create_app(broker.settings(database_url=db_url)), port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> Counter[UUID]:
    """How many times each token's liveness was asked of the database by id (as open streams ask it)."""
    counts: Counter[UUID] = Counter()
    many, one = tokens_sql.live_token_ids, tokens_sql.token_by_id

    def live_token_ids(db: Database, ids: Collection[UUID]) -> set[UUID]:
        counts.update(set(ids))
        return many(db, ids)

    def token_by_id(db: Database, token_id: UUID) -> tokens_sql.TokenRow | None:
        counts[token_id] += 1
        return one(db, token_id)

    monkeypatch.setattr(tokens_sql, "live_token_ids", live_token_ids)
    monkeypatch.setattr(tokens_sql, "token_by_id", token_by_id)
    return counts


def test_a_tokens_streams_share_one_liveness_check_and_end_together_when_it_is_revoked(
    db: Database, db_url: str, broker: Broker, client: Client, asked: Counter[UUID]
) -> None:
    agents = [client.create_agent(f"quiet-{n}") for n in range(8)]
    token, secret = create_token(db, "watcher", ["auditor"], actor="test")
    with (
        serving(db_url, broker) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}) as http,
    ):
        with ExitStack() as streams:
            readings = [streams.enter_context(opened(http, f"/v1/agents/{a.id}/events")) for a in agents]
            revoke_token(db, "watcher", actor="test")
            # Nothing wakes these streams: each ends only once the token's liveness was asked after the revocation.
            assert all(r.ended() for r in readings), "a revoked token's stream did not end"
            assert [r.seen for r in readings] == [[] for _ in agents]
    # One question per check round for all eight streams (a round before the revocation at most, and the one that
    # found it), not one per stream.
    assert 1 <= asked[token.id] <= 3, asked

"""The beat's Redis connections are reused, not opened per tick: on a Redis of the test's own (so that the server's
counters count this beat only), a beat that publishes on tick after tick opens no new connection."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from agents.client import Client
from tests.chaos.conftest import Stack, wait_until
from tests.support.broker import Broker, new_prefix

pytestmark = pytest.mark.chaos


def _connections(watcher: redis.Redis) -> tuple[int, int]:
    """(connections the server ever accepted; clients connected now), asked on the test's one watching connection
    (read-only INFO and CLIENT LIST: the watcher itself is counted once, before and after alike)."""
    received = int(watcher.info("stats")["total_connections_received"])
    return received, len(watcher.client_list())


def _enqueued(stack: Stack) -> int:
    return int(stack.query("SELECT count(*) FROM jobs WHERE status = 'enqueued'")[0][0])


def test_a_beat_publishing_on_many_ticks_opens_no_new_redis_connection(
    db_url: str, own_redis: dict[str, Any], tmp_path: Path, client: Client
) -> None:
    stack = Stack(db_url, Broker(own_redis["url"], new_prefix()), tmp_path)
    stack.env["KEEL_ENQUEUE_TIMEOUT_SECONDS"] = "600"  # each job published once: by its own tick
    watcher = redis.Redis.from_url(own_redis["url"], single_connection_client=True)
    try:
        stack.beat()
        agents = [client.create_agent(f"a{n}").id for n in range(12)]
        client.submit(agents[0], "warm", None, operation="count")
        wait_until("the first publish", lambda: _enqueued(stack) == 1, 60)
        time.sleep(1)  # the relay's periodic pass too has been sent by now
        before = _connections(watcher)
        seen = [before]
        for n, agent in enumerate(agents[1:], start=1):
            client.submit(agent, f"req-{n}", None, operation="count")
            wait_until(f"job {n} published", lambda n=n: _enqueued(stack) == n + 1, 30)  # a tick of its own each
            seen.append(_connections(watcher))
        time.sleep(1)
        after = _connections(watcher)
        ticks = stack.log("beat").count("dispatched 1 jobs")
        assert ticks >= 11, "each job was published by a tick of its own"
        assert after == before, f"{ticks} publishing ticks: connections (received, connected) {seen} -> {after}"
    finally:
        watcher.close()
        stack.stop_all()

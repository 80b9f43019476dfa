"""A broker that accepts connections but never answers (a paused or hung Redis, a route that drops packets): every
wait on it is bounded (KEEL_BROKER_SOCKET_TIMEOUT_SECONDS; the beat's own, a tenth of its lease), so the beat keeps
its leadership and its passes — a hard deadline that passes while Redis hangs is enforced on time — and what it
could not publish goes out once Redis answers again. Before, the beat's tick waited on Redis for ever."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from agents.client import Client
from tests.chaos.conftest import Stack, wait_until
from tests.support.broker import Broker, new_prefix
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos


def _phase(stack: Stack, agent_id: Any) -> str:
    return str(stack.query("SELECT phase FROM agents WHERE id = %s", agent_id)[0][0])


def _status(stack: Stack, key: str) -> str:
    return str(stack.query("SELECT status FROM jobs WHERE key = %s", key)[0][0])


def test_a_hung_broker_holds_up_neither_the_leader_nor_its_deadlines(
    db_url: str, own_redis: dict[str, Any], tmp_path: Path, client: Client
) -> None:
    stack = Stack(db_url, Broker(own_redis["url"], new_prefix()), tmp_path)
    redis_pid = own_redis["proc"].pid
    paused = False
    try:
        stack.beat()
        warm = client.create_agent("warm").id
        client.submit(warm, "warm", None, operation="count")
        wait_until(
            "the beat leads and publishes", lambda: _status(stack, scoped(warm, "warm:count:1")) == "enqueued", 60
        )
        late = client.create_agent("late").id
        os.kill(redis_pid, signal.SIGSTOP)  # Redis keeps its port open, and answers nothing
        paused = True
        hung_at = time.monotonic()
        client.submit(late, "late", None, operation="count", hard_deadline=timedelta(seconds=2))
        # The job cannot be published; its hard deadline passes meanwhile, and the leader's deadline pass stops it.
        wait_until("the deadline enforced while Redis hangs", lambda: _phase(stack, late) == "failed", 30)
        assert time.monotonic() - hung_at < 15
        later = client.create_agent("later").id
        client.submit(later, "later", None, operation="count")
        time.sleep(4)  # more than the leader's lease (KEEL_BEAT_LEASE_SECONDS=3), Redis still hung
        assert _status(stack, scoped(later, "later:count:1")) == "pending", "nothing reached the paused broker"
        os.kill(redis_pid, signal.SIGCONT)
        paused = False
        wait_until(
            "published once Redis answers", lambda: _status(stack, scoped(later, "later:count:1")) == "enqueued", 60
        )
        log = stack.log("beat")
        assert "this beat is the leader (term 1)" in log
        assert "(term 2)" not in log, "the leader lost its lease while Redis hung"
        assert "broker down" in log and "broker back" in log, log[-3000:]
    finally:
        if paused:
            os.kill(redis_pid, signal.SIGCONT)
        stack.stop_all()

"""Issue 8's fault classes through real processes: a worker SIGKILLed between a staged outcome and its transition,
Redis restarted under a running step, PostgreSQL connections killed, a revoke from Flower, clocks minutes apart,
a handler and a tool that hang past their limits."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tests.support.tools  # noqa: F401 - the workers' tools: this process's submits are checked against them
from agents.client import Client
from models.urls import libpq_url
from tests.chaos.conftest import ROUTES, Stack, clock_offset_in_log, skewed, wait_until
from tests.support.broker import Broker, new_prefix
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos


@pytest.fixture(params=ROUTES)
def database_route(request: pytest.FixtureRequest) -> str:
    """Every scenario here also runs with the processes behind a PgBouncer in transaction mode."""
    return str(request.param)


def executions(stack: Stack, phase: str = "start") -> dict[str, int]:
    rows = stack.query("SELECT key, count(*) FROM executions WHERE phase = %s GROUP BY key", phase)
    return {key: n for key, n in rows}


def job(stack: Stack, key: str) -> dict[str, Any]:
    cols = ["status", "attempts", "error_attempts", "error_class", "last_error", "result"]
    rows = stack.query(f"SELECT {', '.join(cols)} FROM jobs WHERE key = %s", key)
    return dict(zip(cols, rows[0], strict=True)) if rows else {}


def tools_env(stack: Stack) -> None:
    stack.env["KEEL_IMPORTS"] = json.dumps(["tests.support.handlers", "tests.support.tools"])


def script(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "do it", "script": list(entries)}


# --- 1. a checkpoint is the whole outcome ----------------------------------------------------------------------


def test_sigkill_between_the_staged_outcome_and_its_transition_replays_it_once(stack: Stack, client: Client) -> None:
    tools_env(stack)
    agent = client.create_agent("poster")
    stack.worker("w1")
    stack.beat()
    call = {"name": "test_post", "arguments": {"channel": "C0PS", "text": "deploy at 5"}}
    client.submit(agent.id, "req-1", script({"tool_calls": [call], "tokens": 100}, {"content": "Done.", "tokens": 50}))
    key = scoped(agent.id, "req-1:tool:test_post:1.call_0_0")
    wait_until("the tool to run", lambda: executions(stack, "tool").get(key) == 1, 60)
    # Hold the agent's lock: the tool finishes and its outcome is staged, but the transition cannot commit.
    with psycopg.connect(libpq_url(stack.db_url)) as blocker:
        blocker.execute("SELECT 1 FROM agents WHERE id = %s FOR UPDATE", (agent.id,))
        stack.release(key)
        wait_until("the outcome to be staged", lambda: "staged" in (job(stack, key)["result"] or {}), 30)
        stack.kill("w1")  # between the checkpoint and its outcome
        blocker.rollback()
    assert stack.query("SELECT count(*) FROM outbox") == [(0,)]
    stack.worker("w2")
    wait_until("the request to finish", lambda: client.get_state(agent.id).phase == "done", 60)
    assert executions(stack, "tool") == {key: 1}, "the tool ran once"
    assert stack.query("SELECT key, destination FROM outbox") == [
        (scoped(agent.id, "req-1:slack:tool.test_post:1.call_0_0@call_0_0"), "C0PS")
    ]
    assert client.get_state(agent.id).spent_tokens == 100 + 40 + 50, "the tool's usage was charged once"
    assert job(stack, key)["result"] == {"tool_call_id": "call_0_0", "content": "posted to C0PS"}


# --- 5. a broker outage does not interrupt a running step -----------------------------------------------------


def test_redis_restarted_three_times_during_a_long_step_does_not_interrupt_it(
    db_url: str, own_redis: dict[str, Any], tmp_path: Path, client: Client
) -> None:
    stack = Stack(db_url, Broker(own_redis["url"], new_prefix()), tmp_path)
    try:
        agent = client.create_agent("patient")
        stack.worker("w1")
        stack.beat()
        client.submit(agent.id, "req-1", None, operation="block")
        key = scoped(agent.id, "req-1:block:1")
        wait_until("the step to start", lambda: executions(stack).get(key) == 1, 60)
        for _ in range(3):
            own_redis["stop"]()
            time.sleep(1.5)
            own_redis["start"]()
            time.sleep(3)
        stack.release(key)
        wait_until("the request to finish", lambda: client.get_state(agent.id).phase == "done", 60)
        assert executions(stack) == {key: 1} and executions(stack, "finish") == {key: 1}, "the step ran once"
        assert job(stack, key)["error_attempts"] == {}, "no outage was counted as a failure of the step"
    finally:
        stack.stop_all()


# --- 4. no silent ack --------------------------------------------------------------------------------------------


def test_a_database_restart_loses_no_message(stack: Stack, client: Client) -> None:
    """Every pooled connection of every process dies (a restart, a failover). The next message's claim must not
    fail and be acked and dropped: the job runs at once, not after the enqueue timeout."""
    from tasks.app import make_app, publisher

    stack.env["KEEL_ENQUEUE_TIMEOUT_SECONDS"] = "120"  # recovery by timeout cannot be what saves it
    stack.worker("w1", concurrency=2)
    stack.beat()
    created = [client.create_agent(f"a{i}") for i in range(4)]
    names = [a.name for a in created]
    client.submit(names[0], "req-warm", None, operation="count")
    warm = scoped(created[0].id, "req-warm:count:1")
    wait_until("the worker to be warm", lambda: job(stack, warm).get("status") == "succeeded", 60)
    stack.query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )

    celery = make_app(stack.broker.settings(database_url=stack.db_url))
    try:
        producer = Client(client.db, publisher=publisher(celery))
        for i, name in enumerate(names[1:], start=1):
            producer.submit(name, f"req-{i}", None, operation="count")
        wait_until(
            "every job to run after the restart",
            lambda: all(
                job(stack, scoped(created[i].id, f"req-{i}:count:1")).get("status") == "succeeded" for i in range(1, 4)
            ),
            30,
        )
    finally:
        celery.close()
    assert set(executions(stack).values()) == {1}


def test_a_revoke_in_flower_is_a_journaled_cancel_not_a_strand(stack: Stack, client: Client) -> None:
    from tasks.app import make_app

    busy, queued, running = (client.create_agent(n) for n in ("busy", "queued", "running"))
    stack.worker("w1", concurrency=1)
    stack.beat()
    busy_key, queued_key = scoped(busy.id, "req-busy:block:1"), scoped(queued.id, "req-q:count:1")
    client.submit(busy.id, "req-busy", None, operation="block")
    wait_until("the worker to be busy", lambda: executions(stack).get(busy_key) == 1, 60)
    client.submit(queued.id, "req-q", None, operation="count")
    wait_until("the job to wait on the broker", lambda: job(stack, queued_key).get("status") == "enqueued", 30)
    celery = make_app(stack.broker.settings(database_url=stack.db_url))
    try:
        celery.control.revoke(queued_key)  # what Flower's "revoke" button sends
        stack.release(busy_key)
        wait_until("the revoke to cancel the request", lambda: client.get_state(queued.id).phase == "failed", 30)
        event = client.journal(agent_id=queued.id)[-1]
        assert (event.event, event.decision) == ("cancel", "revoked")
        assert event.actor.startswith("celery-revoke@w1@") and event.details["job"] == queued_key
        assert job(stack, queued_key)["status"] == "cancelled" and queued_key not in executions(stack)

        # A revoke of a running job (no terminate): Celery alone would let it run and drop nothing until a retry;
        # Keel cancels the request at once, so the step's late outcome is fenced off.
        quiet = client.create_agent("quiet")
        quiet_key = scoped(quiet.id, "req-s:block:1")
        client.submit(quiet.id, "req-s", None, operation="block")
        wait_until("the job to run", lambda: executions(stack).get(quiet_key) == 1, 30)
        celery.control.revoke(quiet_key)
        wait_until("the revoke to cancel the running request", lambda: client.get_state(quiet.id).phase == "failed", 30)
        assert client.journal(agent_id=quiet.id)[-1].decision == "revoked"
        stack.release(quiet_key)
        wait_until(
            "its late outcome to be fenced off",
            lambda: any(e.decision == "fenced_off" for e in client.journal(agent_id=quiet.id)),
            30,
        )

        # A revoke with terminate=True of a running job: its process is killed, the request cancelled, journaled.
        running_key = scoped(running.id, "req-r:block:1")
        client.submit(running.id, "req-r", None, operation="block")
        wait_until("the job to run", lambda: executions(stack).get(running_key) == 1, 30)
        celery.control.revoke(running_key, terminate=True)
        wait_until("the request to be cancelled", lambda: client.get_state(running.id).phase == "failed", 30)
        assert client.journal(agent_id=running.id)[-1].details["terminated"] is True
    finally:
        celery.close()
    assert stack.query("SELECT count(*) FROM jobs WHERE status IN ('pending', 'enqueued', 'running')") == [(0,)]


# --- 9. one clock ------------------------------------------------------------------------------------------------


def test_worker_and_beat_clocks_minutes_apart_run_everything_once_on_time(stack: Stack, client: Client) -> None:
    tools_env(stack)
    stack.worker("fast", concurrency=1, **skewed(stack, "+5m"))
    stack.worker("slow", concurrency=1, **skewed(stack, "-5m"))
    stack.beat(**skewed(stack, "-5m"))
    agents = [client.create_agent(f"a{i}").id for i in range(12)]
    started = time.monotonic()
    for i, agent_id in enumerate(agents[:8]):
        client.submit(agent_id, f"req-{i}", None, operation="count")
    client.submit(agents[8], "req-flaky", {"succeed_on": 3}, operation="flaky")
    client.submit(agents[9], "req-limited", {"retry_after": 2}, operation="ratelimited")
    call = {"name": "test_post", "arguments": {"channel": "C0PS", "text": "hello"}}
    client.submit(agents[10], "req-talk", script({"tool_calls": [call]}, {"content": "Done."}))
    stack.release(scoped(agents[10], "req-talk:tool:test_post:1.call_0_0"))
    wait_until("every request to finish", lambda: all(client.get_state(a).phase == "done" for a in agents[:11]), 60)
    assert 240 < clock_offset_in_log(stack, "fast") < 330 and -330 < clock_offset_in_log(stack, "slow") < -240
    assert time.monotonic() - started < 45, "nothing waited out a clock difference"
    runs = executions(stack)
    flaky, limited = scoped(agents[8], "req-flaky:flaky:1"), scoped(agents[9], "req-limited:ratelimited:1")
    assert (runs.pop(flaky), runs.pop(limited)) == (3, 2), "retried to success"
    assert len(runs) == 8 and set(runs.values()) == {1}, "every other job ran exactly once"
    gaps = stack.query("SELECT at FROM executions WHERE key = %s ORDER BY at", limited)
    assert len(gaps) == 2 and (gaps[1][0] - gaps[0][0]).total_seconds() >= 2.0, "the retry was not early"
    for agent_id in agents[:11]:  # every journal is in order on one clock
        times = [(e.seq, e.at) for e in client.journal(agent_id=agent_id)]
        assert times == sorted(times, key=lambda t: t[1])
    assert stack.query("SELECT count(*) FROM outbox") == [(1,)]

"""Nothing runs twice, nothing is lost: real workers and beats, killed, doubled and robbed of their broker."""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import pytest

from agents.client import Client
from tests.chaos.conftest import ROOT, ROUTES, Stack, free_port, wait_until
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos


@pytest.fixture(params=ROUTES)
def database_route(request: pytest.FixtureRequest) -> str:
    """Every scenario here also runs with the processes behind a PgBouncer in transaction mode."""
    return str(request.param)


def executions(stack: Stack, phase: str = "start") -> dict[str, int]:
    rows = stack.query("SELECT key, count(*) FROM executions WHERE phase = %s GROUP BY key", phase)
    return {key: n for key, n in rows}


def statuses(stack: Stack) -> dict[str, str]:
    return {key: status for key, status in stack.query("SELECT key, status FROM jobs")}


def all_succeeded(stack: Stack, n: int) -> bool:
    values = list(statuses(stack).values())
    return len(values) == n and all(s == "succeeded" for s in values)


def make_agents(client: Client, n: int, prefix: str = "a") -> list[str]:
    return [client.create_agent(f"{prefix}-{i}").name for i in range(n)]


def test_four_producers_submitting_the_same_hundred_keys_run_each_once(stack: Stack, client: Client) -> None:
    names = make_agents(client, 100)
    pairs = [f"{name}:req-{i}" for i, name in enumerate(names)]
    stack.worker("w1", concurrency=2)
    stack.beat()
    producers = []
    for seed in range(4):
        order = random.Random(seed).sample(pairs, len(pairs))
        producers.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.produce", "count", *order],
                env=stack.env,
                cwd=ROOT,
                stderr=subprocess.PIPE,
            )
        )
    for proc in producers:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    wait_until("all 100 jobs to succeed", lambda: all_succeeded(stack, 100), 90)
    counts = executions(stack)
    assert len(counts) == 100 and set(counts.values()) == {1}, "a key ran more than once"
    suppressed = stack.query("SELECT count(*) FROM audit.journal WHERE kind = 'suppressed' AND event = 'submit'")
    assert suppressed == [(300,)], "every repeated submit is journaled as a suppressed duplicate"
    assert {s.phase for s in client.list_agents().agents} == {"done"}


def test_four_processes_publishing_the_same_hundred_messages_run_each_key_once(stack: Stack, client: Client) -> None:
    """Duplicates that reach the broker (Celery does not dedupe task ids): 4 processes publish every key, at once,
    to two workers. The claim alone must make each key run once."""
    names = make_agents(client, 100)
    keys = []
    for i, name in enumerate(names):
        client.submit(name, f"req-{i}", None, operation="count")
        keys.append(scoped(client.get_state(name).id, f"req-{i}:count:1"))
    stack.worker("w1", concurrency=2)
    stack.worker("w2", concurrency=2)
    publishers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.publish", *random.Random(seed).sample(keys, 100)],
            env=stack.env,
            cwd=ROOT,
            stderr=subprocess.PIPE,
        )
        for seed in range(4)
    ]
    for proc in publishers:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    wait_until("all 100 jobs to succeed", lambda: all_succeeded(stack, 100), 90)
    wait_until(
        "every duplicate to be suppressed", lambda: stack.query("SELECT sum(suppressed) FROM jobs") == [(300,)], 60
    )
    counts = executions(stack)
    assert len(counts) == 100 and set(counts.values()) == {1}, "a key ran more than once"


def test_sigkill_mid_job_then_restart_completes_once_and_suppresses_the_redelivery(
    stack: Stack, client: Client
) -> None:
    agent = client.create_agent("victim")
    stack.worker("w1")
    stack.beat()
    client.submit(agent.id, "req-kill", None, operation="block")
    key = scoped(agent.id, "req-kill:block:1")
    wait_until("the job to start", lambda: executions(stack).get(key) == 1)
    assert f"keel.run_job[{key}] received" in stack.log("w1"), "the Celery task id is the job key"
    stack.kill("w1")
    stack.worker("w2")
    stack.release(key)
    wait_until("the job to succeed on the new worker", lambda: statuses(stack).get(key) == "succeeded", 60)
    assert executions(stack, "finish") == {key: 1}, "the job completed more than once"
    assert executions(stack) == {key: 2}, "started by the killed worker, then once more after recovery"
    # Redis gives the killed worker's unacked message back after the visibility timeout: it must be suppressed.
    wait_until(
        "the redelivered message to be suppressed",
        lambda: stack.query("SELECT suppressed FROM jobs WHERE key = %s", key) >= [(1,)],
        60,
    )
    decisions = stack.query(
        "SELECT decision FROM audit.journal WHERE kind = 'suppressed' AND details::jsonb->>'job' = %s", key
    )
    assert ("duplicate_delivery",) in decisions
    assert executions(stack, "finish") == {key: 1}
    state = client.get_state(agent.id)
    assert (state.phase, state.pending_jobs) == ("done", ())


def test_flushed_broker_loses_nothing(stack: Stack, client: Client) -> None:
    """The broker's data is wiped (every key under the test's own prefix: what a FLUSHALL would take from Keel,
    and nothing of anyone else's) while jobs wait in the queue behind a busy worker. Postgres still knows them;
    every one completes once."""
    names = make_agents(client, 11)
    stack.worker("w1", concurrency=1)
    stack.beat()
    client.submit(names[0], "req-busy", None, operation="block")
    busy = scoped(client.get_state(names[0]).id, "req-busy:block:1")
    wait_until("the worker to be busy", lambda: executions(stack).get(busy) == 1)
    for i, name in enumerate(names[1:]):
        client.submit(name, f"req-{i}", None, operation="count")
    wait_until("ten jobs to wait on the broker", lambda: list(statuses(stack).values()).count("enqueued") == 10)
    with stack.broker.redis() as broker:
        assert broker.llen(stack.broker.key("keel.jobs")) == 10
    assert stack.broker.wipe() > 0
    stack.release(busy)
    wait_until("every job to succeed after the flush", lambda: all_succeeded(stack, 11), 60)
    counts = executions(stack)
    assert counts.pop(busy) == 1
    assert len(counts) == 10 and set(counts.values()) == {1}
    assert "recovered" in stack.log("beat")


def test_two_beats_and_a_killed_beat_neither_duplicate_nor_lose(stack: Stack, client: Client) -> None:
    names = make_agents(client, 60)
    stack.worker("w1", concurrency=2)
    stack.beat("beat-a")
    stack.beat("beat-b")
    for i, name in enumerate(names[:30]):
        client.submit(name, f"req-{i}", None, operation="count")
    wait_until("a leader to dispatch", lambda: sum(s == "succeeded" for s in statuses(stack).values()) >= 5, 60)
    leader = "beat-a" if "this beat is the leader" in stack.log("beat-a") else "beat-b"
    follower = "beat-b" if leader == "beat-a" else "beat-a"
    assert "this beat is the leader" not in stack.log(follower), "two leaders at once"
    stack.kill(leader)
    for i, name in enumerate(names[30:], start=30):
        client.submit(name, f"req-{i}", None, operation="count")
    stack.beat("beat-c")
    wait_until("all 60 jobs to succeed", lambda: all_succeeded(stack, 60), 90)
    counts = executions(stack)
    assert len(counts) == 60 and set(counts.values()) == {1}
    # The leader's lease runs out a few seconds after it died; whichever living beat asks first then takes over —
    # the one that was waiting, or the one started since.
    took_over = [b for b in (follower, "beat-c") if "this beat is the leader" in stack.log(b)]
    assert took_over, "a surviving beat took over"


def test_a_job_past_its_hard_deadline_fails_the_agent_and_its_late_outcome_is_fenced_off(
    stack: Stack, client: Client
) -> None:
    from datetime import timedelta

    agent = client.create_agent("late")
    stack.worker("w1")
    stack.beat()
    # The beat both dispatches the job and enforces the deadline: started late (a loaded machine), it would find the
    # deadline passed before the job ever ran. The deadline must pass while the job runs.
    wait_until("the beat to start", lambda: "Starting..." in stack.log("beat"), 60)
    # 8 s: time enough for the job to start on a loaded machine before the deadline passes (the deadline stopping a
    # request whose job never started is another test's subject).
    client.submit(agent.id, "req-late", None, operation="block", hard_deadline=timedelta(seconds=8))
    key = scoped(agent.id, "req-late:block:1")

    def started() -> bool:
        assert client.get_state(agent.id).phase != "failed" or executions(stack).get(key), (
            "the deadline passed before the job started: the worker took over 8 s to start it"
        )
        return executions(stack).get(key) == 1

    wait_until("the job to start", started)
    wait_until("the deadline to stop the agent", lambda: client.get_state(agent.id).phase == "failed", 30)
    assert statuses(stack)[key] == "cancelled"
    stopped_at = client.get_state(agent.id)
    # Its lease keeper's next round finds the job ended: the run is told (``lost``), and what it writes is refused.
    wait_until("the worker to learn its job was ended", lambda: "this run stops" in stack.log("w1"), 15)
    stack.release(key)
    wait_until(
        "the late outcome to be journaled as fenced off",
        lambda: stack.query("SELECT count(*) FROM audit.journal WHERE decision = 'fenced_off'") == [(1,)],
    )
    assert key not in executions(stack, "finish"), "the handler's late write through ctx.db was refused"
    after = client.get_state(agent.id)
    assert (after.phase, after.revision) == ("failed", stopped_at.revision), "the late outcome changed the agent"
    assert statuses(stack)[key] == "cancelled"
    fail = [e for e in client.journal(agent_id=agent.id) if e.kind == "transition" and e.event == "fail"]
    assert [e.decision for e in fail] == ["hard_deadline_passed"]
    assert fail[0].details["jobs_cancelled"] == [key]


def _job(stack: Stack, key: str) -> dict[str, Any]:
    cols = ["status", "attempts", "error_attempts", "error_class", "failed_tokens", "last_error"]
    rows = stack.query(f"SELECT {', '.join(cols)} FROM jobs WHERE key = %s", key)
    return dict(zip(cols, rows[0], strict=True))


def test_retry_caps_per_error_class(stack: Stack, client: Client) -> None:
    invalid, flaky, limited, recovers = make_agents(client, 4)
    stack.worker("w1", concurrency=2)
    stack.beat()
    client.submit(invalid, "req-invalid", None, operation="invalid")
    client.submit(flaky, "req-flaky", None, operation="flaky")
    client.submit(limited, "req-limited", {"retry_after": 2}, operation="ratelimited")
    client.submit(recovers, "req-recovers", {"succeed_on": 2}, operation="flaky")
    finals = {"failed", "dead", "succeeded"}
    wait_until("all four to finish", lambda: all(s in finals for s in statuses(stack).values()), 60)

    def k(name: str, key: str) -> str:
        return scoped(client.get_state(name).id, key)

    assert executions(stack)[k(invalid, "req-invalid:invalid:1")] == 1, "invalid is never retried"
    assert _job(stack, k(invalid, "req-invalid:invalid:1"))["status"] == "failed"
    assert client.journal(agent_id=invalid)[-1].decision == "invalid_not_retried"

    job = _job(stack, k(flaky, "req-flaky:flaky:1"))
    assert executions(stack)[k(flaky, "req-flaky:flaky:1")] == 3 == job["attempts"], (
        "transient runs up to its cap (3 here)"
    )
    assert (job["status"], job["error_attempts"], job["failed_tokens"]) == ("dead", {"transient": 3}, 30)
    state = client.get_state(flaky)
    assert (state.phase, state.spent_tokens) == ("failed", 30), "failed attempts' spend is charged"
    assert client.journal(agent_id=flaky)[-1].decision == "transient_cap_reached"

    limited_key = k(limited, "req-limited:ratelimited:1")
    runs = stack.query("SELECT at FROM executions WHERE key = %s ORDER BY at", limited_key)
    assert len(runs) == 2 and (runs[1][0] - runs[0][0]).total_seconds() >= 2.0, "429 waits its retry-after"
    assert _job(stack, limited_key)["status"] == "succeeded"

    job = _job(stack, k(recovers, "req-recovers:flaky:1"))
    assert (job["status"], job["attempts"], job["failed_tokens"]) == ("succeeded", 2, 10)
    state = client.get_state(recovers)
    assert (state.phase, state.spent_tokens) == ("done", 15), "retry-caused 10 plus the successful attempt's 5"


def test_budget_stops_spending_before_the_next_step(stack: Stack, client: Client) -> None:
    agent = client.create_agent("spender", budget_tokens=350)
    stack.worker("w1")
    stack.beat()
    client.submit(agent.id, "req-spend", None, operation="spend")
    wait_until("the budget to stop the agent", lambda: client.get_state(agent.id).phase == "failed", 60)
    state = client.get_state(agent.id)
    assert state.spent_tokens == 400, "four steps of 100 ran; the fifth was not started"
    assert len(executions(stack)) == 4
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.event, last.decision) == ("fail", "budget_exhausted")
    assert _job(stack, scoped(agent.id, "req-spend:spend:5"))["status"] == "failed"


def test_flower_lists_the_worker(stack: Stack) -> None:
    import httpx

    stack.worker("w1")
    port = free_port()
    stack.start("flower", "flower", "--port", str(port), "--address=127.0.0.1")

    def workers() -> Any:
        try:
            response = httpx.get(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=5)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 and response.json() else None

    listed = wait_until("Flower to list the worker", workers, 60, every=1)
    assert any(name.startswith("w1@") for name in listed)

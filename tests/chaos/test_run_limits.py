"""Run limits and connections in a real worker: in the threads pool (the default) a hung handler or tool ends its own
job, fenced off, while the process and its other jobs run on; a process is replaced only once its stuck threads
reach KEEL_WORKER_STUCK_LIMIT, and only after its other jobs have finished; in prefork the process that hung is
replaced at once. And 200 jobs in flight in one process hold at most 20 database connections."""

from __future__ import annotations

import json
import time
from typing import Any

import psutil
import pytest

import tests.support.tools  # noqa: F401 - the workers' tools: this process's submits are checked against them
from agents.client import Client
from tasks.app import make_app, publisher
from tests.chaos.conftest import Stack, wait_until
from tests.support.broker import Broker
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos


def executions(stack: Stack, phase: str) -> dict[str, int]:
    rows = stack.query("SELECT key, count(*) FROM executions WHERE phase = %s GROUP BY key", phase)
    return {key: n for key, n in rows}


def job(stack: Stack, key: str) -> dict[str, Any]:
    cols = ["status", "attempts", "error_attempts", "last_error", "result"]
    rows = stack.query(f"SELECT {', '.join(cols)} FROM jobs WHERE key = %s", key)
    return dict(zip(cols, rows[0], strict=True)) if rows else {}


def stall_request(client: Client) -> tuple[Any, str]:
    """A request whose model calls ``test_stall`` (a tool with a 1 s timeout that takes 4 s), then answers."""
    talker = client.create_agent("talker")
    call = {"name": "test_stall", "arguments": {"channel": "C0PS", "text": "late news"}}
    script = {"prompt": "do it", "script": [{"tool_calls": [call]}, {"content": "Told."}]}
    client.submit(talker.id, "req-stall", script)
    return talker, scoped(talker.id, "req-stall:tool:test_stall:1.call_0_0")


def limited(stack: Stack, **env: str) -> None:
    stack.env["KEEL_IMPORTS"] = json.dumps(["tests.support.handlers", "tests.support.tools"])
    stack.env["KEEL_RUN_LIMITS"] = json.dumps({"hang": 2})
    stack.env.update(env)


def test_in_the_threads_pool_a_hung_handler_and_a_stalled_tool_end_their_own_jobs_only(
    stack: Stack, client: Client
) -> None:
    limited(stack)
    worker = stack.worker("w1", concurrency=8, KEEL_WORKER_POOL="threads")
    stack.beat()
    neighbour = client.create_agent("neighbour")
    client.submit(neighbour.id, "req-n", None, operation="block")
    wait_until("the neighbour to start", lambda: executions(stack, "start").get(scoped(neighbour.id, "req-n:block:1")))

    hung = client.create_agent("hung")
    client.submit(hung.id, "req-hang", None, operation="hang")
    wait_until("the hung job to reach its cap", lambda: client.get_state(hung.id).phase == "failed", 60)
    state = job(stack, scoped(hung.id, "req-hang:hang:1"))
    assert (state["status"], state["error_attempts"]) == ("dead", {"unknown": 2})
    assert "run limit of 2s" in state["last_error"] and "fenced off" in state["last_error"]

    talker, key = stall_request(client)
    wait_until("the stalled tool's request to finish", lambda: client.get_state(talker.id).phase == "done", 60)
    assert "did not finish within 1s" in job(stack, key)["result"]["content"]

    # Both hung attempts wake up 20 s after they started and try to record "late" through ctx.db: refused.
    hang_key = scoped(hung.id, "req-hang:hang:1")
    wait_until("the hung handlers to wake and be refused", lambda: "FencedOff" in stack.log("w1"), 40)
    assert hang_key not in executions(stack, "late"), "a handler past its run limit wrote through Keel"
    assert stack.query("SELECT count(*) FROM outbox") == [(0,)], "what a stalled tool returned late was dropped"

    stack.release(scoped(neighbour.id, "req-n:block:1"))
    wait_until("the neighbour to finish", lambda: client.get_state(neighbour.id).phase == "done", 30)
    assert executions(stack, "start")[scoped(neighbour.id, "req-n:block:1")] == 1, "the neighbour ran once"
    assert job(stack, scoped(neighbour.id, "req-n:block:1"))["error_attempts"] == {}
    assert worker.poll() is None and "exits with status 70" not in stack.log("w1"), "the process runs on"


def test_in_prefork_a_hung_handler_and_a_stalled_tool_end_with_their_process(stack: Stack, client: Client) -> None:
    limited(stack, KEEL_WORKER_POOL="prefork")
    worker = stack.worker("w1", concurrency=1)
    stack.beat()
    hung = client.create_agent("hung")
    client.submit(hung.id, "req-hang", None, operation="hang")
    wait_until("the hung job to reach its cap", lambda: client.get_state(hung.id).phase == "failed", 60)
    state = job(stack, scoped(hung.id, "req-hang:hang:1"))
    assert (state["status"], state["error_attempts"]) == ("dead", {"unknown": 2})

    talker, key = stall_request(client)
    wait_until("the request to finish", lambda: client.get_state(talker.id).phase == "done", 60)
    assert "did not finish within 1s" in job(stack, key)["result"]["content"]
    time.sleep(5)  # longer than the stalled tool and the hung handler would have needed to finish
    assert executions(stack, "late") == {}, "work past its limit ran on"
    assert stack.query("SELECT count(*) FROM outbox") == [(0,)], "a tool past its timeout emitted nothing"
    children = {p.pid for p in psutil.Process(worker.pid).children()}
    pids = {pid for (pid,) in stack.query("SELECT DISTINCT pid FROM executions")}
    assert worker.poll() is None and not (pids & children), "the worker lives on; the processes that hung are gone"


def test_a_threads_worker_at_its_stuck_limit_lets_its_jobs_finish_and_exits_to_be_replaced(
    stack: Stack, client: Client
) -> None:
    limited(stack, KEEL_WORKER_STUCK_LIMIT="1")  # (the replacement below may carry more)
    worker = stack.worker("w1", concurrency=4, KEEL_WORKER_POOL="threads")
    stack.beat()
    neighbour = client.create_agent("neighbour")
    client.submit(neighbour.id, "req-n", None, operation="block")
    block_key = scoped(neighbour.id, "req-n:block:1")
    wait_until("the neighbour to start", lambda: executions(stack, "start").get(block_key))
    hung = client.create_agent("hung")
    client.submit(hung.id, "req-hang", None, operation="hang")

    # Its one stuck thread is as many as it may carry: it takes no more jobs, and waits for the neighbour.
    wait_until("the worker to stop taking jobs", lambda: "exits with status 70 to be replaced" in stack.log("w1"), 30)
    later = client.create_agent("later")
    client.submit(later.id, "req-l", {"seconds": 0}, operation="nap")
    time.sleep(2)
    assert worker.poll() is None, "the neighbour's step is not cut off"
    assert scoped(later.id, "req-l:nap:1") not in executions(stack, "start"), "no new job starts here"
    stack.release(block_key)
    wait_until("the worker to exit", lambda: worker.poll() is not None, 30)
    assert worker.returncode == 70, stack.log("w1")[-2000:]

    stack.worker("w2", concurrency=4, KEEL_WORKER_STUCK_LIMIT="10", KEEL_WORKER_POOL="threads")
    wait_until("the later job to run on the new worker", lambda: client.get_state(later.id).phase == "done", 30)
    assert client.get_state(neighbour.id).phase == "done"
    assert executions(stack, "start")[block_key] == 1, "the neighbour ran once, to its end"
    assert job(stack, block_key)["error_attempts"] == {}


def test_two_hundred_jobs_in_flight_in_one_process_hold_at_most_twenty_connections(
    stack: Stack, client: Client, broker: Broker
) -> None:
    stack.worker("w1", concurrency=200, KEEL_WORKER_POOL="threads")
    celery = make_app(broker.settings())
    producer = Client(client.db, publisher=publisher(celery))  # published at submit: no beat, no connection of its
    agents = [producer.create_agent(f"napper-{n}") for n in range(200)]
    for agent in agents:
        producer.submit(agent.id, "req-nap", {"seconds": 6}, operation="nap")
    celery.close()
    client.db.dispose()  # the test's own pool: only the worker's connections are left on this database
    peak_running, peak_connections = 0, 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        [(running, connections)] = stack.query(
            "SELECT (SELECT count(*) FROM jobs WHERE status = 'running'),"
            " (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            "  AND backend_type = 'client backend' AND pid <> pg_backend_pid())"
        )
        peak_running, peak_connections = max(peak_running, running), max(peak_connections, connections)
        if len(executions(stack, "finish")) == 200:
            break
        time.sleep(0.1)
    assert len(executions(stack, "finish")) == 200, "every job finished"
    assert peak_running == 200, f"all 200 ran at once (at most {peak_running} did)"
    assert peak_connections <= 20, f"{peak_connections} connections for 200 jobs in flight"


def test_an_operation_routed_to_a_queue_of_its_own_runs_on_the_prefork_worker_there(
    stack: Stack, client: Client
) -> None:
    stack.env["KEEL_OPERATION_QUEUES"] = json.dumps({"count": "keel.cpu"})
    threads = stack.worker("threads", concurrency=4, KEEL_WORKER_POOL="threads")
    prefork = stack.worker("cpu", concurrency=1, queues="keel.cpu", KEEL_WORKER_POOL="prefork")
    stack.beat()
    routed, other = client.create_agent("routed"), client.create_agent("other")
    client.submit(routed.id, "req-r", None, operation="count")
    client.submit(other.id, "req-o", {"seconds": 0}, operation="nap")
    for agent in (routed, other):
        wait_until(f"{agent.name} to finish", lambda agent=agent: client.get_state(agent.id).phase == "done", 30)
    ran = dict(stack.query("SELECT key, pid FROM executions WHERE phase = 'start'"))
    children = {p.pid for p in psutil.Process(prefork.pid).children()}
    assert ran[scoped(routed.id, "req-r:count:1")] in children, "the routed operation ran in a prefork child"
    assert ran[scoped(other.id, "req-o:nap:1")] == threads.pid, "the others ran on the threads worker"

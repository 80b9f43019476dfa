"""Issue 8's fault paths that need no Celery process: run limits and tool timeouts, one clock, recovery of
unclaimed jobs and lost connections, honest errors. (Staged outcomes, recorded and charged once, are in
test_staged_outcomes.py; the fault paths that need real processes are in tests/chaos/test_faults.py.)"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from agents.client import Client
from agents.core import errors
from agents.core import transition as core
from agents.core.commands import MessageSpec, Usage
from agents.core.errors import FencedOff, KeelError
from agents.core.phases import Event
from agents.jobs.handlers import JobContext, JobResult, registry
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.db import Database
from models.jobs_sql import job_row, take_due
from tests.support.broker import Broker
from tests.support.keys import scoped
from tests.support.outbox import outbox_keys
from tests.support.runs import make_runner

pytestmark = pytest.mark.integration

# These tests run each operation with a registry of their own (make_runner); the client only needs to know them.
for _operation in ("count", "finish", "hang", "retry"):
    registry.declare(_operation)


class Announce(BaseModel):
    text: str


SLOW_FINISHED = threading.Event()


@tool("test_slowpost", timeout=0.3, description="Post slowly.")
def slowpost(args: Announce, ctx: ToolContext) -> ToolOutput:
    time.sleep(1.0)
    SLOW_FINISHED.set()
    return ToolOutput("posted", messages=(MessageSpec("slack", "C0PS", ctx.call_id, {"text": args.text}),))


def test_a_handler_past_its_run_limit_is_ended_and_counted_as_unknown(client: Client, db: Database) -> None:
    agent = client.create_agent("hung")
    client.submit(agent.id, "req-1", None, operation="hang")
    release = threading.Event()
    late: list[str] = []

    def hang(ctx: JobContext) -> JobResult:
        release.wait(10)
        late.append("returned")
        return JobResult(output={"late": True}, usage=Usage(99), event=Event.FINISH)

    runner = make_runner(db, {"hang": hang}, run_limits={"hang": 0.5})
    started = time.monotonic()
    outcome = runner.run(scoped(agent.id, "req-1:hang:1"))
    release.set()
    assert time.monotonic() - started < 5
    assert outcome.status == "retrying" and outcome.end_process, "the caller is told to end the process"
    row = job_row(db, scoped(agent.id, "req-1:hang:1"))
    assert row is not None and row["error_class"] == "unknown" and "run limit of 0.5s" in row["last_error"]
    assert row["status"] == "pending" and row["tokens"] == 0, "nothing of the overrun attempt was recorded"


def test_a_tool_past_its_timeout_asks_for_its_process_to_end_and_emits_nothing(client: Client, db: Database) -> None:
    finished = SLOW_FINISHED
    finished.clear()
    agent = client.create_agent("slowposter")
    script = [
        {"tool_calls": [{"name": "test_slowpost", "arguments": {"text": "hi"}}]},
        {"content": "Done."},
    ]
    client.submit(agent.id, "req-1", {"prompt": "post", "script": script})
    runner = make_runner(db)
    runner.run(scoped(agent.id, "req-1:plan:1"))
    outcome = runner.run(scoped(agent.id, "req-1:tool:test_slowpost:1.call_0_0"))
    assert outcome.status == "succeeded" and outcome.end_process
    assert finished.wait(3), "the abandoned thread did finish (in production its process is ended first)"
    row = job_row(db, scoped(agent.id, "req-1:tool:test_slowpost:1.call_0_0"))
    assert row is not None and "did not finish within 0.3s" in row["result"]["content"]
    assert outbox_keys(db) == [], "a tool past its timeout emits nothing"


def test_every_comparison_uses_the_database_clock_not_the_hosts(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose clock runs five minutes behind (or ahead) claims a due job, schedules retries and writes
    journal times on the database's clock."""
    skew = timedelta(minutes=5)
    for sign in (-1, 1):
        monkeypatch.setattr(core, "now", lambda sign=sign: datetime.now(UTC) + sign * skew)
        agent = client.create_agent(f"skew{sign}")
        client.submit(agent.id, f"req{sign}", None, operation="retry")
        attempts: list[int] = []

        def retry(ctx: JobContext, attempts: list[int] = attempts) -> JobResult:
            from agents.core.errors import TransientError

            attempts.append(ctx.attempt)
            if ctx.attempt == 1:
                raise TransientError("503")
            return JobResult(event=Event.FINISH)

        runner = make_runner(db, {"retry": retry})
        key = scoped(agent.id, f"req{sign}:retry:1")
        assert runner.run(key).status == "retrying", "a due job is claimed whatever this host's clock says"
        with psycopg.connect(db.libpq_url) as conn:
            delay = conn.execute("SELECT run_at - clock_timestamp() FROM jobs WHERE key = %s", (key,)).fetchone()
        assert delay is not None and timedelta(0) < delay[0] < timedelta(seconds=5), "backoff measured on the DB"
        deadline = time.monotonic() + 10
        while runner.run(key).status != "succeeded":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        times = [e.at for e in client.journal(agent_id=agent.id)]
        assert times == sorted(times) and abs(times[-1] - datetime.now(UTC)) < timedelta(seconds=30)


def test_unclaimed_jobs_are_republished_under_load(
    client: Client, db: Database, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message lost while its queue has a backlog (the queue is never idle) is published again after the enqueue
    timeout; before, only idle queues were recovered, so under steady load it was stranded for good."""
    from tasks.app import make_app
    from tasks.dispatcher import dispatch_once

    names = [client.create_agent(f"a{i}").id for i in range(3)]
    for i, agent_id in enumerate(names):
        client.submit(agent_id, f"req-{i}", None, operation="count")
    settings = broker.settings(database_url=db.url, enqueue_timeout_seconds=1)
    for name, value in broker.env.items():
        monkeypatch.setenv(name, value)
    queue = broker.key("keel.jobs")
    with broker.redis() as redis:
        celery = make_app(settings)
        assert dispatch_once(db, celery, settings).published == 3
        redis.lpop(queue)  # one message is lost; two still wait: the queue has a backlog
        assert redis.llen(queue) == 2
        time.sleep(1.2)
        report = dispatch_once(db, celery, settings)
        celery.close()
        assert report.recovered == 3, "every job unclaimed past the timeout was published again, backlog or not"
        assert redis.llen(queue) == 5


def test_publishing_that_fails_after_commit_hands_the_jobs_to_the_dispatcher(client: Client, db: Database) -> None:
    agent = client.create_agent("a")

    def broken(due: Any) -> None:
        raise ConnectionError("broker down")

    # The submit committed: it is answered as done, and its first job goes back to the dispatcher at once (pending),
    # not left `enqueued` until the enqueue timeout re-publishes it.
    publishing = Client(db, publisher=broken)
    state = publishing.submit(agent.id, "req-1", None, operation="count")
    assert (state.phase, state.request_id) == ("planning", "req-1")
    assert job_row(db, scoped(agent.id, "req-1:count:1"))["status"] == "pending"  # type: ignore[index]
    with db.transaction() as cur:
        assert [d.key for d in take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)] == [
            scoped(agent.id, "req-1:count:1")
        ]


def test_a_stale_pooled_connection_is_replaced_not_failed(client: Client, db: Database, db_url: str) -> None:
    """After a database restart every pooled connection is dead; the next claim must still work."""
    from models.urls import libpq_url

    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="finish")
    with db.connection() as conn:  # warm the pool
        conn.execute("SELECT 1")
        conn.rollback()
    with psycopg.connect(libpq_url(db_url), autocommit=True) as admin:
        killed = [
            pid
            for (pid,) in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        ]
        assert killed, "the pool held connections to kill"
        admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (killed,))
        # pg_terminate_backend only signals: as after a restart, the next claim comes once the old backends are gone
        # (before that, a pooled connection's server may not have said goodbye yet, and nothing can tell it is dead).
        deadline = time.monotonic() + 10
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (killed,)).fetchone() != (0,):
            assert time.monotonic() < deadline, f"backends {killed} still there"
            time.sleep(0.02)
    outcome = make_runner(db, {"finish": lambda ctx: JobResult(event=Event.FINISH)}).run(
        scoped(agent.id, "req-1:finish:1")
    )
    assert outcome.status == "succeeded"


def test_every_public_error_is_a_keel_error() -> None:
    """Every exception class Keel's packages define (and a caller could meet) derives from KeelError."""
    import importlib
    import inspect
    import pkgutil

    import agents
    import models

    found = []
    for package in (agents, models):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            found += [
                obj
                for _, obj in inspect.getmembers(module, inspect.isclass)
                if issubclass(obj, Exception) and obj.__module__ == module.__name__ and not obj.__name__.startswith("_")
            ]
    assert FencedOff in found and errors.LostUpdate in found
    outsiders = [f"{cls.__module__}.{cls.__name__}" for cls in found if not issubclass(cls, KeelError)]
    assert outsiders == []


def test_a_job_found_under_a_resting_agent_is_settled_by_the_single_writer(
    client: Client, db: Database, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Unreachable through the API (coming to rest cancels every live job in the same transaction); if a job is
    live under a resting agent anyway, the runner settles it through transition(), journaled — not behind it."""
    agent = client.create_agent("resting")
    client.submit(agent.id, "req-1", None, operation="finish")
    client.cancel(agent.id, actor="alice", reason="stop")
    raw.execute("SET session_replication_role = replica")  # a superuser bypassing the database's own guards
    raw.execute(
        "UPDATE jobs SET status = 'pending', last_error = NULL WHERE key = %s", (scoped(agent.id, "req-1:finish:1"),)
    )
    raw.execute("SET session_replication_role = DEFAULT")
    before = client.get_state(agent.id).revision
    outcome = make_runner(db, {"finish": lambda ctx: JobResult(event=Event.FINISH)}).run(
        scoped(agent.id, "req-1:finish:1")
    )
    assert outcome.status == "cancelled"
    assert job_row(db, scoped(agent.id, "req-1:finish:1"))["status"] == "cancelled"  # type: ignore[index]
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.kind, last.event, last.decision, last.revision) == (
        "transition",
        "charge",
        "agent_at_rest",
        before + 1,
    )
    assert last.details["job"] == scoped(agent.id, "req-1:finish:1") and last.details["job_status"] == "cancelled"


def test_a_message_whose_claim_cannot_reach_the_database_goes_back_to_the_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The database is down (a restart, a failover): the task must not fail and be acked — it hands the message back
    (Reject with requeue), so the job is claimed when the database answers again."""
    import socket
    from types import SimpleNamespace

    from celery.exceptions import Reject

    import tasks.jobs

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    down = Database(f"postgresql://postgres@127.0.0.1:{port}/keel")
    runner = make_runner(down, {"finish": lambda ctx: JobResult(event=Event.FINISH)})
    monkeypatch.setattr(tasks.jobs, "runtime", lambda: SimpleNamespace(runner=runner, db=down, outage=runner.outage))
    monkeypatch.setattr(tasks.jobs, "STORE_BACKOFF_SECONDS", (0.0, 0.0))
    try:
        with pytest.raises(Reject) as raised:
            tasks.jobs.run_job.run("req-1:finish:1")
    finally:
        down.dispose()
    assert raised.value.requeue is True


def test_a_failed_lease_renewal_is_retried_within_a_second(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from agents.jobs import leases
    from agents.jobs.leases import LeaseKeeper

    calls: list[float] = []

    def flaky_extend(*args: Any) -> set[tuple[str, int]]:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise psycopg.OperationalError("the database is restarting")
        return {("k", 1)}

    monkeypatch.setattr(leases, "extend_leases", flaky_extend)
    keeper = LeaseKeeper(db, timedelta(seconds=9))  # renewed every 3 s while all is well
    with keeper.hold("k", 1, threading.Event()):
        deadline = time.monotonic() + 8
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(calls) >= 2 and calls[1] - calls[0] < 1.5, "retried after a second, not a third of a lease"

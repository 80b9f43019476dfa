"""Issue 8's fault paths that need no Celery process: whole-outcome checkpoints, run limits, one clock, recovery of
unclaimed jobs under load, honest errors. (The ones that need real processes are in tests/chaos/test_faults.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from agents.client import Client
from agents.core import errors
from agents.core import transition as core
from agents.core.commands import MessageSpec, Usage
from agents.core.errors import FencedOff, KeelError, StoreError
from agents.core.phases import Event
from agents.core.policies import DEFAULT_RULES, ErrorClass
from agents.jobs.handlers import JobContext, JobResult, Registry, registry
from agents.jobs.runner import Runner
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.db import Database
from models.jobs_sql import job_row, take_due
from tests.support.broker import Broker
from tests.support.db import expire_lease
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

# These tests run each operation with a registry of their own (runner() below); the client only needs to know them.
for _operation in ("count", "finish", "flaky", "hang", "nul", "retry", "spend"):
    registry.declare(_operation)

POSTS: list[str] = []


class Announce(BaseModel):
    text: str


@tool("test_announce", description="Post an announcement to #ops and pay for it.")
def announce(args: Announce, ctx: ToolContext) -> ToolOutput:
    POSTS.append(ctx.call_id)
    message = MessageSpec("slack", "C0PS", ctx.call_id, {"text": args.text})
    return ToolOutput("posted to #ops", messages=(message,), usage=Usage(40, Decimal("0.04")))


SLOW_FINISHED = threading.Event()


@tool("test_slowpost", timeout=0.3, description="Post slowly.")
def slowpost(args: Announce, ctx: ToolContext) -> ToolOutput:
    time.sleep(1.0)
    SLOW_FINISHED.set()
    return ToolOutput("posted", messages=(MessageSpec("slack", "C0PS", ctx.call_id, {"text": args.text}),))


def make_runner(
    db: Database, handlers: dict[str, Callable[[JobContext], JobResult]] | None = None, **kw: Any
) -> Runner:
    import agents.runtime.loop  # noqa: F401 - registers plan, tool and gate in the global registry
    from agents.jobs.handlers import registry as global_registry

    registry: Registry = global_registry
    if handlers:
        registry = Registry()
        for name, fn in handlers.items():
            registry.register(name, fn)
    return Runner(db, registry, worker="w", lease=timedelta(seconds=30), rules=DEFAULT_RULES, **kw)


def outbox_keys(db: Database) -> list[str]:
    with psycopg.connect(db.libpq_url) as conn:
        return [r[0] for r in conn.execute("SELECT key FROM outbox ORDER BY seq").fetchall()]


def test_a_tool_step_whose_outcome_failed_is_replayed_with_its_messages_and_usage_once(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool ran and its outcome was staged; the outcome transition failed (the database went away, the worker
    died). The retry must emit the tool's message and charge its usage — once, under the same keys — without
    running the tool again."""
    POSTS.clear()
    agent = client.create_agent("poster")
    script = [
        {"tool_calls": [{"name": "test_announce", "arguments": {"text": "deploy at 5"}}], "tokens": 100, "cost": "0"},
        {"content": "Announced.", "tokens": 50, "cost": "0"},
    ]
    client.submit(agent.id, "req-1", {"prompt": "announce the deploy", "script": script})
    runner = make_runner(db)
    assert runner.run(scoped(agent.id, "req-1:plan:1")).status == "succeeded"
    tool_key = scoped(agent.id, "req-1:tool:test_announce:1.call_0_0")

    real = core.transition
    failures = []

    def failing(db_: Database, command: Any, **kw: Any) -> Any:
        if command.outcome is not None and command.outcome.key == tool_key and not failures:
            failures.append(command)
            outage = psycopg.OperationalError("terminating connection due to administrator command")
            raise StoreError("database error: terminating connection due to administrator command") from outage
        return real(db_, command, **kw)

    monkeypatch.setattr(core, "transition", failing)
    with pytest.raises(StoreError):
        runner.run(tool_key)
    assert POSTS == ["call_0_0"] and outbox_keys(db) == [], "ran; nothing recorded yet"
    staged = job_row(db, tool_key)["result"]["staged"]  # type: ignore[index]
    assert staged["result"]["messages"][0]["destination"] == "C0PS", "the checkpoint holds the whole outcome"

    expire_lease(db, tool_key)  # the lease runs out; the dispatcher recovers the job under the same key
    with db.transaction() as cur:
        assert [d.key for d in take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)] == [tool_key]
    assert runner.run(tool_key).status == "succeeded"
    assert POSTS == ["call_0_0"], "the tool did not run again"
    assert outbox_keys(db) == [scoped(agent.id, "req-1:slack:tool.test_announce:1.call_0_0@call_0_0")], (
        "its message was emitted, once, under its key"
    )
    assert runner.run(scoped(agent.id, "req-1:plan:2")).status == "succeeded"
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("done", 100 + 40 + 50), "the tool's usage was charged once"
    assert job_row(db, tool_key)["result"] == {"tool_call_id": "call_0_0", "content": "posted to #ops"}  # type: ignore[index]


def test_a_staged_failure_is_recorded_on_replay_and_its_spend_charged(client: Client, db: Database) -> None:
    from agents.core.errors import TransientError

    agent = client.create_agent("flaky")
    client.submit(agent.id, "req-1", None, operation="flaky")
    calls: list[int] = []

    def flaky(ctx: JobContext) -> JobResult:
        calls.append(ctx.attempt)
        raise TransientError("upstream 503", usage=Usage(10, Decimal("0.01")))

    runner = make_runner(db, {"flaky": flaky})
    claimed = runner.run  # first attempt: fail, but "die" before the failure is recorded
    original = core.transition

    def dying(db_: Database, command: Any, **kw: Any) -> Any:
        outage = psycopg.OperationalError("server closed the connection unexpectedly")
        raise StoreError("database error: server closed the connection unexpectedly") from outage

    core.transition = dying  # type: ignore[assignment]
    try:
        with pytest.raises(StoreError):
            claimed(scoped(agent.id, "req-1:flaky:1"))
    finally:
        core.transition = original  # type: ignore[assignment]
    expire_lease(db, scoped(agent.id, "req-1:flaky:1"))
    with db.transaction() as cur:
        take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)
    assert runner.run(scoped(agent.id, "req-1:flaky:1")).status == "retrying"
    assert calls == [1], "the replay recorded the staged failure instead of calling the upstream again"
    row = job_row(db, scoped(agent.id, "req-1:flaky:1"))
    assert row is not None and row["failed_tokens"] == 10 and "staged" not in (row["result"] or {})
    assert client.get_state(agent.id).spent_tokens == 10


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


# --- found by review: refused outcomes, caps before replays, spend charged once, lease renewal after an outage ------


def _spend(ctx: JobContext) -> JobResult:
    return JobResult(output={"ok": True}, usage=Usage(100, Decimal("1.00")), event=Event.FINISH)


def _refuse_a_success(command: Any) -> None:
    """As the database refuses a value it cannot store, for a command that records a step's success."""
    if command.outcome is not None and command.outcome.status == "succeeded":
        refused = psycopg.errors.NumericValueOutOfRange("bigint out of range")
        raise StoreError("database error: bigint out of range") from refused


def test_an_outcome_the_database_refuses_fails_the_job_instead_of_looping(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = client.create_agent("refused")
    client.submit(agent.id, "req-1", None, operation="spend")
    real = core.transition

    def refusing(db_: Database, command: Any, **kw: Any) -> Any:
        _refuse_a_success(command)
        return real(db_, command, **kw)

    monkeypatch.setattr(core, "transition", refusing)
    outcome = make_runner(db, {"spend": _spend}).run(scoped(agent.id, "req-1:spend:1"))
    assert outcome.status == "failed", "a refusal is not an outage: no redelivery, no replay loop"
    row = job_row(db, scoped(agent.id, "req-1:spend:1"))
    assert row is not None and row["error_class"] == "invalid" and "could not be recorded" in row["last_error"]
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("failed", 100), "what the step spent is still charged"


def test_a_refused_outcome_whose_job_a_cancel_sweeps_meanwhile_is_charged_once(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database refused the staged outcome; while the worker fails the step instead, a cancel sweeps the job and
    charges the staged spend: the worker, fenced off, must not charge it a second time (outside review)."""
    agent = client.create_agent("refused-and-cancelled")
    client.submit(agent.id, "req-1", None, operation="spend")
    real = core.transition

    def refusing_then_cancelled(db_: Database, command: Any, **kw: Any) -> Any:
        _refuse_a_success(command)
        if command.outcome is not None:  # the failure that replaces it: a cancel comes first
            client.cancel(agent.id, actor="alice", reason="wrong prompt")
        return real(db_, command, **kw)

    monkeypatch.setattr(core, "transition", refusing_then_cancelled)
    assert make_runner(db, {"spend": _spend}).run(scoped(agent.id, "req-1:spend:1")).status == "fenced"
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens, state.spent_cost) == ("failed", 100, Decimal("1.00")), "charged once"


def test_a_staged_outcome_whose_workers_keep_dying_stops_at_the_unknown_cap_and_is_charged(
    client: Client, db: Database, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    agent = client.create_agent("doomed")
    client.submit(agent.id, "req-1", None, operation="spend")
    runner = make_runner(db, {"spend": _spend})
    real = core.transition

    def lost(*args: Any, **kw: Any) -> Any:
        raise StoreError("database error: connection lost") from psycopg.OperationalError("connection lost")

    core.transition = lost  # type: ignore[assignment]
    try:
        with pytest.raises(StoreError):
            runner.run(scoped(agent.id, "req-1:spend:1"))
    finally:
        core.transition = real  # type: ignore[assignment]
    cap = DEFAULT_RULES[ErrorClass.UNKNOWN].max_attempts
    raw.execute(
        "UPDATE jobs SET status = 'enqueued', error_attempts = %s WHERE key = %s",
        (psycopg.types.json.Jsonb({"unknown": cap}), scoped(agent.id, "req-1:spend:1")),
    )
    outcome = runner.run(scoped(agent.id, "req-1:spend:1"))
    assert outcome.status == "dead"
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("failed", 100), "given up, and what it spent is charged once"
    assert client.journal(agent_id=agent.id)[-1].decision == "unknown_cap_reached"


def test_a_result_with_a_nul_fails_the_step_at_once_and_is_charged(client: Client, db: Database) -> None:
    agent = client.create_agent("nul")
    client.submit(agent.id, "req-1", None, operation="nul")
    calls: list[int] = []

    def nul(ctx: JobContext) -> JobResult:
        calls.append(ctx.attempt)
        return JobResult(output={"text": "a\x00b"}, usage=Usage(7), event=Event.FINISH)

    outcome = make_runner(db, {"nul": nul}).run(scoped(agent.id, "req-1:nul:1"))
    assert outcome.status == "failed" and calls == [1]
    row = job_row(db, scoped(agent.id, "req-1:nul:1"))
    assert row is not None and row["error_class"] == "invalid" and "NUL" in row["last_error"]
    assert client.get_state(agent.id).spent_tokens == 7


def test_a_staged_outcome_fenced_off_by_a_takeover_is_charged_once_by_its_replay(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = client.create_agent("slow")
    client.submit(agent.id, "req-1", None, operation="spend")
    key = scoped(agent.id, "req-1:spend:1")
    real = core.transition
    taken: list[int] = []

    def stalled(db_: Database, command: Any, **kw: Any) -> Any:
        if command.outcome is not None and not taken:  # the worker stalls past its lease; the job is recovered
            taken.append(1)
            expire_lease(db, key)
            with db.transaction() as cur:
                take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)
        return real(db_, command, **kw)

    monkeypatch.setattr(core, "transition", stalled)
    runner = make_runner(db, {"spend": _spend})
    assert runner.run(key).status == "fenced"
    assert client.get_state(agent.id).spent_tokens == 0, "the staged outcome's spend waits for its replay"
    assert runner.run(key).status == "succeeded"
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens, state.spent_cost) == ("done", 100, Decimal("1.00")), "charged once"


def test_a_staged_outcome_fenced_off_by_a_cancel_is_charged_once_by_the_cancel(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = client.create_agent("cancelled")
    client.submit(agent.id, "req-1", None, operation="spend")
    real = core.transition
    cancelled: list[int] = []

    def raced(db_: Database, command: Any, **kw: Any) -> Any:
        if command.outcome is not None and not cancelled:
            cancelled.append(1)
            client.cancel(agent.id, actor="alice", reason="wrong prompt")
        return real(db_, command, **kw)

    monkeypatch.setattr(core, "transition", raced)
    assert make_runner(db, {"spend": _spend}).run(scoped(agent.id, "req-1:spend:1")).status == "fenced"
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("failed", 100)
    row = job_row(db, scoped(agent.id, "req-1:spend:1"))
    assert row is not None and row["status"] == "cancelled" and "staged" not in (row["result"] or {})
    cancel, fenced = client.journal(agent_id=agent.id)[-2:]
    assert cancel.event == "cancel" and cancel.details["staged_spend_charged"]["tokens"] == 100
    assert fenced.decision == "fenced_off" and "charged with the staged outcome" in fenced.details["spend"]


def test_a_failed_lease_renewal_is_retried_within_a_second(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from agents.jobs import leases
    from agents.jobs.leases import LeaseKeeper

    calls: list[float] = []

    def flaky_extend(*args: Any) -> bool:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise psycopg.OperationalError("the database is restarting")
        return True

    monkeypatch.setattr(leases, "extend_lease", flaky_extend)
    keeper = LeaseKeeper(db, timedelta(seconds=9))  # renewed every 3 s while all is well
    with keeper.hold("k", 1, threading.Event()):
        deadline = time.monotonic() + 8
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(calls) >= 2 and calls[1] - calls[0] < 1.5, "retried after a second, not a third of a lease"


def test_a_staged_outcome_whose_worker_died_is_charged_by_the_cancel_that_sweeps_it(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker staged its outcome (100 tokens spent) and died before the transition that records it; before its
    lease ran out the request was cancelled. No attempt will ever record that outcome, so nobody charged what was
    spent: the agent's spend, its budget and the spend KPIs said 0. The cancel's sweep now charges it, once: on the
    agent (its event says which jobs), on the job as the spend of a void attempt, and the outcome leaves the job."""
    agent = client.create_agent("orphaned")
    client.submit(agent.id, "req-1", None, operation="spend")
    other = client.create_agent("bystander")
    client.submit(other.id, "req-2", None, operation="count")
    key = scoped(agent.id, "req-1:spend:1")

    def died(*args: Any, **kw: Any) -> Any:
        raise StoreError("database error: connection lost") from psycopg.OperationalError("connection lost")

    monkeypatch.setattr(core, "transition", died)
    with pytest.raises(StoreError):
        make_runner(db, {"spend": _spend}).run(key)
    monkeypatch.undo()
    row = job_row(db, key)
    assert row is not None and row["status"] == "running" and "staged" in row["result"], "staged, never recorded"
    state = client.cancel(agent.id, actor="alice", reason="wrong prompt")
    assert (state.phase, state.spent_tokens, state.spent_cost) == ("failed", 100, Decimal("1.00"))
    event = client.journal(agent_id=agent.id)[-1]
    assert event.event == "cancel" and event.details["staged_spend_charged"] == {
        "jobs": [key],
        "tokens": 100,
        "cost": "1.00",
    }
    row = job_row(db, key)
    assert row is not None and row["status"] == "cancelled" and "staged" not in (row["result"] or {})
    assert (row["failed_tokens"], row["failed_cost"]) == (100, Decimal("1.00")), "the void attempt's spend"
    assert client.get_state(other.id).spent_tokens == 0, "another agent's jobs are not touched"
    from models.kpi_sql import totals

    kpis = totals(db)  # the spend KPIs count it once, as spend wasted on a void attempt
    assert (kpis.spent_tokens, kpis.retry_tokens, kpis.spent_cost, kpis.retry_cost) == (100, 100, 1.0, 1.0)

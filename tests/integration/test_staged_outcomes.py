"""A step's staged outcome (its whole result, spend included, checkpointed before the transition that records
it) is recorded and charged exactly once: replayed after that transition failed, failed when the database
refuses it, and charged once whether its replay, a cancel or the unknown-error cap settles it."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from agents.client import Client
from agents.core import transition as core
from agents.core.commands import MessageSpec, Usage
from agents.core.errors import StoreError
from agents.core.phases import Event
from agents.core.policies import DEFAULT_RULES, ErrorClass
from agents.jobs.handlers import JobContext, JobResult, registry
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.db import Database
from models.jobs_sql import job_row, take_due
from tests.support.db import expire_lease
from tests.support.keys import scoped
from tests.support.outbox import outbox_keys
from tests.support.runs import make_runner

pytestmark = pytest.mark.integration

# These tests run each operation with a registry of their own (make_runner); the client only needs to know them.
for _operation in ("count", "flaky", "nul", "spend"):
    registry.declare(_operation)

POSTS: list[str] = []


class Announce(BaseModel):
    text: str


@tool("test_announce", description="Post an announcement to #ops and pay for it.")
def announce(args: Announce, ctx: ToolContext) -> ToolOutput:
    POSTS.append(ctx.call_id)
    message = MessageSpec("slack", "C0PS", ctx.call_id, {"text": args.text})
    return ToolOutput("posted to #ops", messages=(message,), usage=Usage(40, Decimal("0.04")))


def _spend(ctx: JobContext) -> JobResult:
    return JobResult(output={"ok": True}, usage=Usage(100, Decimal("1.00")), event=Event.FINISH)


def _refuse_a_success(command: Any) -> None:
    """As the database refuses a value it cannot store, for a command that records a step's success."""
    if command.outcome is not None and command.outcome.status == "succeeded":
        refused = psycopg.errors.NumericValueOutOfRange("bigint out of range")
        raise StoreError("database error: bigint out of range") from refused


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

    _failing_once(monkeypatch, tool_key)
    with pytest.raises(StoreError):
        runner.run(tool_key)
    assert POSTS == ["call_0_0"] and outbox_keys(db) == [], "ran; nothing recorded yet"
    staged = job_row(db, tool_key)["result"]["staged"]  # type: ignore[index]
    assert staged["result"]["messages"][0]["destination"] == "C0PS", "the checkpoint holds the whole outcome"

    _recovered(db, tool_key)
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


LOOKUPS: list[str] = []


class Lookup(BaseModel):
    order: str


@tool("test_lookup", description="Look an order up (free: no usage, no messages).")
def lookup(args: Lookup, ctx: ToolContext) -> ToolOutput:
    LOOKUPS.append(ctx.call_id)
    return ToolOutput(f"order {args.order} shipped")


def _failing_once(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """The outcome transition of job ``key`` fails once, as when the database goes away under it."""
    real = core.transition
    failures: list[Any] = []

    def failing(db_: Database, command: Any, **kw: Any) -> Any:
        if command.outcome is not None and command.outcome.key == key and not failures:
            failures.append(command)
            outage = psycopg.OperationalError("terminating connection due to administrator command")
            raise StoreError("database error: terminating connection due to administrator command") from outage
        return real(db_, command, **kw)

    monkeypatch.setattr(core, "transition", failing)


def _recovered(db: Database, key: str) -> None:
    expire_lease(db, key)  # the lease runs out; the dispatcher recovers the job under the same key
    with db.transaction() as cur:
        assert [d.key for d in take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)] == [key]


def test_a_free_tool_step_is_staged_all_the_same_and_never_runs_twice(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool call may have acted however little it reports: its outcome is staged even when it spent nothing and
    declared no message, so a failed recording replays it instead of calling the tool again."""
    LOOKUPS.clear()
    agent = client.create_agent("looker")
    script = [
        {"tool_calls": [{"name": "test_lookup", "arguments": {"order": "A-1"}}], "tokens": 10, "cost": "0"},
        {"content": "It shipped.", "tokens": 5, "cost": "0"},
    ]
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?", "script": script})
    runner = make_runner(db)
    assert runner.run(scoped(agent.id, "req-1:plan:1")).status == "succeeded"
    tool_key = scoped(agent.id, "req-1:tool:test_lookup:1.call_0_0")
    _failing_once(monkeypatch, tool_key)
    with pytest.raises(StoreError):
        runner.run(tool_key)
    assert job_row(db, tool_key)["result"]["staged"]["result"]["usage"] == {"tokens": 0, "cost": "0"}  # type: ignore[index]
    _recovered(db, tool_key)
    assert runner.run(tool_key).status == "succeeded"
    assert LOOKUPS == ["call_0_0"], "the tool was not called again"
    assert runner.run(scoped(agent.id, "req-1:plan:2")).status == "succeeded"
    assert client.get_state(agent.id).phase == "done"


def test_a_repeatable_free_step_is_not_staged_and_runs_again_once_under_the_same_keys(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler registered ``repeatable`` whose outcome spent nothing is recorded without a staged checkpoint: when
    recording fails, the step runs again, and its next job (same key) is scheduled once."""
    from agents.core.commands import JobSpec
    from agents.jobs.handlers import Registry
    from agents.jobs.runner import Runner

    runs: list[int] = []

    def step(ctx: JobContext) -> JobResult:
        runs.append(ctx.attempt)
        if ctx.operation == "count":
            return JobResult(event=Event.FINISH)
        return JobResult(jobs=(JobSpec("count", "next"),))

    own = Registry()
    own.register("spend", step, repeatable=True)  # (declared above for the client; here: a free, repeatable step)
    own.register("count", step, repeatable=True)
    runner = Runner(db, own, worker="w", lease=timedelta(seconds=30), rules=DEFAULT_RULES)
    agent = client.create_agent("repeater")
    client.submit(agent.id, "req-1", None, operation="spend")
    key = scoped(agent.id, "req-1:spend:1")
    _failing_once(monkeypatch, key)
    with pytest.raises(StoreError):
        runner.run(key)
    assert job_row(db, key)["result"] is None, "nothing staged"  # type: ignore[index]
    _recovered(db, key)
    assert runner.run(key).status == "succeeded"
    assert runs == [1, 2], "it ran again"
    state = client.get_state(agent.id)
    assert [job.key for job in state.pending_jobs] == [scoped(agent.id, "req-1:count:next")], "its next job, once"
    assert runner.run(scoped(agent.id, "req-1:count:next")).status == "succeeded"
    assert client.get_state(agent.id).phase == "done"

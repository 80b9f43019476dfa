"""Jobs without Celery: keys, claims, fencing, outcomes through transition(), deadlines, budgets, schedules."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core.commands import Command, JobSpec, Usage
from agents.core.errors import InvalidInput, InvalidJob
from agents.core.phases import Event
from agents.core.policies import DEFAULT_RULES, ErrorClass
from agents.core.queues import LOW_QUEUE
from agents.core.transition import now, transition
from agents.jobs import deadlines, schedules
from agents.jobs.handlers import JobContext, JobResult, Registry, registry
from agents.jobs.runner import Runner
from models.db import Database
from models.jobs_sql import claim, job_row, take_due
from tests.support.broker import Broker
from tests.support.db import expire_lease
from tests.support.dispatchers import race_dispatchers
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

# These tests run each operation with a registry of their own (runner() below); the client only needs to know them.
for _operation in ("answer", "bad", "count", "crash", "nope", "slow", "step", "work"):
    registry.declare(_operation)


def runner(db: Database, handlers: dict[str, Callable[[JobContext], JobResult]], **kw: Any) -> Runner:
    registry = Registry()
    for name, fn in handlers.items():
        registry.register(name, fn)
    return Runner(
        db,
        registry,
        worker=kw.pop("worker", "test"),
        lease=kw.pop("lease", timedelta(seconds=30)),
        rules=DEFAULT_RULES,
        **kw,
    )


def finish(ctx: JobContext) -> JobResult:
    return JobResult(output={"answer": 42}, usage=Usage(7, Decimal("0.5")), event=Event.FINISH)


def test_submit_schedules_the_first_job_under_its_key_and_state_lists_it(client: Client) -> None:
    agent = client.create_agent("a")
    state = client.submit(agent.id, "req-1", {"q": 1}, operation="count")
    assert [(j.key, j.operation, j.target, j.status, j.queue) for j in state.pending_jobs] == [
        (scoped(agent.id, "req-1:count:1"), "count", "1", "pending", "keel.jobs")
    ]
    event = client.journal(agent_id=agent.id)[-1]
    assert event.details["jobs"] == [scoped(agent.id, "req-1:count:1")]


def test_an_existing_key_is_a_suppressed_duplicate_journaled_with_the_transition(client: Client) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="count")
    again = transition(
        client.db, Command(agent.id, Event.PROGRESS, "w", jobs=(JobSpec("count", "1"), JobSpec("count", "2")))
    )
    assert [j.key for j in client.get_state(agent.id).pending_jobs] == [
        scoped(agent.id, "req-1:count:1"),
        scoped(agent.id, "req-1:count:2"),
    ]
    details = client.journal(agent_id=agent.id)[-1].details
    assert (details["jobs"], details["jobs_suppressed"]) == (
        [scoped(agent.id, "req-1:count:2")],
        [scoped(agent.id, "req-1:count:1")],
    )
    assert again.agent.revision == 2


def test_a_transition_that_rolls_back_schedules_nothing(client: Client, db: Database) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="count")

    def boom(cur: psycopg.Cursor[Any], before: Any, after: Any) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        transition(db, Command(agent.id, Event.PROGRESS, "w", jobs=(JobSpec("count", "2"),)), effects=boom)
    assert job_row(db, scoped(agent.id, "req-1:count:2")) is None


def test_run_once_outcome_goes_through_transition(client: Client, db: Database) -> None:
    agent = client.create_agent("a", budget_tokens=100)
    client.submit(agent.id, "req-1", None, operation="answer")
    outcome = runner(db, {"answer": finish}).run(scoped(agent.id, "req-1:answer:1"))
    assert outcome.status == "succeeded"
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens, state.spent_cost, state.pending_jobs) == ("done", 7, Decimal("0.5"), ())
    row = job_row(db, scoped(agent.id, "req-1:answer:1"))
    assert row is not None and (row["status"], row["result"], row["tokens"]) == ("succeeded", {"answer": 42}, 7)
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.event, last.actor, last.details["job"], last.details["spend"]["tokens"]) == (
        "finish",
        "worker:test",
        scoped(agent.id, "req-1:answer:1"),
        7,
    )
    # A second delivery of the same key finds it finished: suppressed, counted, journaled.
    again = runner(db, {"answer": finish}).run(scoped(agent.id, "req-1:answer:1"))
    assert again.status == "suppressed"
    assert job_row(db, scoped(agent.id, "req-1:answer:1"))["suppressed"] == 1  # type: ignore[index]
    assert client.journal(agent_id=agent.id)[-1].decision == "duplicate_delivery"


def test_a_worker_whose_lease_was_taken_over_cannot_write_its_outcome(client: Client, db: Database) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="slow")
    started, release = threading.Event(), threading.Event()

    def slow(ctx: JobContext) -> JobResult:
        started.set()
        release.wait(10)
        return JobResult(output={"who": "first"}, event=Event.FINISH)

    first = runner(db, {"slow": slow}, worker="first", lease=timedelta(seconds=30))
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(first.run(scoped(agent.id, "req-1:slow:1"))))
    thread.start()
    started.wait(10)
    # The first worker looks dead: its lease is made to expire, and a second worker takes the job over.
    expire_lease(db, scoped(agent.id, "req-1:slow:1"))
    second = runner(db, {"slow": lambda ctx: JobResult(output={"who": "second"}, event=Event.FINISH)}, worker="second")
    assert second.run(scoped(agent.id, "req-1:slow:1")).status == "succeeded"
    release.set()
    thread.join(10)
    assert results[0].status == "fenced"
    row = job_row(db, scoped(agent.id, "req-1:slow:1"))
    assert row is not None and (row["result"], row["worker"], row["status"]) == (
        {"who": "second"},
        "second",
        "succeeded",
    )
    events = client.journal(agent_id=agent.id)
    assert [e.event for e in events if e.kind == "transition"] == ["submit", "finish"]
    assert events[-1].decision == "fenced_off"


def test_unknown_operation_fails_the_job_with_a_clear_error(client: Client, db: Database) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="nope")
    outcome = runner(db, {"answer": finish}).run(scoped(agent.id, "req-1:nope:1"))
    assert outcome.status == "failed"
    row = job_row(db, scoped(agent.id, "req-1:nope:1"))
    assert row is not None and row["error_class"] == "invalid"
    assert row["last_error"] == (
        "no handler is registered for operation 'nope' in this worker (registered: answer): a worker imports"
        " KEEL_IMPORTS when it starts, so restart it (keel up) after adding a handler"
    )
    assert (client.get_state(agent.id).phase, client.journal(agent_id=agent.id)[-1].decision) == (
        "failed",
        "invalid_not_retried",
    )


def test_a_handlers_bug_is_logged_with_its_traceback_and_a_job_error_without(
    client: Client, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a newcomer's walkthrough: `{}["missing"]` in a handler was one line, `KeyError('missing')`, nowhere a
    file or a line number."""

    def buggy(ctx: JobContext) -> JobResult:
        return {}["missing"]  # type: ignore[no-any-return]

    def refusing(ctx: JobContext) -> JobResult:
        raise InvalidJob("the input names no order")

    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="crash")
    client.submit(client.create_agent("b").id, "req-2", None, operation="bad")
    caplog.set_level(logging.INFO, logger="keel.runner")
    runner(db, {"crash": buggy}).run(scoped(agent.id, "req-1:crash:1"))
    b = client.get_state("b").id
    runner(db, {"bad": refusing}).run(scoped(b, "req-2:bad:1"))
    failed = [r for r in caplog.records if " failed: " in r.getMessage()]
    [bug] = [r for r in failed if scoped(agent.id, "req-1:crash:1") in r.getMessage()]
    [said] = [r for r in failed if scoped(b, "req-2:bad:1") in r.getMessage()]
    assert bug.exc_info is not None and "buggy" in "".join(traceback.format_tb(bug.exc_info[2]))
    assert not said.exc_info


def test_over_budget_job_is_not_started(client: Client, db: Database) -> None:
    agent = client.create_agent("a", budget_cost="1.00")
    client.submit(agent.id, "req-1", None, operation="step")
    calls: list[str] = []

    def step(ctx: JobContext) -> JobResult:
        calls.append(ctx.key)
        return JobResult(usage=Usage(0, Decimal("0.60")), jobs=(JobSpec("step", str(int(ctx.target) + 1)),))

    run = runner(db, {"step": step})
    assert run.run(scoped(agent.id, "req-1:step:1")).status == "succeeded"
    assert run.run(scoped(agent.id, "req-1:step:2")).status == "succeeded"  # 0.60 spent < 1.00: may start
    assert run.run(scoped(agent.id, "req-1:step:3")).status == "failed"  # 1.20 spent: not started
    assert calls == [scoped(agent.id, "req-1:step:1"), scoped(agent.id, "req-1:step:2")]
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_cost) == ("failed", Decimal("1.20"))
    assert client.journal(agent_id=agent.id)[-1].decision == "budget_exhausted"


def test_deadlines_demote_then_stop_even_with_no_job_running(client: Client, db: Database) -> None:
    agent = client.create_agent("a")
    client.submit(
        agent.id,
        "req-1",
        None,
        operation="count",
        soft_deadline=timedelta(seconds=30),
        hard_deadline=timedelta(seconds=60),
    )
    transition(db, Command(agent.id, Event.PROGRESS, "w", jobs=(JobSpec("count", "2", delay=timedelta(hours=1)),)))
    report = deadlines.enforce(db, now())
    assert report.demoted == report.stopped == []
    report = deadlines.enforce(db, now() + timedelta(seconds=31))
    assert report.demoted == [agent.id]
    state = client.get_state(agent.id)
    assert state.priority == "low" and {j.queue for j in state.pending_jobs} == {LOW_QUEUE}
    assert client.journal(agent_id=agent.id)[-1].decision == "soft_deadline_passed"
    assert deadlines.enforce(db, now() + timedelta(seconds=32)).demoted == [], "demoted once"
    # The running job is fenced off when the hard deadline stops the request.
    claimed = claim(db, scoped(agent.id, "req-1:count:1"), "w", timedelta(seconds=30))
    report = deadlines.enforce(db, now() + timedelta(seconds=61), notify_slack_channel="COPS")
    assert report.stopped == [agent.id]
    from models.outbox_sql import message_row

    notice = message_row(db, scoped(agent.id, "req-1:slack:hard-deadline"))
    assert notice is not None and notice["destination"] == "COPS" and "hard deadline" in notice["payload"]["text"]
    state = client.get_state(agent.id)
    assert (state.phase, state.pending_jobs) == ("failed", ())
    row = job_row(db, scoped(agent.id, "req-1:count:1"))
    assert row is not None and row["status"] == "cancelled" and row["fencing_token"] > claimed.fencing_token  # type: ignore[union-attr]
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.event, last.decision, sorted(last.details["jobs_cancelled"])) == (
        "fail",
        "hard_deadline_passed",
        [scoped(agent.id, "req-1:count:1"), scoped(agent.id, "req-1:count:2")],
    )


def test_dispatcher_takes_due_jobs_once_and_recovers_expired_leases(client: Client, db: Database) -> None:
    a, b = client.create_agent("a"), client.create_agent("b")
    client.submit(a.id, "req-a", None, operation="count")
    client.submit(b.id, "req-b", None, operation="count")
    transition(db, Command(a.id, Event.PROGRESS, "w", jobs=(JobSpec("count", "later", delay=timedelta(hours=1)),)))
    with db.transaction() as cur:
        first = take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=10)
    both = sorted([scoped(a.id, "req-a:count:1"), scoped(b.id, "req-b:count:1")])
    assert sorted(d.key for d in first) == both and not any(d.recovered for d in first)
    with db.transaction() as cur:
        assert take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=10) == [], "enqueued once"
    claim(db, scoped(a.id, "req-a:count:1"), "dead-worker", timedelta(seconds=1))
    expire_lease(db, scoped(a.id, "req-a:count:1"))  # leases run on the database's clock: the worker "dies" here
    with db.transaction() as cur:
        second = take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=10)
    assert [(d.key, d.recovered) for d in second] == [(scoped(a.id, "req-a:count:1"), True)]
    assert job_row(db, scoped(a.id, "req-a:count:1"))["error_attempts"] == {"unknown": 1}  # type: ignore[index]
    with db.transaction() as cur:  # the message for req-b was lost: after the enqueue timeout it is sent again
        third = take_due(cur, enqueue_timeout=timedelta(0), limit=10)
    assert {(d.key, d.recovered) for d in third} >= {(scoped(b.id, "req-b:count:1"), True)}


def test_two_dispatchers_never_take_the_same_row(client: Client, db: Database) -> None:
    for n in range(40):
        client.submit(client.create_agent(f"a{n}").id, f"req-{n}", None, operation="count")
    taken = race_dispatchers(db)
    assert len(taken) == len(set(taken)) == 40


def test_ensure_schedule_is_idempotent_and_fires_under_deterministic_keys(client: Client, db: Database) -> None:
    agent = client.create_agent("cron-bot")
    t0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    first, changed = schedules.ensure_schedule(
        db, "digest", agent.id, every=timedelta(minutes=5), input={"n": 1}, operation="count", now=t0
    )
    assert changed and first.next_fire_at == t0 + timedelta(minutes=5)
    for restart in range(3):  # every restart registers it again: nothing changes
        again, changed = schedules.ensure_schedule(
            db,
            "digest",
            agent.id,
            every=timedelta(minutes=5),
            input={"n": 1},
            operation="count",
            now=t0 + timedelta(minutes=restart),
        )
        assert not changed and again == first
    with psycopg.connect(db.libpq_url) as conn:
        assert conn.execute("SELECT count(*) FROM schedules").fetchone() == (1,)
    fire_at = t0 + timedelta(minutes=5)
    fired = schedules.fire_due(db, fire_at + timedelta(seconds=1))
    assert fired == ["digest.20260101T120500Z"]
    state = client.get_state(agent.id)
    assert [j.key for j in state.pending_jobs] == [scoped(agent.id, "digest.20260101T120500Z:count:1")]
    # A second dispatcher attempting the same fire (its bookkeeping lost) is a suppressed duplicate.
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:
        conn.execute("UPDATE schedules SET next_fire_at = %s", (fire_at,))
    assert schedules.fire_due(db, fire_at + timedelta(seconds=2)) == []
    assert client.journal(agent_id=agent.id)[-1].kind == "suppressed"
    changed_def, changed = schedules.ensure_schedule(
        db, "digest", agent.id, cron="0 * * * *", operation="count", now=t0
    )
    assert changed and changed_def.cron == "0 * * * *" and changed_def.every_seconds is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of every= or cron="),
        ({"every": timedelta(seconds=1), "cron": "* * * * *"}, "exactly one of"),
        ({"cron": "every tuesday"}, "cron expression 'every tuesday' is not valid"),
        ({"every": timedelta(0)}, "every= must be from one second"),
        ({"every": timedelta(days=30_000)}, r"to 2147483647 seconds \(68 years\), got 30000 days"),
        ({"every": timedelta(seconds=5), "operation": "bad op"}, "operation 'bad op' is invalid"),
    ],
)
def test_bad_schedules_are_refused(client: Client, db: Database, kwargs: dict[str, Any], message: str) -> None:
    agent = client.create_agent("a")
    with pytest.raises(InvalidInput, match=message):
        schedules.ensure_schedule(db, "s", agent.id, **kwargs)


def test_dispatch_publishes_each_job_under_its_key_with_no_eta(
    client: Client, db: Database, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What actually lands on Redis: task id = job key, no ETA or countdown (Postgres keeps the schedule)."""
    import json as _json

    from tasks.app import make_app
    from tasks.dispatcher import dispatch_once

    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="count")
    later = JobSpec("count", "2", delay=timedelta(hours=1))
    transition(db, Command(agent.id, Event.PROGRESS, "w", jobs=(later,)))
    settings = broker.settings(database_url=db.url)
    for name, value in broker.env.items():
        monkeypatch.setenv(name, value)
    celery = make_app(settings)
    report = dispatch_once(db, celery, settings)
    celery.close()
    assert (report.published, report.recovered) == (1, 0)
    with broker.redis() as redis:
        raw_messages = redis.lrange(broker.key("keel.jobs"), 0, -1)
    assert len(raw_messages) == 1
    headers = _json.loads(raw_messages[0])["headers"]
    assert (
        headers["id"],
        headers["task"],
        headers["eta"],
        headers["countdown"] if "countdown" in headers else None,
    ) == (scoped(agent.id, "req-1:count:1"), "keel.run_job", None, None)
    assert job_row(db, scoped(agent.id, "req-1:count:2"))["status"] == "pending"  # type: ignore[index]


def test_a_result_that_cannot_be_recorded_fails_the_job_instead_of_rerunning_it(client: Client, db: Database) -> None:
    agent = client.create_agent("a", budget_tokens=1500)
    client.submit(agent.id, "req-1", None, operation="bad")
    calls: list[int] = []

    def bad(ctx: JobContext) -> JobResult:
        calls.append(ctx.attempt)
        return JobResult(output={"when": datetime.now(UTC)}, usage=Usage(1000), event=Event.FINISH)  # not JSON

    outcome = runner(db, {"bad": bad}).run(scoped(agent.id, "req-1:bad:1"))
    assert outcome.status == "failed" and calls == [1]
    row = job_row(db, scoped(agent.id, "req-1:bad:1"))
    assert row is not None and row["error_class"] == "invalid" and "could not be recorded" in row["last_error"]
    assert client.get_state(agent.id).phase == "failed"


def test_a_job_whose_workers_keep_dying_is_dead_at_the_unknown_cap(client: Client, db: Database) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="crash")
    calls: list[int] = []
    cap = DEFAULT_RULES[ErrorClass.UNKNOWN].max_attempts
    for _ in range(cap):  # each time the worker "dies" mid-run and the dispatcher recovers the job
        claim(db, scoped(agent.id, "req-1:crash:1"), "doomed", timedelta(seconds=30))
        expire_lease(db, scoped(agent.id, "req-1:crash:1"))
        with db.transaction() as cur:
            assert [d.key for d in take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)] == [
                scoped(agent.id, "req-1:crash:1")
            ]
    outcome = runner(db, {"crash": lambda ctx: calls.append(1) or JobResult()}).run(scoped(agent.id, "req-1:crash:1"))  # type: ignore[func-returns-value]
    assert (outcome.status, calls) == ("dead", [])
    row = job_row(db, scoped(agent.id, "req-1:crash:1"))
    assert row is not None and row["error_attempts"] == {"unknown": cap}
    assert client.journal(agent_id=agent.id)[-1].decision == "unknown_cap_reached"


def test_a_claim_waits_for_a_transition_that_stops_the_agent(client: Client, db: Database) -> None:
    """A delivery arriving while a cancel holds the agent's lock waits for it, then finds the job cancelled."""
    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="work")
    locked, claim_started = threading.Event(), threading.Event()
    calls: list[str] = []
    results: list[Any] = []

    def slow_cancel(cur: psycopg.Cursor[Any], before: Any, after: Any) -> None:
        locked.set()
        claim_started.wait(10)
        time.sleep(0.5)  # the claim is now waiting on the agent's lock

    canceller = threading.Thread(
        target=lambda: transition(db, Command(agent.id, Event.CANCEL, "op"), effects=slow_cancel)
    )
    canceller.start()
    locked.wait(10)
    work = runner(db, {"work": lambda ctx: calls.append(ctx.key) or finish(ctx)})  # type: ignore[func-returns-value]
    claimer = threading.Thread(
        target=lambda: (claim_started.set(), results.append(work.run(scoped(agent.id, "req-1:work:1"))))
    )
    claimer.start()
    canceller.join(10)
    claimer.join(10)
    assert calls == [], "the handler ran for an agent that had been stopped"
    assert results[0].status == "suppressed"
    assert job_row(db, scoped(agent.id, "req-1:work:1"))["status"] == "cancelled"  # type: ignore[index]


def test_spend_of_a_fenced_off_outcome_is_still_charged(client: Client, db: Database) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "req-1", None, operation="slow")
    started, release = threading.Event(), threading.Event()

    def slow(ctx: JobContext) -> JobResult:
        started.set()
        release.wait(10)
        return JobResult(usage=Usage(250, Decimal("0.25")), event=Event.FINISH)

    results: list[Any] = []
    thread = threading.Thread(
        target=lambda: results.append(runner(db, {"slow": slow}).run(scoped(agent.id, "req-1:slow:1")))
    )
    thread.start()
    started.wait(10)
    client.cancel(agent.id, actor="op")
    release.set()
    thread.join(10)
    assert results[0].status == "fenced"
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens, state.spent_cost) == ("failed", 250, Decimal("0.25"))
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.kind, last.event, last.decision) == ("transition", "charge", "fenced_off")
    kinds = [e.kind for e in client.journal(agent_id=agent.id)]
    assert "rejected" not in kinds, "a fenced-off outcome is journaled as such, not as a rejected move"


def test_one_failing_schedule_does_not_stop_the_others(client: Client, db: Database) -> None:
    a, b = client.create_agent("a"), client.create_agent("b")
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    schedules.ensure_schedule(db, "busy", a.id, every=timedelta(minutes=1), operation="count", now=t0)
    schedules.ensure_schedule(db, "fine", b.id, every=timedelta(minutes=1), operation="count", now=t0)
    client.submit(a.id, "already-busy", None, operation="count")  # a is busy: its fire is skipped, not fatal
    fired = schedules.fire_due(db, t0 + timedelta(minutes=2))
    assert fired == ["fine.20260101T000100Z"]
    with psycopg.connect(db.libpq_url) as conn:
        outcomes = dict(conn.execute("SELECT name, last_outcome FROM schedules").fetchall())
    assert outcomes["busy"].startswith("busy.20260101T000100Z: skipped")
    with pytest.raises(InvalidInput, match="at most 100"):
        schedules.ensure_schedule(db, "x" * 101, a.id, every=timedelta(minutes=1))


def test_an_archived_agents_schedule_moves_on_without_a_journaled_refusal(client: Client, db: Database) -> None:
    agent = client.create_agent("retired-bot")
    t0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    schedules.ensure_schedule(db, "nightly", agent.id, every=timedelta(minutes=5), operation="count", now=t0)
    before = len(client.journal(agent_id=agent.id))
    client.archive(agent.id, actor="ops")
    assert schedules.fire_due(db, t0 + timedelta(minutes=6)) == []
    events = client.journal(agent_id=agent.id)
    assert [e.event for e in events[before:]] == ["archive"], "the skipped fire is not journaled"
    with psycopg.connect(db.libpq_url) as conn:
        row = conn.execute("SELECT next_fire_at, last_outcome FROM schedules").fetchone()
    assert row is not None and row[0] == t0 + timedelta(minutes=10), "it moved on"
    assert "archived" in str(row[1])
    client.unarchive(agent.id, actor="ops")
    assert schedules.fire_due(db, t0 + timedelta(minutes=11)) == ["nightly.20260101T121000Z"]


def test_a_schedules_input_is_checked_against_its_operations_model(client: Client, db: Database) -> None:
    import agents.runtime.loop  # noqa: F401 - registers plan and its input model

    agent = client.create_agent("a")
    with pytest.raises(InvalidInput, match=r"input of operation 'plan': input\.prompt"):
        schedules.ensure_schedule(db, "s", agent.id, every=timedelta(minutes=5), input={"promt": "typo"})
    with psycopg.connect(db.libpq_url) as conn:
        assert conn.execute("SELECT count(*) FROM schedules").fetchone() == (0,), "nothing was written"


@pytest.mark.parametrize("operation", ["tool", "gate"])
def test_the_runtimes_own_steps_cannot_start_a_request(client: Client, operation: str) -> None:
    import agents.runtime.loop  # noqa: F401 - registers them

    agent = client.create_agent("a")
    with pytest.raises(InvalidInput, match=f"operation '{operation}' is one the runtime schedules itself"):
        client.submit(agent.id, "r1", {"tool": "slack_post"}, operation=operation)
    assert client.get_state(agent.id).revision == 0

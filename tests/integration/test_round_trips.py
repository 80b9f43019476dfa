"""Round trips of the hot path, counted on the wire (libpq's protocol trace): a transition is its lock, then its
writes with their commit and its wake-up; a lost update is still refused, now by the commit itself, and announces
nothing."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg import pq
from sqlalchemy import event

import tests.support.handlers  # noqa: F401 - registers `noop`, which submits are checked against
from agents.client import Client
from agents.core.commands import Command, JobOutcome, Usage
from agents.core.errors import FencedOff, LostUpdate
from agents.core.phases import Event
from agents.core.policies import DEFAULT_RULES
from agents.core.transition import transition
from agents.jobs.handlers import JobResult, Registry
from agents.jobs.runner import Runner
from models.db import Database, pipeline_begun
from models.jobs_sql import ClaimedJob, claim, job_row
from tests.support.audit import TEST_KEYS
from tests.support.db import expire_lease
from tests.support.keys import scoped

pytestmark = pytest.mark.integration


@contextmanager
def wire(db: Database) -> Iterator[list[str]]:
    """The protocol messages of every connection ``db`` hands out while the block runs (a pool of one, traced)."""
    messages: list[str] = []
    traced: list[tuple[psycopg.Connection[Any], Any]] = []

    def trace(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        out = tempfile.TemporaryFile("w+")
        dbapi_connection.pgconn.trace(out.fileno())
        dbapi_connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        traced.append((dbapi_connection, out))

    event.listen(db.engine, "checkout", trace)
    try:
        yield messages
    finally:
        event.remove(db.engine, "checkout", trace)
        for conn, out in traced:
            conn.pgconn.untrace()
            out.seek(0)
            messages += [line.split("\t")[2] for line in out.read().splitlines() if line.count("\t") >= 2]
            out.close()


def round_trips(messages: list[str]) -> int:
    """Each wait for the server ends at its ReadyForQuery (a simple query's, or a pipeline's Sync)."""
    return messages.count("ReadyForQuery")


@contextmanager
def listening(db: Database) -> Iterator[Any]:
    """LISTEN on the journal's channel; ``heard(timeout)`` returns the payloads that arrived within ``timeout``."""
    from models.sql import JOURNAL_CHANNEL

    with db.session(autocommit=True) as conn:
        conn.execute(f"LISTEN {JOURNAL_CHANNEL}")

        def heard(timeout: float) -> list[str]:
            return [n.payload for n in conn.notifies(timeout=timeout)]

        yield heard


@pytest.fixture
def one(db_url: str) -> Iterator[Database]:
    database = Database(db_url, pool_size=1, audit_keys=TEST_KEYS)
    yield database
    database.dispose()


def test_a_transition_is_its_lock_then_its_writes_with_their_commit_and_its_wake_up(one: Database) -> None:
    client = Client(one)
    agent = client.create_agent("trips")
    client.submit(agent.id, "req-1", {"prompt": "hi"})
    with wire(one) as messages:
        transition(one, Command(agent.id, Event.PLAN, "worker"))
    # BEGIN, the lock and the read after it; the journal event, the row, COMMIT and the NOTIFY.
    assert round_trips(messages) == 2, messages
    assert "Query" not in messages  # no BEGIN nor COMMIT of psycopg's own, each a round trip
    assert client.get_state(agent.id).phase == "executing"


def test_a_submit_claims_its_request_in_the_locks_round_trip(one: Database) -> None:
    """A submit is its lock with the request's claim, its job's insert, and its writes with their commit and wake-up;
    a cancel is its lock, the sweep of its jobs, and the same last round trip."""
    client = Client(one)
    agent = client.create_agent("submit-trips")
    with wire(one) as messages:
        state = client.submit(agent.id, "req-1", {"prompt": "hi"})
    assert round_trips(messages) == 3, messages
    assert "Query" not in messages
    assert [job.key for job in state.pending_jobs] == [scoped(agent.id, "req-1:plan:1")]
    (record,) = [r for r in client.journal(agent_id=agent.id) if r.event == "submit"]
    assert client.get_request(agent.id, "req-1").submitted_at == record.at  # the request's time is the transition's
    with wire(one) as messages:
        assert client.cancel(agent.id, actor="alice").phase == "failed"
    assert round_trips(messages) == 3, messages
    # A retry of the request the agent is on claims nothing and is answered as before: suppressed, journaled so.
    assert client.submit(agent.id, "req-1", {"prompt": "hi"}).phase == "failed"
    events = [(e.kind, e.event) for e in client.journal(agent_id=agent.id)]
    assert events[1:] == [("transition", "submit"), ("transition", "cancel"), ("suppressed", "submit")]
    assert client.get_request(agent.id, "req-1").submitted_at == record.at


@pytest.mark.parametrize(
    ("repeatable", "usage", "trips"),
    [(True, Usage(), 3), (True, Usage(120, Decimal("0.01")), 4), (False, Usage(), 4)],
    ids=[
        "repeatable and free: the claim and the transition",
        "paid: the claim, the staged outcome and the transition",
        "not said repeatable: staged",
    ],
)
def test_a_jobs_run_is_its_claim_a_staged_outcome_unless_repeatable_and_free_and_a_two_round_trip_transition(
    one: Database, repeatable: bool, usage: Usage, trips: int
) -> None:
    """A request of one job (``submit(..., operation=...)``, as the benchmarks' no-op), run to its end. Its outcome is
    staged (a round trip and a commit of its own) unless its handler said it may run twice and it spent nothing."""
    client = Client(one)
    agent = client.create_agent("job-trips")
    client.submit(agent.id, "req-1", None, operation="noop")
    registry = Registry()
    registry.register("noop", lambda ctx: JobResult(event=Event.FINISH, usage=usage), repeatable=repeatable)
    runner = Runner(one, registry, worker="w", lease=timedelta(seconds=30), rules=DEFAULT_RULES)
    (key,) = [job.key for job in client.get_state(agent.id).pending_jobs]
    with wire(one) as messages:
        outcome = runner.run(key)
    assert outcome.status == "succeeded"
    # The claim; [the staged outcome;] the transition: BEGIN with the lock; the outcome with the journal event, the
    # row (written only under the claim's fencing token), COMMIT and the NOTIFY.
    assert round_trips(messages) == trips, messages
    assert "Query" not in messages
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("done", usage.tokens)


@pytest.mark.parametrize(("threshold", "prepared"), [(5, False), (0, True)], ids=["default", "worker"])
def test_a_workers_statements_are_prepared_at_their_first_run(db_url: str, threshold: int, prepared: bool) -> None:
    """A worker's database prepares each statement the first time a connection runs it (tasks/runtime.py): its
    connections would otherwise run every statement of a job's path unprepared five times, parsed and planned each
    time. Elsewhere psycopg's default stands."""
    one = Database(db_url, pool_size=1, audit_keys=TEST_KEYS, prepare_threshold=threshold)
    try:
        client = Client(one)
        agent = client.create_agent("prepared")
        client.submit(agent.id, "req-1", None, operation="noop")
        registry = Registry()
        registry.register("noop", lambda ctx: JobResult(event=Event.FINISH))
        runner = Runner(one, registry, worker="w", lease=timedelta(seconds=30), rules=DEFAULT_RULES)
        (key,) = [job.key for job in client.get_state(agent.id).pending_jobs]
        assert runner.run(key).status == "succeeded"
        runner.leases.db.dispose()
        with one.connection() as conn:  # the pool's one connection: the one the job ran on
            names = [row[0] for row in conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()]
            conn.rollback()
        claimed = any("nextval('job_fencing_token_seq')" in name for name in names)
        finished = any(name.startswith("WITH fin AS") for name in names)
        assert (claimed and finished) is prepared, names
    finally:
        one.dispose()


def test_an_outcome_written_with_the_row_is_refused_whole_once_its_claim_was_taken_over(db: Database) -> None:
    """A finish carrying a claim that was taken over (its lease ran out, another worker claimed the job), while the
    agent still accepts the finish: the statement that writes the outcome with the row writes neither, the commit is
    refused, and the writer learns FencedOff — not a lost update. The live claim's finish is the one recorded."""
    client = Client(db)
    agent = client.create_agent("taken-over")
    client.submit(agent.id, "req-1", None, operation="noop")
    (key,) = [job.key for job in client.get_state(agent.id).pending_jobs]
    first = claim(db, key, "first", timedelta(seconds=30))
    expire_lease(db, key)  # the first worker looks dead: the second takes the job over
    second = claim(db, key, "second", timedelta(seconds=30))
    assert isinstance(first, ClaimedJob) and isinstance(second, ClaimedJob)

    def finish(job: ClaimedJob, who: str) -> Command:
        outcome = JobOutcome(key, job.fencing_token, "succeeded", result={"who": who})
        return Command(agent.id, Event.FINISH, who, outcome=outcome)

    with pytest.raises(FencedOff):
        transition(db, finish(first, "first"))
    state = client.get_state(agent.id)
    assert state.phase == "planning" and [j.status for j in state.pending_jobs] == ["running"]
    assert [e.event for e in client.journal(agent_id=agent.id)] == ["create", "submit"]
    assert transition(db, finish(second, "second")).agent.phase == "done"
    row = job_row(db, key)
    assert row is not None
    assert (row["status"], row["result"], row["worker"]) == ("succeeded", {"who": "second"}, "second")


def test_a_lost_update_is_refused_by_the_commit_and_nothing_of_it_stays(one: Database) -> None:
    """A write to the agent row behind the transition's lock (only a superuser, bypassing the guards, can make
    one): the row's revision no longer matches, the journal event is past the chain's head, the commit is refused,
    and the caller gets LostUpdate. Nothing of the transaction stays, and the pooled connection serves the next."""
    client = Client(one)
    agent = client.create_agent("lost")
    client.submit(agent.id, "req-1", {"prompt": "hi"})
    before = client.get_state(agent.id)

    def behind_the_lock(cur: psycopg.Cursor[Any], _before: Any, _after: Any) -> None:
        cur.execute("SET LOCAL session_replication_role = replica")  # the revision guard off, for this write only
        cur.execute("UPDATE agents SET revision = revision + 10 WHERE id = %s", (agent.id,))
        cur.execute("SET LOCAL session_replication_role = origin")

    with listening(one) as heard:
        with pytest.raises(LostUpdate):
            transition(one, Command(agent.id, Event.PLAN, "worker"), effects=behind_the_lock)
        assert heard(0.5) == []  # the NOTIFY queued after the refused COMMIT was skipped with it
        planned = transition(one, Command(agent.id, Event.PLAN, "worker"))
        assert heard(2.0) == [f"{agent.id}:{planned.agent.journal_seq}"]  # a commit that happened is announced once
    after = client.get_state(agent.id)
    # Nothing of the refused one stays; the connection it ran on went back to the pool and served the next one.
    assert (after.phase, after.revision) == ("executing", before.revision + 1)
    assert [e.event for e in client.journal(agent_id=agent.id)] == ["create", "submit", "plan"]


def test_pipeline_begun_opens_a_real_transaction_in_the_pipelines_round_trip(db_url: str) -> None:
    with psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql")) as conn:
        conn.execute("CREATE TEMP TABLE t (x int)")
        conn.commit()
        with pipeline_begun(conn):
            conn.execute("INSERT INTO t VALUES (1)")
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        assert conn.autocommit is False
        conn.rollback()  # a transaction it was: the insert is undone
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)
        conn.rollback()
        with conn.cursor() as cur, pipeline_begun(conn, cur):  # the BEGIN on the caller's cursor: the same
            cur.execute("INSERT INTO t VALUES (2)")
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        assert conn.autocommit is False
        conn.commit()
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (1,)
        conn.rollback()
        # A statement that fails inside leaves the transaction failed, not committed, and the connection usable.
        with pytest.raises(psycopg.errors.DivisionByZero), pipeline_begun(conn):
            conn.execute("INSERT INTO t VALUES (3)")
            conn.execute("SELECT 1 / 0")
        assert conn.info.transaction_status == pq.TransactionStatus.INERROR and conn.autocommit is False
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (1,)

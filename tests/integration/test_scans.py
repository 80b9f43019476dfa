"""The hot passes cost the batch, not the history (issue 15): each is served by its index on a database seeded with
enough rows for the planner to care, reads about as many rows as it takes, and batching neither skips nor repeats.
The dispatcher under back-pressure is test_dispatch_back_pressure.py; the beat's passes, test_beat_passes.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from agents.client import Client
from agents.core.commands import Command, JobSpec
from agents.core.phases import ACTIVE, Event
from agents.core.transition import now, transition
from agents.jobs.handlers import registry
from models.db import Database
from models.deadlines_sql import START, past_deadline_query
from models.jobs_sql import REQUEST_GATES, REQUEST_STEPS, STEPS_BY_KEY, claim, take_due, take_due_statement
from models.schedules_sql import LOCK_DUE
from models.schedules_sql import START as SCHEDULES_START
from tests.support.db import expire_lease
from tests.support.dispatchers import race_dispatchers
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

for _operation in ("count",):
    registry.declare(_operation)

Raw = psycopg.Connection[Any]


# --- a database with history ---------------------------------------------------------------------------------------

FINISHED_JOBS = 120_000
WAITING_JOBS = 20_000  # enqueued a moment ago, waiting their turn: not due
LATER_JOBS = 20_000  # pending, due in an hour, across every priority
IDLE_AGENTS = 40_000
BUSY_AGENTS = 10_000  # active, deadlines ahead
SCHEDULES = 10_000


def _seed(raw: Raw) -> None:
    """History the passes must not read: finished jobs, a queue's worth of enqueued ones, jobs due later, agents at
    rest and agents whose deadlines are ahead, schedules not due."""
    raw.execute(
        "INSERT INTO agents (name, phase) SELECT 'idle-' || g, 'idle' FROM generate_series(1, %s) g", (IDLE_AGENTS,)
    )
    raw.execute(
        "INSERT INTO agents (name, phase, request_id, soft_deadline, hard_deadline)"
        " SELECT 'busy-' || g, 'planning', 'busy-' || g, now() + interval '1 hour', now() + interval '1 day'"
        " FROM generate_series(1, %s) g",
        (BUSY_AGENTS,),
    )
    (owner,) = raw.execute("SELECT id FROM agents WHERE name = 'idle-1'").fetchone()  # type: ignore[misc]
    common = "agent_id, request_id, operation, target, status, queue, priority, run_at, created_at, updated_at"
    raw.execute(
        f"INSERT INTO jobs (key, {common}, finished_at, result)"
        " SELECT 'old-' || g || ':plan:1', %(owner)s, 'old-' || (g / 4), 'plan', '1', 'succeeded', 'keel.jobs', 5,"
        " now() - interval '1 day', now() - interval '1 day' + g * interval '1 ms', now(), now(),"
        ' \'{"reply": {"role": "assistant", "content": "done"}}\'::jsonb'
        " FROM generate_series(1, %(n)s) g",
        {"owner": owner, "n": FINISHED_JOBS},
    )
    raw.execute(
        f"INSERT INTO jobs (key, {common}, enqueued_at)"
        " SELECT 'wait-' || g || ':count:1', %(owner)s, 'wait-' || g, 'count', '1', 'enqueued', 'keel.jobs', 5,"
        " now() - interval '1 minute', now(), now(), now() FROM generate_series(1, %(n)s) g",
        {"owner": owner, "n": WAITING_JOBS},
    )
    raw.execute(
        f"INSERT INTO jobs (key, {common})"
        " SELECT 'later-' || g || ':count:1', %(owner)s, 'later-' || g, 'count', '1', 'pending', 'keel.jobs', g %% 10,"
        " now() + interval '1 hour', now(), now() FROM generate_series(1, %(n)s) g",
        {"owner": owner, "n": LATER_JOBS},
    )
    raw.execute(
        "INSERT INTO schedules (name, agent_id, every_seconds, operation, input, next_fire_at)"
        " SELECT 'sched-' || g, %(owner)s, 3600, 'count', 'null', now() + interval '1 hour'"
        " FROM generate_series(1, %(n)s) g",
        {"owner": owner, "n": SCHEDULES},
    )
    for table in ("agents", "jobs", "schedules"):
        raw.execute(f"ANALYZE {table}")


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _explain(raw: Raw, query: str | sql.Composable, params: dict[str, Any], *, analyze: bool = False) -> Any:
    options = "ANALYZE, FORMAT JSON" if analyze else "FORMAT JSON"
    statement = sql.SQL("EXPLAIN ({}) ").format(sql.SQL(options)) + (
        sql.SQL(query) if isinstance(query, str) else query  # type: ignore[arg-type]
    )
    try:
        row = raw.execute(statement, params).fetchone()
    finally:
        raw.rollback()  # EXPLAIN ANALYZE of an UPDATE runs it: nothing of it stays
    assert row is not None
    return row[0][0]["Plan"]


def _served(plan: dict[str, Any], table: str) -> set[str]:
    """The indexes ``plan`` reads ``table`` through; fails if it reads the table whole."""
    nodes = list(_nodes(plan))
    seq = [n for n in nodes if n["Node Type"].endswith("Seq Scan") and n.get("Relation Name") == table]  # parallel too
    assert not seq, f"{table} is read whole: {json.dumps(plan)[:2000]}"
    return {n["Index Name"] for n in nodes if "Index Name" in n}


def _rows_read(plan: dict[str, Any], table: str) -> int:
    """How many rows of ``table`` (or of its indexes) the executed plan looked at, kept or filtered out."""
    read = 0
    for n in _nodes(plan):
        if n.get("Relation Name") == table or n["Node Type"] == "Bitmap Index Scan":
            kept = (
                n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0) + n.get("Rows Removed by Index Recheck", 0)
            )
            read += int(kept * n.get("Actual Loops", 1))
    return read


@pytest.fixture
def seeded(db: Database) -> Iterator[Raw]:
    with psycopg.connect(db.libpq_url) as raw:
        _seed(raw)
        raw.commit()
        yield raw


def test_the_dispatcher_reads_its_batch_through_one_index_per_case_not_the_backlog(
    client: Client, db: Database, seeded: Raw
) -> None:
    due_keys = []
    for n in range(3):
        agent = client.create_agent(f"due-{n}")
        client.submit(agent.id, f"due-{n}", None, operation="count")
        due_keys.append(scoped(agent.id, f"due-{n}:count:1"))
    claim(db, due_keys[0], "dead", timedelta(seconds=1))
    expire_lease(db, due_keys[0])  # a worker died: recovered
    seeded.execute("UPDATE jobs SET enqueued_at = now() - interval '1 hour' WHERE key = 'wait-1:count:1'")
    seeded.commit()  # (one message the broker lost)
    statement = take_due_statement(timedelta(minutes=5), 50)
    used = _served(_explain(seeded, statement, {}), "jobs")
    assert {"ix_jobs_pending", "ix_jobs_enqueued", "ix_jobs_leased"} <= used, used
    read = _rows_read(_explain(seeded, statement, {}, analyze=True), "jobs")
    # The batch (4 due), each looked at a few times (candidates, the lock, the update) — not the 20,000 enqueued
    # rows waiting their turn, nor the 20,000 due later, nor the 120,000 finished.
    assert read < 100, read
    # keel.jobs held back (full on the broker): the low queue's cases alone, none of keel.jobs' rows read.
    held = _explain(seeded, take_due_statement(timedelta(minutes=5), 50, ("keel.jobs.low",)), {}, analyze=True)
    assert _rows_read(held, "jobs") == 0, json.dumps(held)[:2000]
    with db.transaction() as cur:
        due = take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=50)
    assert sorted((d.key, d.recovered) for d in due) == sorted(
        [
            (due_keys[0], True),
            (due_keys[1], False),
            (due_keys[2], False),
            ("wait-1:count:1", True),
        ]
    )


def test_a_plan_step_and_a_waiting_agents_view_read_by_key_and_through_the_request_index(seeded: Raw) -> None:
    (owner,) = seeded.execute("SELECT id FROM agents WHERE name = 'idle-1'").fetchone()  # type: ignore[misc]
    seeded.rollback()
    keys = {"keys": ["old-400:plan:1", "old-401:plan:1"], "request_id": "old-100", "agent_id": owner}
    assert _served(_explain(seeded, STEPS_BY_KEY, keys), "jobs") & {"pk_jobs", "ix_jobs_request"}
    assert _rows_read(_explain(seeded, STEPS_BY_KEY, keys, analyze=True), "jobs") <= 4
    whole = {"request_id": "old-100", "agent_id": owner}
    assert "ix_jobs_request" in _served(_explain(seeded, REQUEST_STEPS, whole), "jobs")
    assert _rows_read(_explain(seeded, REQUEST_STEPS, whole, analyze=True), "jobs") <= 8
    # A waiting agent's view (and every approve or reject) reads the request's gates, then what answered them by key.
    assert _served(_explain(seeded, REQUEST_GATES, whole), "jobs") & {"ix_jobs_gates", "ix_jobs_request"}
    assert _rows_read(_explain(seeded, REQUEST_GATES, whole, analyze=True), "jobs") <= 8


def test_the_deadline_pass_reads_the_agents_past_a_deadline_not_every_agent(client: Client, seeded: Raw) -> None:
    late = client.create_agent("late")
    client.submit(late.id, "req-late", None, operation="count", hard_deadline=timedelta(seconds=60))
    at = now() + timedelta(seconds=61)
    phases = [p.value for p in ACTIVE]
    for hard, index in ((True, "ix_agents_hard_deadline"), (False, "ix_agents_soft_deadline")):
        query = past_deadline_query(phases, hard=hard)
        params = {"at": at, "after_deadline": START[0], "after_id": START[1], "limit": 200}
        assert index in _served(_explain(seeded, query, params), "agents")
        assert _rows_read(_explain(seeded, query, params, analyze=True), "agents") <= 2


def test_the_schedule_pass_reads_the_due_schedules_not_every_schedule(seeded: Raw) -> None:
    params = {"at": now(), "limit": 100, "after_at": SCHEDULES_START[0], "after_name": SCHEDULES_START[1]}
    assert "ix_schedules_due" in _served(_explain(seeded, LOCK_DUE, params), "schedules")
    assert _rows_read(_explain(seeded, LOCK_DUE, params, analyze=True), "schedules") == 0


# --- batching neither skips nor repeats ----------------------------------------------------------------------------


def _due_of_every_kind(client: Client, db: Database, n: int) -> set[str]:
    """``n`` jobs of each case: new ones across priorities, lost messages, expired leases."""
    keys = set()
    for i in range(n):
        for kind in ("new", "lost", "dead"):
            agent = client.create_agent(f"{kind}-{i}")
            client.submit(agent.id, f"{kind}-{i}", None, operation="count")
            keys.add(scoped(agent.id, f"{kind}-{i}:count:1"))
            if kind == "dead":
                claim(db, scoped(agent.id, f"{kind}-{i}:count:1"), "dead", timedelta(seconds=1))
                expire_lease(db, scoped(agent.id, f"{kind}-{i}:count:1"))
            else:
                # The submit's job, at another priority: the dispatcher's order is priority first.
                spec = JobSpec("count", "2", priority=i % 10)
                transition(db, Command(agent.id, Event.PROGRESS, "w", jobs=(spec,)))
                keys.add(scoped(agent.id, f"{kind}-{i}:count:2"))
    with psycopg.connect(db.libpq_url, autocommit=True) as raw:
        raw.execute(
            "UPDATE jobs SET status = 'enqueued', enqueued_at = now() - interval '1 hour'"
            " WHERE request_id LIKE 'lost-%'"
        )
    return keys


def test_four_dispatchers_in_small_batches_take_every_due_job_once(client: Client, db: Database) -> None:
    keys = _due_of_every_kind(client, db, 12)
    taken = race_dispatchers(db)
    assert len(taken) == len(set(taken)), "a job taken twice"
    assert set(taken) == keys, "a due job left behind"


def test_a_batch_is_the_highest_priorities_due(client: Client, db: Database) -> None:
    agent = client.create_agent("prio")
    client.submit(agent.id, "req-1", None, operation="count")
    specs = tuple(JobSpec("count", f"p{p}", priority=p) for p in (0, 9, 3, 7))
    transition(db, Command(agent.id, Event.PROGRESS, "w", jobs=specs))
    with db.transaction() as cur:
        first = take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=2)
    assert sorted(d.key for d in first) == [scoped(agent.id, "req-1:count:p7"), scoped(agent.id, "req-1:count:p9")]

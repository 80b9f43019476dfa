"""The hot passes cost the batch, not the history (issue 15): each is served by its index on a database seeded with
enough rows for the planner to care, reads about as many rows as it takes, and batching neither skips nor repeats:
two dispatchers racing, a dispatcher killed between publishing and committing, deadlines and schedules a batch at a
time, the beat's passes on their own threads."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg import sql

from agents.client import Client
from agents.core import transition as core
from agents.core.commands import Command, JobSpec
from agents.core.errors import StoreError
from agents.core.phases import ACTIVE, Event
from agents.core.transition import now, transition
from agents.jobs import deadlines, schedules
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from agents.runtime import loop
from agents.runtime.inference import ScriptedProvider
from agents.runtime.loop import conversation, rebuild_conversation
from models.db import Database
from models.deadlines_sql import START, past_deadline_query
from models.jobs_sql import REQUEST_GATES, REQUEST_STEPS, STEPS_BY_KEY, ClaimedJob, claim, take_due, take_due_statement
from models.schedules_sql import LOCK_DUE
from models.schedules_sql import START as SCHEDULES_START
from models.settings import Settings
from tests.support.broker import Broker
from tests.support.db import expire_lease
from tests.support.dispatchers import race_dispatchers
from tests.support.keys import scoped
from tests.support.runs import FAST_RULES, run_all

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


def _messages(broker: Broker, queue: str = "keel.jobs") -> list[str]:
    with broker.redis() as redis:
        raw = redis.lrange(broker.key(queue), 0, -1)
    return [json.loads(m)["headers"]["id"] for m in raw]


def test_a_dispatcher_killed_between_publishing_and_committing_leaves_one_claim_per_job(
    client: Client, db: Database, db_url: str, broker: Broker
) -> None:
    """SIGKILL after the first batch reached Redis and before its transaction committed: the rows are still due, the
    next pass publishes them again, and the duplicate message finds its job claimed (run once per key)."""
    from tasks.app import make_app
    from tasks.dispatcher import dispatch_once

    ks = []
    for n in range(7):
        agent = client.create_agent(f"k{n}")
        client.submit(agent.id, f"k{n}", None, operation="count")
        ks.append(scoped(agent.id, f"k{n}:count:1"))
    killer = textwrap.dedent(
        """
        import os, signal
        import tasks.dispatcher as d
        from models.db import Database
        from models.settings import Settings
        from tasks.app import make_app, publish

        def publish_then_die(due, celery, **kw):
            publish(due, celery, **kw)
            os.kill(os.getpid(), signal.SIGKILL)

        d.publish = publish_then_die
        settings = Settings(dispatch_batch=3)
        d.dispatch_once(Database.from_settings(settings), make_app(settings), settings)
        """
    )
    env = {**os.environ, "KEEL_DATABASE_URL": db_url, **broker.env}
    done = subprocess.run([sys.executable, "-c", killer], env=env, capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    first = _messages(broker)
    assert len(first) == 3
    with psycopg.connect(db.libpq_url) as raw:
        (pending,) = raw.execute("SELECT count(*) FROM jobs WHERE status = 'pending'").fetchone()  # type: ignore[misc]
    assert pending == 7, "the killed pass committed nothing"
    settings = broker.settings(database_url=db_url, dispatch_batch=3)
    celery = make_app(settings)
    try:
        assert dispatch_once(db, celery, settings).published == 7
    finally:
        celery.close()
    messages = _messages(broker)
    assert len(messages) == 10 and set(messages) == set(ks)
    claims = [claim(db, key, "w", timedelta(seconds=30)) for key in messages]
    claimed = [c.key for c in claims if isinstance(c, ClaimedJob)]
    assert sorted(claimed) == sorted(set(messages)), "each job claimed exactly once; the copies are suppressed"


def test_back_pressure_caps_a_tick_and_waits_for_a_full_queue(client: Client, db: Database, broker: Broker) -> None:
    from tasks.app import make_app
    from tasks.dispatcher import dispatch_once

    for n in range(5):
        b = client.create_agent(f"b{n}")
        client.submit(b.id, f"b{n}", None, operation="count")
    settings = broker.settings(database_url=db.url, dispatch_max_per_tick=2, dispatch_max_queue_depth=4)
    celery = make_app(settings)
    try:
        capped = dispatch_once(db, celery, settings)
        assert (capped.published, capped.held) == (2, "per-tick cap")
        assert dispatch_once(db, celery, settings).published == 2
        assert len(_messages(broker)) == 4
        held = dispatch_once(db, celery, settings)  # the queue holds 4: nothing more until workers take some
        assert (held.published, held.held) == (0, "queue keel.jobs: 4")
        with psycopg.connect(db.libpq_url) as raw:
            (status,) = raw.execute(  # type: ignore[misc]
                "SELECT status FROM jobs WHERE key = %s", (scoped(b.id, "b4:count:1"),)
            ).fetchone()
        assert status == "pending", "a held job waits in PostgreSQL, still due"
        with broker.redis() as redis:
            redis.lpop(broker.key("keel.jobs"))  # a worker took one
        drained = dispatch_once(db, celery, settings)
        assert (drained.published, drained.held) == (1, None)
    finally:
        celery.close()


def _row_versions(db: Database, keys: list[str]) -> list[tuple[str, str]]:
    """The rows' (ctid, xmax): a transaction that locks or updates a row (even one rolled back) leaves its id in
    xmax, an update a new version."""
    with psycopg.connect(db.libpq_url) as raw:
        rows = raw.execute("SELECT ctid::text, xmax::text FROM jobs WHERE key = ANY(%s) ORDER BY key", (keys,))
        return [(ctid, xmax) for ctid, xmax in rows.fetchall()]


def test_a_full_queue_holds_back_its_own_jobs_only_and_they_are_not_even_read(
    client: Client, db: Database, broker: Broker
) -> None:
    """Back-pressure is per queue and asked before the batch is taken: a full ``keel.jobs.low`` leaves the normal
    queue's jobs (its recoveries too) to be published, and its own due jobs are not locked, updated or rolled back
    (a held tick used to update up to a batch of rows and roll them back, every tick)."""
    from tasks.app import make_app
    from tasks.dispatcher import dispatch_once

    qs = []
    for n in range(6):
        agent = client.create_agent(f"q{n}")
        client.submit(agent.id, f"q{n}", None, operation="count")
        qs.append(scoped(agent.id, f"q{n}:count:1"))
    low, normal = qs[:3], qs[3:]
    with psycopg.connect(db.libpq_url) as raw:
        raw.execute("UPDATE jobs SET queue = 'keel.jobs.low' WHERE key = ANY(%s)", (low,))
    claim(db, normal[0], "dead", timedelta(seconds=1))
    expire_lease(db, normal[0])  # a worker died: its recovery goes to the normal queue, which has room
    before = _row_versions(db, low)
    assert len(before) == 3
    with broker.redis() as redis:
        redis.rpush(broker.key("keel.jobs.low"), *[b"x"] * 3)
    settings = broker.settings(database_url=db.url, dispatch_max_queue_depth=3)
    celery = make_app(settings)
    try:
        report = dispatch_once(db, celery, settings)
        assert (report.published, report.recovered, report.held) == (3, 1, "queue keel.jobs.low: 3")
        assert sorted(_messages(broker)) == sorted(normal)
        assert _row_versions(db, low) == before, "the held queue's jobs were locked or updated"
        with broker.redis() as redis:
            redis.rpush(broker.key("keel.jobs"), *[b"x"] * 3)
        both = dispatch_once(db, celery, settings)
        # keel.jobs is full too, but none of its jobs is due: only the low queue holds anything back.
        assert (both.published, both.held) == (0, "queue keel.jobs.low: 3")
        assert _row_versions(db, low) == before
        with broker.redis() as redis:
            redis.ltrim(broker.key("keel.jobs.low"), 3, -1)  # a worker took them
        drained = dispatch_once(db, celery, settings)
        assert (drained.published, drained.held) == (3, None)
        assert sorted(_messages(broker, "keel.jobs.low")) == sorted(low)
    finally:
        celery.close()


def _seed_due(db: Database, client: Client, n: int) -> None:
    with psycopg.connect(db.libpq_url) as raw:
        owner = client.create_agent("slow").id
        raw.execute(
            "INSERT INTO jobs (key, agent_id, request_id, operation, target, queue, priority, status, payload,"
            " run_at, created_at, updated_at)"
            " SELECT 'slow-' || n || ':count:1', %s, 'slow-' || n, 'count', '1', 'keel.jobs', 5, 'pending', 'null',"
            " now(), now(), now() FROM generate_series(1, %s) n",
            (owner, n),
        )


def _pending(db: Database) -> int:
    with psycopg.connect(db.libpq_url) as raw:
        (pending,) = raw.execute("SELECT count(*) FROM jobs WHERE status = 'pending'").fetchone()  # type: ignore[misc]
    return int(pending)


def test_a_tick_behind_a_broker_turned_slow_stops_at_its_time_budget_within_a_publish(
    client: Client, db: Database, broker: Broker
) -> None:
    """Every reply of Redis 20 ms late, while the pace the beat remembers is a fast broker's (0.5 ms a publish): a
    batch of 500 would take ten seconds, past a 5 s lease. The publish stops at the deadline, within about one
    publish of it, and its batch is rolled back (its jobs stay due; what went out is a copy the claim suppresses);
    the next tick, at the pace it measured, publishes batches that fit."""
    from tasks.app import make_app
    from tasks.dispatcher import Pace, dispatch_once
    from tests.support.proxy import redis_behind

    _seed_due(db, client, 400)
    proxy, url = redis_behind(broker.url, delay=0.02)
    settings = Settings(broker_url=url, broker_prefix=broker.prefix, database_url=db.url)
    celery = make_app(settings)
    pace = Pace()
    pace.seconds_per_publish = 0.0005  # what a fast broker took, a moment ago
    try:
        started = time.monotonic()
        report = dispatch_once(db, celery, settings, deadline=started + 1.0, pace=pace)
        late = time.monotonic() - (started + 1.0)
        assert (report.published, report.held) == (0, "time budget"), report
        assert late < 0.3, f"{late:.2f}s past the deadline: more than a publish"
        assert _pending(db) == 400, "the batch that ran into the deadline was rolled back: every job still due"
        assert pace.seconds_per_publish >= 0.01, "the pace it measured on the way"
        started = time.monotonic()
        again = dispatch_once(db, celery, settings, deadline=started + 1.5, pace=pace)
        late = time.monotonic() - (started + 1.5)
        assert 0 < again.published < 400, again
        assert late < 0.3, f"{late:.2f}s past the deadline"
        assert _pending(db) == 400 - again.published, "what was not published is still due"
    finally:
        celery.close()
        proxy.down()


def test_the_leaders_duties_go_on_while_the_broker_is_away(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis cut with nothing due: the dispatcher asks the queues' depths every tick and fails, but the leader's
    heartbeat (and its alerts, audit chores) need the database only and go on every tick; they used to wait out
    the broker's backoff, and the heartbeat grew as old as the outage (KeelNoBeatLeader fires at two minutes)."""
    from tests.support.proxy import redis_behind

    proxy, url = redis_behind(broker.url)
    beat = _leading_scheduler(db_url, broker, monkeypatch, broker_url=url)
    try:
        proxy.down()
        end = time.monotonic() + 6
        while time.monotonic() < end:
            time.sleep(min(max(beat.tick(), 0.01), 1.0))
        assert beat.broker.down, "the broker's outage was noticed"
        with psycopg.connect(beat.db.libpq_url) as raw:
            (age,) = raw.execute(  # type: ignore[misc]
                "SELECT extract(epoch FROM clock_timestamp() - max(last_tick_at))::float8 FROM beat_terms"
            ).fetchone()
        assert age < 2.0, f"the heartbeat is {age:.1f}s old after 6 s without the broker"
    finally:
        beat.close()
        proxy.down()


def test_the_deadline_pass_goes_through_every_batch_past_an_agent_that_fails(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = [client.create_agent(f"late-{n}") for n in range(7)]
    for n, agent in enumerate(agents):
        client.submit(agent.id, f"req-{n}", None, operation="count", hard_deadline=timedelta(seconds=60 + n))
    soft = client.create_agent("soft")
    client.submit(soft.id, "req-soft", None, operation="count", soft_deadline=timedelta(seconds=30))
    broken = agents[1].id  # in the first batch: the batches after it must still be read, and it not read again
    real = core.transition

    def failing(db: Database, command: Command, **kw: Any) -> Any:
        if command.agent_id == broken:
            raise RuntimeError("this agent's move breaks")
        return real(db, command, **kw)

    monkeypatch.setattr(core, "transition", failing)
    report = deadlines.enforce(db, now() + timedelta(seconds=120), batch=2)
    assert report.failed == [broken]
    assert report.stopped == [a.id for a in agents if a.id != broken], "hard deadlines in order, each once"
    assert report.demoted == [soft.id]
    assert client.get_state(broken).phase == "planning"
    assert client.journal(agent_id=broken)[-1].decision == "deadline_enforcement_failed"


def test_schedules_fire_in_batches_each_once_with_two_beats_racing(client: Client, db: Database) -> None:
    agents = [client.create_agent(f"s{n}") for n in range(9)]
    t0 = now()
    for n, agent in enumerate(agents):
        schedules.ensure_schedule(db, f"every-{n}", agent.id, every=timedelta(minutes=1), operation="count", now=t0)
    at = t0 + timedelta(minutes=1, seconds=1)
    fired: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2)

    def beat() -> None:
        barrier.wait()
        got = schedules.fire_due(db, at, batch=2)
        with lock:
            fired.extend(got)

    threads = [threading.Thread(target=beat) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(fired) == sorted(schedules.fire_request_id(f"every-{n}", t0 + timedelta(minutes=1)) for n in range(9))
    assert schedules.fire_due(db, at, batch=2) == [], "moved on: not fired again at the same time"


def test_a_slow_deadline_pass_does_not_hold_up_dispatching(
    client: Client, db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Celery

    from models.settings import Settings
    from tasks.app import celery_config
    from tasks.dispatcher import KeelScheduler

    for name, value in {"KEEL_DATABASE_URL": db_url, **broker.env}.items():
        monkeypatch.setenv(name, value)
    entered, release = threading.Event(), threading.Event()
    real = deadlines.enforce

    def slow(*args: Any, **kw: Any) -> Any:
        entered.set()
        release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(deadlines, "enforce", slow)
    app = Celery("passes-test", set_as_current=False)
    app.conf.update(celery_config(Settings()))
    beat = KeelScheduler(app=app)
    try:
        beat.tick()
        assert entered.wait(30), "the deadline pass started"
        agent = client.create_agent("a")
        client.submit(agent.id, "r-1", None, operation="count")
        beat.tick()  # returns while the deadline pass is still under way, and dispatches
        assert _messages(broker) == [scoped(agent.id, "r-1:count:1")]
        assert beat.passes[1].running()
        beat.tick()
        assert beat.passes[1].running(), "never two deadline passes at once"
    finally:
        release.set()
        for timed in beat.passes:  # (on a loaded machine longer than a closing beat waits)
            timed.join(60)
        beat.close()


def test_a_closing_beat_waits_for_its_passes_once_and_within_one_budget(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery closes a scheduler twice on SIGTERM (its signal handler, then its loop's end): with every pass stuck,
    the two closes together wait CLOSE_WAIT_SECONDS once, not once per pass and close (`keel up`'s stop timeout is
    20 s: 2 closes x 3 passes x 5 s overran it), and the beat's leadership is given up for the next beat."""
    from celery import Celery

    from models.settings import Settings
    from tasks.app import celery_config
    from tasks.dispatcher import CLOSE_WAIT_SECONDS, KeelScheduler

    for name, value in {"KEEL_DATABASE_URL": db_url, **broker.env}.items():
        monkeypatch.setenv(name, value)
    release = threading.Event()
    started = threading.Semaphore(0)

    def stuck() -> None:
        started.release()
        release.wait(120)

    app = Celery("close-test", set_as_current=False)
    app.conf.update(celery_config(Settings()))
    beat = KeelScheduler(app=app)
    joins: list[float] = []
    try:
        for timed in beat.passes:
            monkeypatch.setattr(timed, "_run", stuck)
            real_join = timed.join
            monkeypatch.setattr(timed, "join", lambda t=None, j=real_join: (joins.append(t), j(t))[1])
        beat.tick()
        assert beat.leadership.term is not None, "this beat leads"
        for _ in beat.passes:
            assert started.acquire(timeout=30), "every pass started, and is stuck"
        began = time.monotonic()
        beat.close()
        beat.close()
        waited = time.monotonic() - began
        assert len(joins) == len(beat.passes), f"the second close waited again: {joins}"
        assert sum(joins) <= CLOSE_WAIT_SECONDS + 0.01, joins
        assert waited < 2 * CLOSE_WAIT_SECONDS, f"closing took {waited:.1f}s"
        assert beat.leadership.term is None, "leadership given up"
        assert all(timed.running() for timed in beat.passes), "the stuck passes were left to end with the process"
    finally:
        release.set()
        for timed in beat.passes:
            timed.join(60)


def test_a_closing_beat_waits_for_its_leaders_chores_within_the_same_budget(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's audit verify (shipping, pruning) runs on a thread of its own: a close that did not wait for it
    disposed of the pool under it, and the connection it held was never closed (a ResourceWarning in the tests)."""
    from tasks.leader import LeaderDuties

    ended = threading.Event()
    real = LeaderDuties._verify

    def slow(self: LeaderDuties) -> None:
        time.sleep(1.0)
        real(self)
        ended.set()

    monkeypatch.setattr(LeaderDuties, "_verify", slow)
    beat = _leading_scheduler(db_url, broker, monkeypatch)
    assert "keel-audit-verify" in [t.name for t in beat.duties.chores_under_way()]
    beat.close()
    assert ended.is_set() and not beat.duties.chores_under_way(), "the close waited for the chore"


def _leading_scheduler(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch, *, broker_url: str | None = None
) -> Any:
    """A KeelScheduler on this test's database and broker (reached through ``broker_url`` when given: a proxy)
    that has ticked once and leads."""
    from celery import Celery

    from models.settings import Settings
    from tasks.app import celery_config
    from tasks.dispatcher import KeelScheduler

    env = {"KEEL_DATABASE_URL": db_url, **broker.env}
    if broker_url is not None:
        env["KEEL_BROKER_URL"] = broker_url
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    app = Celery("signal-test", set_as_current=False)
    app.conf.update(celery_config(Settings()))
    beat = KeelScheduler(app=app)
    beat.tick()
    assert beat.leadership.term is not None
    return beat


def test_a_second_stop_signal_during_a_close_does_not_reenter_it(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second SIGTERM while the beat closes (the kernel's parent-death signal beside a supervisor's) ran Celery's
    handler inside the close: the nested close waited for the lease connection the first was using, for ever (a
    SIGKILLed `keel demo` left its beat running). Now the close is not re-entered, and it still gives up the lease."""
    import signal as signals

    beat = _leading_scheduler(db_url, broker, monkeypatch)
    depth: list[int] = []
    inside = [0]
    real_release = beat.leadership.release

    def releasing() -> None:
        inside[0] += 1
        depth.append(inside[0])
        try:
            if len(depth) == 1:  # a second signal arrives in the middle of the close
                os.kill(os.getpid(), signals.SIGTERM)
                time.sleep(0.2)
            real_release()
        finally:
            inside[0] -= 1

    monkeypatch.setattr(beat.leadership, "release", releasing)
    previous = signals.signal(signals.SIGTERM, lambda signum, frame: beat.close())  # as Celery's handler does
    try:
        beat.close()
        assert depth == [1], f"the close was re-entered: {depth}"
        assert beat.leadership.term is None, "the lease was given up"
        assert signals.getsignal(signals.SIGTERM) is not signals.SIG_IGN, "the handler is back after the close"
        beat.close()  # Celery's second close: repeats what is left, waits for nothing
        assert depth == [1, 1]
    finally:
        signals.signal(signals.SIGTERM, previous)


@pytest.mark.timeout(60)
def test_a_stop_signal_inside_a_tick_leaves_the_close_to_the_loops_end(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the tick waits on the lease connection (the database slow to answer): Celery's handler ran the
    close right there, whose release waited for the very connection the interrupted statement held, for ever. Now a
    close asked inside a tick does nothing, the handler's SystemExit ends the tick, and the close at the loop's end
    gives up the lease."""
    import signal as signals

    from models.urls import libpq_url

    beat = _leading_scheduler(db_url, broker, monkeypatch)

    def celery_handler(signum: int, frame: Any) -> None:  # what celery/apps/beat.py installs
        beat.close()
        raise SystemExit()

    previous = signals.signal(signals.SIGTERM, celery_handler)
    blocker = psycopg.connect(libpq_url(db_url))
    timers = [threading.Timer(0.5, os.kill, (os.getpid(), signals.SIGTERM)), threading.Timer(1.5, blocker.rollback)]
    try:
        blocker.execute("SELECT 1 FROM beat_leadership FOR UPDATE")  # the lease's renewal waits for this
        for timer in timers:
            timer.start()
        with pytest.raises(SystemExit):
            beat.tick()  # its renewal waits on the row; the signal comes in the middle of it
        assert beat.leadership.term is not None, "nothing was closed inside the tick"
        beat.close()  # the close at the end of Celery's loop
        assert beat.leadership.term is None and beat.leadership.conn is None
    finally:
        for timer in timers:  # the rollback's timer uses the blocker: never beside its close
            if timer.is_alive():
                timer.join(10)
        signals.signal(signals.SIGTERM, previous)
        blocker.close()


def test_the_beat_sends_no_relay_pass_while_one_still_waits_on_its_queue(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relay passes took longer than the interval (a slow receiver) or every worker was busy: beat kept sending one
    per interval, and they piled up on keel.outbox for as long as it lasted. Now a pass is sent only when none waits
    (no expiry: that would be stamped on beat's clock and checked on the worker's)."""
    beat = _leading_scheduler(db_url, broker, monkeypatch)
    entry = beat.schedule["relay-outbox"]
    queue = broker.key("keel.outbox")
    try:
        with broker.redis() as redis:
            redis.delete(queue)  # whatever the first tick sent: a worker took it
            beat.apply_entry(entry, producer=beat.producer)
            assert redis.llen(queue) == 1, "a pass is sent when none waits"
            for _ in range(3):
                beat.apply_entry(entry, producer=beat.producer)
            assert redis.llen(queue) == 1, "no pass piles up behind one still waiting"
            redis.lpop(queue)  # a relay worker took it
            beat.apply_entry(entry, producer=beat.producer)
            assert redis.llen(queue) == 1, "the next one goes out"
    finally:
        beat.close()


# --- the conversation a plan step reads, and what a request stores of it -------------------------------------------


def _script() -> dict[str, Any]:
    comment = {"repository": "acme/api", "issue": 7, "body": "Fixed"}
    return {
        "prompt": "Deal with the incident",
        "script": [
            {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "looking"}}]},
            {
                "tool_calls": [
                    {"name": "github_comment", "arguments": comment},
                    {"name": "slack_post", "arguments": {"channel": "C1", "text": "commenting"}},
                ]
            },
            {"tool_calls": [{"name": "github_comment", "arguments": comment}]},
            {"content": "Done."},
        ],
    }


def _record_what_the_model_is_sent(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[dict[str, Any]]]:
    """What each plan step sent the model, by round (a retried step must send what its first attempt did); and every
    step must read the stored conversation, never rebuild it from the whole request."""
    sent: dict[int, list[dict[str, Any]]] = {}
    real = ScriptedProvider.complete

    def recording(self: ScriptedProvider, messages: Any, tools: Any, *, attempt: int = 1) -> Any:
        round_ = 1 + sum(1 for m in messages if m.get("role") == "assistant")
        assert sent.setdefault(round_, copy.deepcopy(list(messages))) == list(messages), f"round {round_} retried"
        return real(self, messages, tools, attempt=attempt)

    def no_rebuild(*args: Any) -> Any:
        raise AssertionError("a plan step rebuilt its conversation from the whole request")

    monkeypatch.setattr(ScriptedProvider, "complete", recording)
    monkeypatch.setattr(loop, "rebuild_conversation", no_rebuild)
    return sent


def _request(agent_id: UUID, round_: int, request_id: str = "req-1") -> tuple[UUID, str, str]:
    """The agent, the request and the key of its plan step of ``round_``: what that step's reads are given."""
    return agent_id, request_id, scoped(agent_id, f"{request_id}:plan:{round_}")


def _stored_conversations(db: Database, agent_id: UUID, request_id: str) -> dict[str, int]:
    """How many messages each of an agent's request's finished plan steps stores as its conversation (steps that
    store none left out); every one keeps its reply."""
    with psycopg.connect(db.libpq_url) as raw:
        rows = raw.execute(
            "SELECT key, result FROM jobs WHERE agent_id = %s AND request_id = %s AND operation = 'plan'"
            " AND status = 'succeeded'",
            (agent_id, request_id),
        ).fetchall()
    assert rows and all("reply" in result for _, result in rows), "every plan step keeps its reply"
    return {key: len(result["conversation"]) for key, result in rows if "conversation" in result}


def test_a_request_stores_its_conversation_once_on_its_latest_plan_step(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storage per request grows linearly with its rounds, not with their square; each step still sends the model the
    whole conversation, read from one stored row — also a step retried after a failure."""
    rounds = 12
    step = {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "still looking"}}]}
    entries: list[dict[str, Any]] = [dict(step) for _ in range(rounds)]
    entries[2] = {**step, "error": "transient"}  # round 3 fails once, then is retried
    entries.append({"content": "Done."})
    sent = _record_what_the_model_is_sent(monkeypatch)
    agent = client.create_agent("long-talker")
    client.submit(agent.id, "req-1", {"prompt": "Keep at it", "script": entries})
    run_all(db, limit=100)
    assert client.get_state(agent.id).phase == "done"
    monkeypatch.undo()
    assert sorted(sent) == list(range(1, rounds + 2))
    for n, messages in sent.items():
        assert messages == rebuild_conversation(db, *_request(agent.id, n))[1], f"round {n}"
    assert _stored_conversations(db, agent.id, "req-1") == {
        scoped(agent.id, f"req-1:plan:{rounds + 1}"): 2 + 2 * rounds
    }


def test_a_plan_step_continues_the_stored_conversation_exactly_as_a_rebuild_would(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through an edited approval and a rejection (which supersedes the rest of its round and re-plans: that step
    drops its predecessor's conversation too)."""
    sent = _record_what_the_model_is_sent(monkeypatch)
    agent = client.create_agent("talker")
    client.submit(agent.id, "req-1", _script())
    run_all(db)
    waiting = client.get_state(agent.id)
    edited = {"repository": "acme/api", "issue": 7, "body": "Fixed in 1.2"}
    client.approve(waiting.id, expected_revision=waiting.revision, actor="ann", arguments=edited)
    run_all(db)
    waiting = client.get_state(agent.id)
    client.reject(waiting.id, expected_revision=waiting.revision, actor="bob", reason="enough comments")
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:3"): 7}, (
        "waiting on round 3: its plan step's only"
    )
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    monkeypatch.undo()
    assert sorted(sent) == [1, 2, 3, 4]
    for n, messages in sent.items():
        assert messages == rebuild_conversation(db, *_request(agent.id, n))[1], f"round {n}"
    last = sent[4]
    roles = ["system", "user", "assistant", "tool", "assistant", "tool", "tool", "assistant", "tool"]
    assert [m["role"] for m in last] == roles
    assert last[-1]["content"] == "A person rejected this call: enough comments"
    assert last[5]["content"].startswith("A person edited this call's arguments")
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:4"): 9}
    # A past round's conversation (dropped) and steps stored before plan results carried theirs are rebuilt.
    assert conversation(db, *_request(agent.id, 4)) == (_script(), last)
    with psycopg.connect(db.libpq_url, autocommit=True) as raw:
        raw.execute(
            "UPDATE jobs SET result = result - 'conversation' WHERE agent_id = %s AND request_id = 'req-1'", (agent.id,)
        )
    assert conversation(db, *_request(agent.id, 4)) == (_script(), last)


def test_a_replayed_plan_outcome_drops_its_predecessors_conversation_as_the_first_run_would_have(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plan step 2 staged its outcome, and the transition recording it failed: nothing of it was committed, so step
    1's conversation is still there; the replay commits the whole outcome, the drop with it."""
    slack = {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "x"}}]}
    agent = client.create_agent("replayer")
    client.submit(agent.id, "req-1", {"prompt": "Go", "script": [slack, slack, {"content": "Done."}]})
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=FAST_RULES)
    assert runner.run(scoped(agent.id, "req-1:plan:1")).status == "succeeded"
    assert runner.run(scoped(agent.id, "req-1:tool:slack_post:1.call_0_0")).status == "succeeded"
    real = core.transition

    def failing(db_: Database, command: Any, **kw: Any) -> Any:
        if command.outcome is not None and command.outcome.key == scoped(agent.id, "req-1:plan:2"):
            outage = psycopg.OperationalError("terminating connection due to administrator command")
            raise StoreError("database error: terminating connection due to administrator command") from outage
        return real(db_, command, **kw)

    monkeypatch.setattr(core, "transition", failing)
    with pytest.raises(StoreError):
        runner.run(scoped(agent.id, "req-1:plan:2"))
    monkeypatch.undo()
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:1"): 2}, (
        "the failed transition dropped nothing"
    )
    expire_lease(db, scoped(agent.id, "req-1:plan:2"))
    with db.transaction() as cur:
        assert [d.key for d in take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)] == [
            scoped(agent.id, "req-1:plan:2")
        ]
    assert runner.run(scoped(agent.id, "req-1:plan:2")).status == "succeeded"
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:2"): 4}
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:3"): 6}


def test_a_step_after_an_old_row_without_a_conversation_rebuilds_it_and_stores_its_own(
    client: Client, db: Database
) -> None:
    slack = {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "x"}}]}
    agent = client.create_agent("upgraded")
    client.submit(agent.id, "req-1", {"prompt": "Go", "script": [slack, slack, {"content": "Done."}]})
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=FAST_RULES)
    assert runner.run(scoped(agent.id, "req-1:plan:1")).status == "succeeded"
    with psycopg.connect(db.libpq_url, autocommit=True) as raw:  # as an earlier version stored it
        raw.execute(
            "UPDATE jobs SET result = result - 'conversation' WHERE key = %s", (scoped(agent.id, "req-1:plan:1"),)
        )
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:3"): 6}
    _, last = conversation(db, *_request(agent.id, 3))
    assert last == rebuild_conversation(db, *_request(agent.id, 3))[1] and len(last) == 6

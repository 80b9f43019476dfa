"""The dispatcher under pressure: killed between publishing and committing, capped per tick, held back by a full
queue (its own jobs only, not even read), and stopped at its time budget behind a broker turned slow."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import psycopg
import pytest

from agents.client import Client
from agents.jobs.handlers import registry
from models.db import Database
from models.jobs_sql import ClaimedJob, claim
from models.settings import Settings
from tests.support.broker import Broker
from tests.support.db import expire_lease
from tests.support.dispatchers import published
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

for _operation in ("count",):
    registry.declare(_operation)


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
    first = published(broker)
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
    messages = published(broker)
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
        assert len(published(broker)) == 4
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
        assert sorted(published(broker)) == sorted(normal)
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
        assert sorted(published(broker, "keel.jobs.low")) == sorted(low)
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

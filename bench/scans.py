"""Benchmark: the periodic passes and a plan step's conversation read at a small and a large backlog, in the same
run: a pass whose cost is its batch stays near 1x (``make bench-scans``; :data:`DESCRIPTION`, its ``--help``, says
how it measures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg

from agents.cli.progress import Progress
from agents.core.keys import make_key
from agents.jobs import deadlines, schedules
from agents.runtime.loop import conversation, rebuild_conversation, step_target
from models import migrations
from models.audit_keys import audit_keys_for
from models.db import Database
from models.embedded import database_url_for
from models.jobs_sql import take_due
from models.settings import Settings
from models.urls import libpq_url, with_database

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: the periodic passes and a plan step's conversation read at a small and a large backlog, same run.

Two databases of the same server are seeded (SQL, generate_series) with the same shape at two sizes: N finished jobs
(history), N enqueued jobs waiting their turn (a queue's backlog: not due), N idle agents and N/10 active agents whose
deadlines are ahead, N/10 schedules not due, and one request of ROUNDS plan/tool rounds. Then, on each, medians of
repeated runs of:

- a dispatcher tick's scan (``take_due``: 10 jobs due, taken in a transaction that is rolled back, so each run finds
  them again), beside the scan as it was before 0.x (one range over every live job, the clock compared per row);
- a deadline pass with nothing due (``deadlines.enforce``), beside the scan as it was (every active agent);
- a schedule pass with nothing due (``schedules.fire_due``);
- the conversation a plan step reads for its last round (``conversation``: the previous step's stored one and that
  round's results), beside the rebuild from every step of the request (``rebuild_conversation``, what each step did).

The ratio large/small is what this measures: a pass whose cost is its batch stays near 1x however much history the
tables hold. Run with ``make bench-scans`` (or ``python -m bench.scans --small 1000 --large 100000``). Uses
KEEL_DATABASE_URL's server, else the embedded one; it creates and drops databases of its own.
"""

OUT = Progress()  # live on a terminal, plain lines in a pipe or a file

ROUNDS = 30
REQUEST = "bench-long"

#: The due scan before 0020: one range of ix_jobs_due (run_at) over every live job, compared with the volatile clock
#: row by row, sorted whole.
OLD_TAKE_DUE = (
    "SELECT key, status FROM jobs j"
    " WHERE status IN ('pending', 'enqueued', 'running') AND run_at <= clock_timestamp()"
    "  AND (status = 'pending'"
    "       OR (status = 'running' AND lease_until < clock_timestamp())"
    "       OR (status = 'enqueued' AND enqueued_at < clock_timestamp() - interval '1 hour'))"
    " ORDER BY priority DESC, run_at LIMIT 500 FOR UPDATE SKIP LOCKED"
)
#: The deadline scan before 0020: every active agent.
OLD_DEADLINES = (
    "SELECT a.id, COALESCE(a.hard_deadline <= clock_timestamp(), false) AS hard FROM agents a"
    " WHERE a.phase = ANY(%(phases)s)"
    " AND (a.hard_deadline <= clock_timestamp() OR (a.priority = 'normal' AND a.soft_deadline <= clock_timestamp()))"
    " ORDER BY COALESCE(a.hard_deadline, a.soft_deadline), a.id"
)


def seed(raw: psycopg.Connection[Any], n: int) -> None:
    raw.execute("INSERT INTO agents (name, phase) SELECT 'idle-' || g, 'idle' FROM generate_series(1, %s) g", (n,))
    raw.execute(
        "INSERT INTO agents (name, phase, request_id, soft_deadline, hard_deadline)"
        " SELECT 'busy-' || g, 'planning', 'busy-' || g, now() + interval '1 hour', now() + interval '1 day'"
        " FROM generate_series(1, %s) g",
        (max(1, n // 10),),
    )
    (owner,) = raw.execute("SELECT id FROM agents WHERE name = 'idle-1'").fetchone()  # type: ignore[misc]
    common = "agent_id, request_id, operation, target, status, queue, priority, run_at, created_at, updated_at"
    raw.execute(
        f"INSERT INTO jobs (key, {common}, finished_at, result)"
        " SELECT 'old-' || g || ':plan:1', %(owner)s, 'old-' || (g / 4), 'plan', '1', 'succeeded', 'keel.jobs', 5,"
        " now() - interval '1 day', now() - interval '1 day', now(), now(),"
        ' \'{"reply": {"role": "assistant", "content": "done"}}\'::jsonb FROM generate_series(1, %(n)s) g',
        {"owner": owner, "n": n},
    )
    raw.execute(
        f"INSERT INTO jobs (key, {common}, enqueued_at)"
        " SELECT 'wait-' || g || ':count:1', %(owner)s, 'wait-' || g, 'count', '1', 'enqueued', 'keel.jobs', 5,"
        " now() - interval '1 minute', now(), now(), now() FROM generate_series(1, %(n)s) g",
        {"owner": owner, "n": n},
    )
    raw.execute(
        f"INSERT INTO jobs (key, {common})"
        " SELECT 'due-' || g || ':count:1', %(owner)s, 'due-' || g, 'count', '1', 'pending', 'keel.jobs', 5,"
        " now() - interval '1 second', now(), now() FROM generate_series(1, 10) g",
        {"owner": owner},
    )
    raw.execute(
        "INSERT INTO schedules (name, agent_id, every_seconds, operation, input, next_fire_at)"
        " SELECT 'sched-' || g, %(owner)s, 3600, 'count', 'null', now() + interval '1 hour'"
        " FROM generate_series(1, %(n)s) g",
        {"owner": owner, "n": max(1, n // 10)},
    )
    _long_request(raw, owner)
    for table in ("agents", "jobs", "schedules", "requests"):
        raw.execute(f"ANALYZE {table}")
    raw.commit()


def _long_request(raw: psycopg.Connection[Any], owner: Any) -> None:
    """One request of ROUNDS rounds (a plan step calling slack_post, its result), stored as the loop stores them:
    O(rounds) messages in all, the whole conversation once, on the latest plan step."""
    prompt = {"prompt": "a long conversation"}
    raw.execute(
        "INSERT INTO requests (request_id, agent_id, input, actor, submitted_at) VALUES (%s, %s, %s, 'bench', now())",
        (REQUEST, owner, json.dumps(prompt)),
    )
    sent: list[dict[str, Any]] = [
        {"role": "system", "content": Settings().llm_system_prompt},
        {"role": "user", "content": prompt["prompt"]},
    ]
    for n in range(1, ROUNDS + 1):
        call = {"id": f"call_{n}", "type": "function", "function": {"name": "slack_post", "arguments": "{}"}}
        reply = {"role": "assistant", "content": None, "tool_calls": [call]}
        tool_key = make_key(REQUEST, "tool", step_target("slack_post", n, call["id"]))
        content = f"posted message {n} " + "x" * 200
        for key, operation, target, result in (
            # As the loop stores them: only the latest plan step keeps the conversation it sent (a step's outcome
            # drops the previous one's), the others their reply alone.
            (
                make_key(REQUEST, "plan", str(n)),
                "plan",
                str(n),
                {"reply": reply, **({"conversation": sent} if n == ROUNDS else {})},
            ),
            (
                tool_key,
                "tool",
                step_target("slack_post", n, call["id"]),
                {"tool_call_id": call["id"], "content": content},
            ),
        ):
            raw.execute(
                "INSERT INTO jobs (key, agent_id, request_id, operation, target, status, queue, run_at, created_at,"
                " updated_at, finished_at, result, payload)"
                " VALUES (%s, %s, %s, %s, %s, 'succeeded', 'keel.jobs', now(), clock_timestamp(), now(), now(), %s,"
                " %s)",
                (key, owner, REQUEST, operation, target, json.dumps(result), json.dumps({"round": n})),
            )
        sent = [*sent, reply, {"role": "tool", "tool_call_id": call["id"], "content": content}]


def median_ms(run: Callable[[], Any], repeat: int) -> float:
    run()  # warm: the pool's connection, the plan cache
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(db: Database, repeat: int) -> dict[str, float]:
    def tick() -> None:
        with db.connection() as conn, conn.cursor() as cur:
            found = take_due(cur, enqueue_timeout=timedelta(hours=1), limit=500)
            assert len(found) == 10, len(found)
            conn.rollback()

    def old_tick() -> None:
        with db.connection() as conn:
            assert len(conn.execute(OLD_TAKE_DUE).fetchall()) == 10
            conn.rollback()

    def deadline_pass() -> None:
        report = deadlines.enforce(db)
        assert not (report.stopped or report.demoted or report.failed)

    def old_deadline_pass() -> None:
        with db.connection() as conn:
            phases = ["planning", "executing", "waiting_approval"]
            assert conn.execute(OLD_DEADLINES, {"phases": phases}).fetchall() == []
            conn.rollback()

    def schedule_pass() -> None:
        assert schedules.fire_due(db) == []

    with db.connection() as conn:
        (owner,) = conn.execute("SELECT agent_id FROM requests WHERE request_id = %s", (REQUEST,)).fetchone()  # type: ignore[misc]
        conn.commit()
    # Seeded with bare request keys, as requests submitted before migration 0028 are.
    plan_key = make_key(REQUEST, "plan", str(ROUNDS + 1))

    def read() -> None:
        assert len(conversation(db, owner, REQUEST, plan_key)[1]) == 2 + 2 * ROUNDS

    def rebuild() -> None:
        assert len(rebuild_conversation(db, owner, REQUEST, plan_key)[1]) == 2 + 2 * ROUNDS

    return {
        "dispatcher tick (10 due)": median_ms(tick, repeat),
        "  before 0020: the scan over every live job": median_ms(old_tick, repeat),
        "deadline pass (none due)": median_ms(deadline_pass, repeat),
        "  before 0020: the scan over every active agent": median_ms(old_deadline_pass, repeat),
        "schedule pass (none due)": median_ms(schedule_pass, repeat),
        f"conversation read, round {ROUNDS + 1}": median_ms(read, repeat),
        "  the rebuild from every step of the request": median_ms(rebuild, repeat),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=1000, help="backlog rows of the small database")
    parser.add_argument("--large", type=int, default=100_000, help="backlog rows of the large database")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    settings = Settings()
    server = database_url_for(settings)
    tag = uuid.uuid4().hex[:8]
    names = {size: f"keel_bench_scans_{tag}_{size}" for size in (args.small, args.large)}
    admin_url = libpq_url(with_database(server, "postgres"))
    results: dict[int, dict[str, float]] = {}
    try:
        for size, name in names.items():
            with psycopg.connect(admin_url, autocommit=True) as admin:
                admin.execute(f'CREATE DATABASE "{name}"')
            url = with_database(server, name)
            with OUT.task(f"migrating and seeding {size:,} backlog rows"):
                migrations.upgrade(url)
                with psycopg.connect(libpq_url(url)) as raw:
                    seed(raw, size)
            db = Database(url, pool_size=2, audit_keys=audit_keys_for(settings))
            try:
                with OUT.task(f"measuring at {size:,}"):
                    results[size] = measure(db, args.repeat)
            finally:
                db.dispose()
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            for name in names.values():
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    small, large = results[args.small], results[args.large]
    OUT.line(f"scans benchmark: median of {args.repeat} runs, ms; backlog {args.small:,} vs {args.large:,} rows")
    OUT.line(f"  {'':50} {f'{args.small:,}':>10} {f'{args.large:,}':>10} {'ratio':>8}")
    for what in small:
        OUT.line(f"  {what:50} {small[what]:10.2f} {large[what]:10.2f} {large[what] / small[what]:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

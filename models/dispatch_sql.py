"""The dispatcher's SQL: which jobs are due, taken a batch at a time and marked enqueued for publishing, and put
back when a publish fails. How the scan stays as cheap as its batch:
docs/explanation/storage-and-jobs.md#the-due-scan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from models.db import Database
from models.tables import JOB_QUEUES


@dataclass(frozen=True, slots=True)
class Due:
    """A job to publish to the broker."""

    key: str
    queue: str
    recovered: bool  # its lease or enqueue had expired: a worker died or the broker lost the message


#: error_attempts with one more ``unknown`` failure: a run whose worker died (its lease expired).
COUNT_LOST_RUN = (
    "jsonb_set(j.error_attempts, '{unknown}', to_jsonb(COALESCE((j.error_attempts->>'unknown')::int, 0) + 1))"
)


#: Job priorities (agents/core/commands.py JobSpec checks 0-9), highest first: the scan reads each queue's and
#: priority's range of ``ix_jobs_pending`` on its own, so it costs the batch, whatever else waits.
PRIORITIES: tuple[int, ...] = tuple(range(9, -1, -1))

# The database's clock, read once in a subquery: compared directly, the volatile ``clock_timestamp()`` could only
# filter rows already read, never bound an index scan.
_NOW = "(SELECT at FROM clock)"


def _candidates(queue: str) -> str:
    """One queue's due jobs, at most ``limit`` of each case: new ones by priority, enqueued ones never claimed,
    running ones whose lease ran out."""
    q = _literal(queue)
    return (
        "".join(
            f"  (SELECT key, priority, run_at FROM jobs WHERE status = 'pending' AND queue = {q}"
            f"    AND priority = {priority} AND run_at <= {_NOW} ORDER BY run_at LIMIT %(limit)s) UNION ALL"
            for priority in PRIORITIES
        )
        + f"  (SELECT key, priority, run_at FROM jobs WHERE status = 'enqueued' AND queue = {q}"
        f"    AND enqueued_at < {_NOW} - %(stale)s AND run_at <= {_NOW}"
        "    ORDER BY enqueued_at LIMIT %(limit)s)"
        "  UNION ALL"
        f"  (SELECT key, priority, run_at FROM jobs WHERE status = 'running' AND queue = {q}"
        f"    AND lease_until < {_NOW} AND run_at <= {_NOW} ORDER BY lease_until LIMIT %(limit)s)"
    )


def _literal(queue: str) -> str:
    if not queue or not all(c.isascii() and (c.isalnum() or c in "._-") for c in queue):
        raise ValueError(f"not a queue name: {queue!r}")  # names come from tasks/app.py; never from a request
    return f"'{queue}'"


def take_due_sql(queues: Sequence[str]) -> str:
    """The due scan over ``queues`` (each case of each queue through its own index range), its stale age and
    limit still to be written in (%(stale)s, %(limit)s)."""
    if not queues:
        raise ValueError("take_due needs at least one queue")
    return (
        "WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS at),"
        " candidates AS ("
        + "  UNION ALL".join(_candidates(queue) for queue in queues)
        + "), batch AS (SELECT key FROM candidates ORDER BY priority DESC, run_at, key LIMIT %(limit)s),"
        # Locked and checked again row by row: a row another dispatcher holds is skipped, and one that a claim or a
        # dispatcher (or a demotion to another queue) moved on since the candidates were read is no longer due.
        " due AS ("
        "  SELECT j.key, j.status FROM jobs j JOIN batch USING (key)"
        f"  WHERE j.run_at <= {_NOW} AND j.queue IN ({', '.join(_literal(q) for q in queues)})"
        "    AND (j.status = 'pending'"
        f"         OR (j.status = 'running' AND j.lease_until < {_NOW})"
        f"         OR (j.status = 'enqueued' AND j.enqueued_at < {_NOW} - %(stale)s))"
        "  FOR UPDATE OF j SKIP LOCKED)"
        " UPDATE jobs j SET status = 'enqueued', enqueued_at = clock_timestamp(), lease_until = NULL,"
        " updated_at = clock_timestamp(),"
        " error_attempts = CASE WHEN due.status = 'running' THEN " + COUNT_LOST_RUN + " ELSE j.error_attempts END"
        " FROM due WHERE j.key = due.key RETURNING j.key, j.queue, due.status AS previous"
    )


def take_due_statement(enqueue_timeout: timedelta, limit: int, queues: Sequence[str] = JOB_QUEUES) -> str:
    """The due scan with its values written in (all of them numbers or queue names), so that psycopg prepares it
    and it is planned once per connection, not on every tick. One text per set of queues: at most three."""
    return _written_in(take_due_sql(queues), enqueue_timeout=enqueue_timeout, limit=limit)


def _written_in(statement: str, *, enqueue_timeout: timedelta, limit: int) -> str:
    """``statement`` with its stale age and limit written in as literals (a number each)."""
    seconds = float(enqueue_timeout.total_seconds())
    return statement.replace("%(stale)s", f"interval '{seconds:.6f} seconds'").replace("%(limit)s", str(int(limit)))


def queues_with_due(cur: psycopg.Cursor[Any], *, enqueue_timeout: timedelta, queues: Sequence[str]) -> list[str]:
    """Which of ``queues`` have a job due (read, not taken: one index probe per case), for what back-pressure says
    it holds back."""
    found = []
    for queue in queues:
        statement = _written_in(
            "WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS at),"
            f" candidates AS ({_candidates(queue)}) SELECT EXISTS (SELECT 1 FROM candidates)",
            enqueue_timeout=enqueue_timeout,
            limit=1,
        )
        row = cur.execute(statement).fetchone()
        if row is not None and row[0]:
            found.append(queue)
    return found


def take_due(
    cur: psycopg.Cursor[Any], *, enqueue_timeout: timedelta, limit: int, queues: Sequence[str] = JOB_QUEUES
) -> list[Due]:
    """Mark at most ``limit`` due jobs of ``queues`` enqueued (skipping rows another dispatcher holds) and return
    them for publishing, highest priority first, each under its own key. Due, on the database's clock: pending with
    run_at come; running with an expired lease (counted as an ``unknown`` failure); enqueued more than
    ``enqueue_timeout`` ago and still not claimed, published again (docs/explanation/storage-and-jobs.md)."""
    with cur.connection.cursor(row_factory=dict_row) as named:
        named.execute(take_due_statement(enqueue_timeout, limit, queues))
        rows = named.fetchall()
    return [Due(key=r["key"], queue=r["queue"], recovered=r["previous"] != "pending") for r in rows]


def unpublish(db: Database, keys: Sequence[str]) -> list[str]:
    """Jobs whose publish failed after their transition committed go back to pending, so the next dispatcher pass
    publishes them (instead of waiting out the enqueue timeout). A job a worker already claimed is left alone."""
    if not keys:
        return []
    with db.autocommit() as cur:
        cur.execute(
            "UPDATE jobs SET status = 'pending', enqueued_at = NULL, updated_at = clock_timestamp()"
            " WHERE key = ANY(%s) AND status = 'enqueued' RETURNING key",
            (list(keys),),
        )
        return [r[0] for r in cur.fetchall()]

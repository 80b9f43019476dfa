"""Retention: finished jobs, sent outbox messages (with their delivery log rows) and old requests' inputs are pruned
after a configurable age, a short transaction per batch, on the database's clock; a pruned key stays in
``pruned_keys``. What is never pruned, and why two pruners never wait on each other:
docs/explanation/storage-and-jobs.md#retention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg.rows import dict_row

from models.db import Database, end_read
from models.tables import JOB_FINAL

#: Phases in which an agent's current request is in flight (agents.core.phases: every phase but the RESTING ones; a
#: unit test holds them equal).
IN_FLIGHT: tuple[str, ...] = ("planning", "executing", "waiting_approval")

_FINAL = ", ".join(repr(s) for s in JOB_FINAL)
_FLIGHT = ", ".join(repr(p) for p in IN_FLIGHT)


def _not_in_flight(alias: str) -> str:
    """The row's request is not the one its agent is working on (an agent deleted since: nothing is in flight)."""
    return (
        f"NOT EXISTS (SELECT 1 FROM agents a WHERE a.id = {alias}.agent_id AND a.request_id = {alias}.request_id"
        f" AND a.phase IN ({_FLIGHT}))"
    )


_JOBS = f"""
FROM jobs j WHERE j.status IN ({_FINAL}) AND j.finished_at < now() - make_interval(days => %(days)s)
  AND {_not_in_flight("j")}
"""
_MESSAGES = f"""
FROM outbox o WHERE o.status = 'sent' AND o.sent_at < now() - make_interval(days => %(days)s)
  AND {_not_in_flight("o")}
"""
_REQUESTS = f"""
FROM requests r WHERE r.pruned_at IS NULL AND r.submitted_at < now() - make_interval(days => %(days)s)
  AND {_not_in_flight("r")}
"""

# Each batch starts after the last one's last job (finished_at, key): the old finished jobs of a request still in
# flight (a long-running one keeps them) are passed once per prune, not re-read by every batch after them.
_PRUNE_JOBS = f"""
WITH doomed AS (SELECT j.key, j.finished_at {_JOBS}
                  AND (j.finished_at, j.key) > (%(after_at)s::timestamptz, %(after_key)s)
                ORDER BY j.finished_at, j.key LIMIT %(batch)s FOR UPDATE OF j SKIP LOCKED),
     gone AS (DELETE FROM jobs j USING doomed d WHERE j.key = d.key RETURNING 1),
     last AS (SELECT finished_at, key FROM doomed ORDER BY finished_at DESC, key DESC LIMIT 1)
SELECT (SELECT count(*) FROM gone) AS n, (SELECT finished_at FROM last) AS at, (SELECT key FROM last) AS key
"""
#: Where a prune's first batch of jobs starts: before every job.
_JOBS_START = ("-infinity", "")
# The delivery log rows are counted before the DELETE (one snapshot for the whole statement) and go by its cascade.
_PRUNE_MESSAGES = f"""
WITH doomed AS (SELECT o.key {_MESSAGES} ORDER BY o.sent_at LIMIT %(batch)s FOR UPDATE OF o SKIP LOCKED),
     confirmations AS (SELECT count(*) AS n FROM delivery_log l WHERE l.key IN (SELECT key FROM doomed)),
     gone AS (DELETE FROM outbox o USING doomed d WHERE o.key = d.key RETURNING o.key)
SELECT (SELECT count(*) FROM gone) AS messages, (SELECT n FROM confirmations) AS confirmations
"""
# The requests guard (migration 0021) replaces the input with JSON null and keeps its digest.
_PRUNE_REQUESTS = f"""
WITH doomed AS (SELECT r.agent_id, r.request_id {_REQUESTS} ORDER BY r.submitted_at LIMIT %(batch)s
                FOR UPDATE OF r SKIP LOCKED)
UPDATE requests r SET pruned_at = now() FROM doomed d WHERE r.agent_id = d.agent_id AND r.request_id = d.request_id
"""

_COUNT = f"""
SELECT (SELECT count(*) {_JOBS.replace("%(days)s", "%(jobs)s")}) AS jobs,
       (SELECT count(*) {_MESSAGES.replace("%(days)s", "%(messages)s")}) AS messages,
       (SELECT count(*) FROM delivery_log l WHERE l.key IN
          (SELECT o.key {_MESSAGES.replace("%(days)s", "%(messages)s")})) AS confirmations,
       (SELECT count(*) {_REQUESTS.replace("%(days)s", "%(requests)s")}) AS requests
"""


@dataclass(frozen=True, slots=True)
class Retention:
    """How old (days, database clock) what is pruned must be; 0 keeps that kind for ever."""

    jobs_days: int
    messages_days: int
    requests_days: int
    batch: int = 1000

    @classmethod
    def of(cls, settings: Any) -> Retention:
        return cls(
            jobs_days=settings.jobs_retention_days,
            messages_days=settings.outbox_retention_days,
            requests_days=settings.requests_retention_days,
            batch=settings.prune_batch,
        )

    @property
    def keeps_everything(self) -> bool:
        return not (self.jobs_days or self.messages_days or self.requests_days)


@dataclass(slots=True)
class Pruned:
    """What a prune removed (or, in a dry run, would remove)."""

    jobs: int = 0
    messages: int = 0
    confirmations: int = 0  # delivery log rows, gone with their messages
    requests: int = 0  # inputs replaced by their digest; the rows stay
    dry_run: bool = False

    @property
    def total(self) -> int:
        return self.jobs + self.messages + self.confirmations + self.requests


def prune(db: Database, retention: Retention, *, dry_run: bool = False) -> Pruned:
    """Prune everything old enough under ``retention``, a batch per transaction, until nothing is left; with
    ``dry_run``, count it instead (one read) and change nothing."""
    if dry_run:
        return _count(db, retention)
    pruned = Pruned()
    if retention.jobs_days:
        after: tuple[Any, str] | None = _JOBS_START
        while after is not None:
            n, after = _jobs_batch(db, retention.jobs_days, retention.batch, after)
            pruned.jobs += n
            if n < retention.batch:
                break
    if retention.messages_days:
        while True:
            messages, confirmations = prune_messages_batch(db, retention.messages_days, retention.batch)
            pruned.messages += messages
            pruned.confirmations += confirmations
            if messages < retention.batch:
                break
    if retention.requests_days:
        while (n := _batch(db, _PRUNE_REQUESTS, retention.requests_days, retention.batch)) > 0:
            pruned.requests += n
            if n < retention.batch:
                break
    return pruned


def prune_jobs_batch(db: Database, days: int, batch: int) -> int:
    """One batch of finished jobs older than ``days``, oldest first; how many went."""
    return _jobs_batch(db, days, batch, _JOBS_START)[0]


def _jobs_batch(db: Database, days: int, batch: int, after: tuple[Any, str]) -> tuple[int, tuple[Any, str] | None]:
    """A batch of jobs past ``after`` (finished_at, key): how many went, and where the next batch starts (None:
    nothing was left past it)."""
    with db.transaction() as cur:
        cur.row_factory = dict_row
        cur.execute(_PRUNE_JOBS, {"days": days, "batch": batch, "after_at": after[0], "after_key": after[1]})
        row = cur.fetchone()
    assert row is not None
    return int(row["n"]), (None if row["key"] is None else (row["at"], row["key"]))


def prune_messages_batch(db: Database, days: int, batch: int) -> tuple[int, int]:
    """One batch of messages sent more than ``days`` ago, oldest first, with their delivery log rows: (messages,
    delivery log rows) that went."""
    with db.transaction() as cur:
        cur.row_factory = dict_row
        cur.execute(_PRUNE_MESSAGES, {"days": days, "batch": batch})
        row = cur.fetchone()
    assert row is not None
    return int(row["messages"]), int(row["confirmations"])


def prune_requests_batch(db: Database, days: int, batch: int) -> int:
    """One batch of requests submitted more than ``days`` ago, oldest first, their inputs replaced by digests."""
    return _batch(db, _PRUNE_REQUESTS, days, batch)


def _batch(db: Database, sql: str, days: int, batch: int) -> int:
    with db.transaction() as cur:
        cur.execute(sql, {"days": days, "batch": batch})
        return cur.rowcount


def _count(db: Database, retention: Retention) -> Pruned:
    # A kind kept for ever counts nothing: an age no row can have (now() minus a century less than any time).
    forever = 36500 * 10
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            _COUNT,
            {
                "jobs": retention.jobs_days or forever,
                "messages": retention.messages_days or forever,
                "requests": retention.requests_days or forever,
            },
        )
        row = cur.fetchone()
        end_read(conn)
    assert row is not None
    return Pruned(
        jobs=row["jobs"] if retention.jobs_days else 0,
        messages=row["messages"] if retention.messages_days else 0,
        confirmations=row["confirmations"] if retention.messages_days else 0,
        requests=row["requests"] if retention.requests_days else 0,
        dry_run=True,
    )

"""Job SQL: insert, claim, renew, checkpoint, finish, retry and cancel, and the reads of a request's jobs. ``*_txn``
helpers run inside the caller's transaction; the others open their own. Every write names the statuses it may move
from (and a worker's, the fencing token it claimed with), so one that lost a race matches zero rows. The due scan
is models/dispatch_sql.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row

from models.db import Database, end_read
from models.dispatch_sql import COUNT_LOST_RUN

# The due scan moved to models/dispatch_sql.py; its names stay importable from here for existing callers.
from models.dispatch_sql import PRIORITIES as PRIORITIES
from models.dispatch_sql import Due as Due
from models.dispatch_sql import queues_with_due as queues_with_due
from models.dispatch_sql import take_due as take_due
from models.dispatch_sql import take_due_sql as take_due_sql
from models.dispatch_sql import take_due_statement as take_due_statement
from models.dispatch_sql import unpublish as unpublish


@dataclass(frozen=True, slots=True)
class NewJob:
    key: str
    agent_id: UUID
    request_id: str
    operation: str
    target: str
    payload: dict[str, Any]
    status: str  # pending, or enqueued when the caller publishes it right after commit
    queue: str
    priority: int
    run_at: datetime
    #: The W3C trace context of the work that scheduled it (None when traces are off): its run continues that trace.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job this worker now runs, under ``fencing_token`` until ``lease_until``."""

    key: str
    agent_id: UUID
    request_id: str
    operation: str
    target: str
    payload: dict[str, Any]
    attempts: int
    error_attempts: dict[str, int]
    fencing_token: int
    lease_until: datetime
    queue: str
    # The agent as it was at the claim, for the checks before the handler runs (budget, deadline, phase).
    agent_phase: str
    hard_deadline: datetime | None
    spent_tokens: int
    spent_cost: Decimal
    budget_tokens: int | None
    budget_cost: Decimal | None
    #: The database's clock at the claim: what the checks before the handler compare deadlines with.
    claimed_at: datetime
    # What an earlier attempt checkpointed before it could record its outcome (a reply it already paid for).
    checkpoint: dict[str, Any] | None = None
    #: The trace this run continues (stored by the transition that scheduled it); None when traces were off.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class JobStatus:
    key: str
    agent_id: UUID
    status: str
    run_at: datetime
    lease_until: datetime | None
    traceparent: str | None = None


#: A job as the state view lists it (the fields of ``models.schemas.JobView``).
JOB_VIEW_COLUMNS = "key, operation, target, status, queue, run_at, attempts, error_attempts, last_error"
_LIVE_JOBS = (
    f"SELECT {JOB_VIEW_COLUMNS} FROM jobs WHERE agent_id = %s AND status IN ('pending', 'enqueued', 'running')"
    " ORDER BY run_at, key"
)

_INSERT = (
    "INSERT INTO jobs (key, agent_id, request_id, operation, target, payload, status, queue, priority, run_at,"
    " enqueued_at, created_at, updated_at, traceparent)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, CASE WHEN %s = 'enqueued' THEN %s END, %s, %s, %s)"
    " ON CONFLICT (key) DO NOTHING"
    f" RETURNING {JOB_VIEW_COLUMNS}"
)


def insert_jobs_txn(
    cur: psycopg.Cursor[Any], jobs: Sequence[NewJob], now: datetime
) -> tuple[list[dict[str, Any]], list[str]]:
    """Insert ``jobs``; an existing key is left alone. Returns (the inserted jobs as the state view lists them, by
    column name; the suppressed duplicate keys)."""
    inserted: list[dict[str, Any]] = []
    suppressed: list[str] = []
    with cur.connection.cursor(row_factory=dict_row) as named:
        for job in jobs:
            named.execute(
                _INSERT,
                (
                    job.key,
                    job.agent_id,
                    job.request_id,
                    job.operation,
                    job.target,
                    json.dumps(job.payload),
                    job.status,
                    job.queue,
                    job.priority,
                    job.run_at,
                    job.status,
                    now,
                    now,
                    now,
                    job.traceparent,
                ),
            )
            row = named.fetchone()
            if row is None:
                suppressed.append(job.key)
            else:
                inserted.append(row)
    return inserted, suppressed


def live_jobs_txn(cur: psycopg.Cursor[Any], agent_id: UUID) -> list[dict[str, Any]]:
    """The agent's jobs that are not final, by column name (the fields of ``JobView``), inside the caller's
    transaction: what it will have committed."""
    with cur.connection.cursor(row_factory=dict_row) as named:
        named.execute(_LIVE_JOBS, (agent_id,))
        return named.fetchall()


@dataclass(frozen=True, slots=True)
class Swept:
    """What a cancel of live jobs (:func:`cancel_agent_jobs_txn`, :func:`cancel_request_steps_txn`) cancelled."""

    keys: list[str]
    #: The usage (``{"tokens": …, "cost": …}`` as staged) of each cancelled job that held a staged outcome, by key:
    #: spend no attempt will record now, taken out of the job with its outcome, for the caller to charge.
    staged: dict[str, Any]


#: Cancels live jobs (their ``WHERE`` written in as ``{live}``): running ones get a new fencing token, so their outcome
#: cannot land, and a staged outcome leaves its job (no attempt will record it now), its usage returned to be charged.
_CANCEL_LIVE = (
    "UPDATE jobs SET status = 'cancelled', last_error = %(reason)s, lease_until = NULL, finished_at = %(now)s,"
    " updated_at = %(now)s,"
    " fencing_token = CASE WHEN status = 'running' THEN nextval('job_fencing_token_seq') ELSE fencing_token END,"
    " result = CASE WHEN result ? 'staged' THEN NULLIF(result - 'staged' - 'reply', '{{}}'::jsonb) ELSE result END"
    " FROM (SELECT key AS live, COALESCE(result #> '{{staged,result,usage}}', result #> '{{staged,failure,usage}}')"
    "       AS usage FROM jobs WHERE {live} AND status IN ('pending', 'enqueued', 'running') FOR UPDATE) s"
    " WHERE key = s.live RETURNING key, s.usage"
)
_CANCEL_AGENT_JOBS = _CANCEL_LIVE.format(live="agent_id = %(agent_id)s")
_CANCEL_REQUEST_STEPS = _CANCEL_LIVE.format(
    live="agent_id = %(agent_id)s AND request_id = %(request_id)s AND operation = ANY(%(operations)s)"
)


def _swept(cur: psycopg.Cursor[Any]) -> Swept:
    rows = cur.fetchall()
    return Swept([key for key, _ in rows], {key: usage for key, usage in rows if usage is not None})


def cancel_agent_jobs_txn(cur: psycopg.Cursor[Any], agent_id: UUID, now: datetime, reason: str) -> Swept:
    """Cancel every live job of the agent (see :data:`_CANCEL_LIVE`): the caller charges the staged spend."""
    cur.execute(_CANCEL_AGENT_JOBS, {"reason": reason, "now": now, "agent_id": agent_id})
    return _swept(cur)


def charge_void_attempt_txn(cur: psycopg.Cursor[Any], key: str, tokens: int, cost: Decimal) -> None:
    """Record on job ``key`` the spend of an attempt whose outcome was never recorded (charged to its agent)."""
    cur.execute(
        "UPDATE jobs SET failed_tokens = failed_tokens + %s, failed_cost = failed_cost + %s WHERE key = %s",
        (tokens, cost, key),
    )


def demote_agent_jobs_txn(cur: psycopg.Cursor[Any], agent_id: UUID, queue: str, now: datetime) -> list[str]:
    """Move the agent's jobs that have not started to the low-priority queue."""
    cur.execute(
        "UPDATE jobs SET queue = %s, priority = LEAST(priority, 2), updated_at = %s"
        " WHERE agent_id = %s AND status IN ('pending', 'enqueued') RETURNING key",
        (queue, now, agent_id),
    )
    return [r[0] for r in cur.fetchall()]


def claim(db: Database, key: str, worker: str, lease: timedelta) -> ClaimedJob | JobStatus | None:
    """Claim ``key`` (pending/enqueued, or running with an expired lease → running, new fencing token).

    Returns the claimed job; or, when it cannot be claimed, its current status (a duplicate delivery);
    or None when no such job exists.
    """
    # One statement in autocommit, durable before the handler starts; it share-locks the agent first (agent, then
    # jobs, as every transition) and counts a taken-over lease as an ``unknown`` failure.
    # Why: docs/explanation/storage-and-jobs.md#the-claim.
    with db.autocommit() as plain, plain.connection.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "WITH a AS (SELECT id, phase, hard_deadline, spent_tokens, spent_cost, budget_tokens, budget_cost"
            "  FROM agents WHERE id = (SELECT agent_id FROM jobs WHERE key = %(key)s) FOR SHARE)"
            " UPDATE jobs j SET status = 'running', fencing_token = nextval('job_fencing_token_seq'),"
            " lease_until = clock_timestamp() + %(lease)s, attempts = j.attempts + 1, worker = %(worker)s,"
            " started_at = clock_timestamp(), updated_at = clock_timestamp(),"
            " error_attempts = CASE WHEN j.status = 'running' THEN " + COUNT_LOST_RUN + " ELSE j.error_attempts END"
            " FROM a WHERE j.key = %(key)s AND j.agent_id = a.id AND j.run_at <= clock_timestamp()"
            " AND (j.status IN ('pending', 'enqueued') OR (j.status = 'running' AND j.lease_until < clock_timestamp()))"
            " RETURNING j.key, j.agent_id, j.request_id, j.operation, j.target, j.payload, j.attempts,"
            " j.error_attempts, j.fencing_token, j.lease_until, j.queue, a.phase AS agent_phase, a.hard_deadline,"
            " a.spent_tokens,"
            " a.spent_cost, a.budget_tokens, a.budget_cost, j.result AS checkpoint, clock_timestamp() AS claimed_at,"
            " j.traceparent",
            {"key": key, "lease": lease, "worker": worker},
        )
        row = cur.fetchone()
        if row is not None:
            return ClaimedJob(**row)
        cur.execute("SELECT key, agent_id, status, run_at, lease_until, traceparent FROM jobs WHERE key = %s", (key,))
        found = cur.fetchone()
        if found is None:
            # Finished and pruned by retention (its tombstone): a late copy, suppressed like any duplicate delivery.
            cur.execute(
                "SELECT key, agent_id, 'pruned' AS status, pruned_at AS run_at, NULL::timestamptz AS lease_until"
                " FROM pruned_keys WHERE kind = 'job' AND key = %s",
                (key,),
            )
            found = cur.fetchone()
        return None if found is None else JobStatus(**found)


def extend_lease(db: Database, key: str, token: int, lease: timedelta) -> bool:
    """Heartbeat: push the lease out. False if this worker no longer holds the job."""
    return (key, token) in extend_leases(db, [(key, token)], lease)


def extend_leases(db: Database, held: Sequence[tuple[str, int]], lease: timedelta) -> set[tuple[str, int]]:
    """Heartbeat for every job a process runs, in one statement: push each lease out; the ``(key, token)`` pairs
    still held (a job missing from the answer was taken over, cancelled or finished). Rows are locked in key order
    and a row another transaction holds is skipped, not waited for (it is still held: renewed next round), so a
    renewal neither deadlocks with a transition nor waits behind one."""
    if not held:
        return set()
    keys, tokens = [key for key, _ in held], [token for _, token in held]
    with db.autocommit() as cur:
        cur.execute(
            "WITH h AS (SELECT * FROM unnest(%s::text[], %s::bigint[]) AS h(key, token)),"
            " l AS (SELECT j.key FROM jobs j JOIN h ON j.key = h.key AND j.fencing_token = h.token"
            "  WHERE j.status = 'running' ORDER BY j.key FOR UPDATE OF j SKIP LOCKED),"
            " u AS (UPDATE jobs j SET lease_until = clock_timestamp() + %s FROM l WHERE j.key = l.key RETURNING j.key)"
            " SELECT h.key, h.token FROM h WHERE EXISTS (SELECT 1 FROM u WHERE u.key = h.key)"
            " OR EXISTS (SELECT 1 FROM jobs j WHERE j.key = h.key AND j.fencing_token = h.token"
            "  AND j.status = 'running')",
            (keys, tokens, lease),
        )
        return {(str(key), int(token)) for key, token in cur.fetchall()}


def finish_txn(cur: psycopg.Cursor[Any], params: tuple[Any, ...]) -> bool:
    """Write the final outcome of a claimed job (:func:`finish_params`); False if the claim is no longer ours
    (nothing written)."""
    cur.execute(FINISH, params)
    return cur.rowcount == 1


#: A claimed job's final outcome, written only under the claim's fencing token (the statement of :func:`finish_txn`,
#: and the first part of the statement that writes it together with its agent's row: models/sql.py).
FINISH = (
    "UPDATE jobs SET status = %s, result = %s, tokens = tokens + %s, cost = cost + %s, last_error = %s,"
    " error_class = %s, failed_tokens = failed_tokens + %s, failed_cost = failed_cost + %s,"
    " error_attempts = COALESCE(%s, error_attempts), lease_until = NULL, finished_at = %s, updated_at = %s"
    " WHERE key = %s AND fencing_token = %s AND status = 'running'"
)


def finish_params(
    key: str,
    token: int,
    *,
    status: str,
    now: datetime,
    result: dict[str, Any] | None = None,
    tokens: int = 0,
    cost: Decimal = Decimal(0),
    error: str | None = None,
    error_class: str | None = None,
    failed_tokens: int = 0,
    failed_cost: Decimal = Decimal(0),
    error_attempts: dict[str, int] | None = None,
) -> tuple[Any, ...]:
    """The parameters of :data:`FINISH`."""
    return (
        status,
        None if result is None else json.dumps(result),
        tokens,
        cost,
        error,
        error_class,
        failed_tokens,
        failed_cost,
        None if error_attempts is None else json.dumps(error_attempts),
        now,
        now,
        key,
        token,
    )


def retry_txn(
    cur: psycopg.Cursor[Any],
    key: str,
    token: int,
    *,
    run_at: datetime,
    now: datetime,
    error: str,
    error_class: str,
    error_attempts: dict[str, int],
    failed_tokens: int,
    failed_cost: Decimal,
    queue: str | None = None,
) -> bool:
    """Put a failed attempt back to pending, due at ``run_at``, under the same key (on ``queue`` if given); its
    staged outcome is dropped (the next attempt runs afresh). False if the claim is no longer ours."""
    cur.execute(
        "UPDATE jobs SET status = 'pending', run_at = %s, last_error = %s, error_class = %s, error_attempts = %s,"
        " failed_tokens = failed_tokens + %s, failed_cost = failed_cost + %s, lease_until = NULL, enqueued_at = NULL,"
        " result = NULLIF(result - 'staged', '{}'::jsonb),"
        " queue = COALESCE(%s, queue), updated_at = %s WHERE key = %s AND fencing_token = %s AND status = 'running'",
        (run_at, error, error_class, json.dumps(error_attempts), failed_tokens, failed_cost, queue, now, key, token),
    )
    return cur.rowcount == 1


def checkpoint(db: Database, key: str, token: int, data: dict[str, Any]) -> bool:
    """Store a step's result the moment it exists (before its outcome transition), under the claim's token. A later
    attempt finds it and does not pay for the same call again. ``data``'s keys are merged into what is stored."""
    with db.autocommit() as cur:
        cur.execute(
            "UPDATE jobs SET result = COALESCE(result, '{}'::jsonb) || %s::jsonb"
            " WHERE key = %s AND fencing_token = %s AND status = 'running'",
            (json.dumps(data), key, token),
        )
        return cur.rowcount == 1


def release_staged_txn(cur: psycopg.Cursor[Any], key: str) -> bool:
    """Take a staged outcome out of a job that ended without it being recorded (cancelled, say), so that its spend
    is charged once, by the caller. False if the job is live again (the attempt that records the staged outcome
    will charge it) or holds no staged outcome any more (one that recorded it did)."""
    cur.execute(
        "UPDATE jobs SET result = NULLIF(result - 'staged' - 'reply', '{}'::jsonb)"
        " WHERE key = %s AND status NOT IN ('pending', 'enqueued', 'running') AND result ? 'staged' RETURNING 1",
        (key,),
    )
    return cur.fetchone() is not None


def drop_result_fields_txn(
    cur: psycopg.Cursor[Any], agent_id: UUID, request_id: str, drops: Sequence[tuple[str, str]]
) -> list[str]:
    """Drop fields from the stored results of a request's finished steps (a later step's result supersedes them);
    the keys of the steps that had one. A step of another request, or one not finished, is left as it is."""
    dropped: list[str] = []
    for key, name in drops:
        cur.execute(
            "UPDATE jobs SET result = result - %s"
            " WHERE key = %s AND agent_id = %s AND request_id = %s AND status = 'succeeded' AND result ? %s"
            " RETURNING key",
            (name, key, agent_id, request_id, name),
        )
        dropped += [r[0] for r in cur.fetchall()]
    return dropped


def cancel_request_steps_txn(
    cur: psycopg.Cursor[Any], agent_id: UUID, request_id: str, operations: Sequence[str], now: datetime
) -> Swept:
    """Cancel a request's live steps of the given operations (superseded; see :data:`_CANCEL_LIVE`): the caller
    charges the staged spend."""
    cur.execute(
        _CANCEL_REQUEST_STEPS,
        {
            "reason": "superseded",
            "now": now,
            "agent_id": agent_id,
            "request_id": request_id,
            "operations": list(operations),
        },
    )
    return _swept(cur)


def holds(cur: psycopg.Cursor[Any], key: str, token: int) -> bool:
    """Whether the claim ``token`` still owns running job ``key``."""
    cur.execute("SELECT 1 FROM jobs WHERE key = %s AND fencing_token = %s AND status = 'running'", (key, token))
    return cur.fetchone() is not None


def count_suppressed_txn(cur: psycopg.Cursor[Any], key: str) -> None:
    cur.execute("UPDATE jobs SET suppressed = suppressed + 1 WHERE key = %s", (key,))


def pending_jobs(db: Database, agent_id: UUID) -> list[dict[str, Any]]:
    """The agent's jobs that are not final, by column name (the fields of ``JobView``)."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_LIVE_JOBS, (agent_id,))
        rows = cur.fetchall()
        end_read(conn)
    return rows


def job_row(db: Database, key: str) -> dict[str, Any] | None:
    with db.connection() as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute("SELECT * FROM jobs WHERE key = %s", (key,))
        row = cur.fetchone()
        end_read(conn)
    return row


#: A request's jobs in order, through ``ix_jobs_request`` (a whole request: the approvals of a waiting agent).
REQUEST_STEPS = (
    "SELECT key, operation, target, status, payload, result, finished_at FROM jobs"
    " WHERE request_id = %(request_id)s AND agent_id = %(agent_id)s ORDER BY created_at, key"
)
REQUEST_INPUT = "SELECT input FROM requests WHERE agent_id = %s AND request_id = %s"
#: Named jobs of a request, by primary key: what a plan step reads to continue the conversation.
STEPS_BY_KEY = (
    "SELECT key, operation, target, status, payload, result FROM jobs"
    " WHERE key = ANY(%(keys)s) AND request_id = %(request_id)s AND agent_id = %(agent_id)s"
)


def request_steps(db: Database, agent_id: UUID, request_id: str) -> tuple[Any, list[dict[str, Any]]]:
    """An agent's request: its input and its jobs (key, operation, target, status, payload, result), oldest first."""
    with db.connection() as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(REQUEST_INPUT, (agent_id, request_id))
        found = cur.fetchone()
        cur.execute(REQUEST_STEPS, {"agent_id": agent_id, "request_id": request_id})
        jobs = cur.fetchall()
        end_read(conn)
    return (None if found is None else found["input"]), jobs


def request_steps_by_key(
    db: Database, agent_id: UUID, request_id: str, keys: Sequence[str]
) -> tuple[Any, dict[str, dict[str, Any]]]:
    """An agent's request: its input and those of its jobs named in ``keys`` (key, operation, target, status,
    payload, result), by key: a plan step reads the steps it follows on from, not the whole request."""
    with db.connection() as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(REQUEST_INPUT, (agent_id, request_id))
        found = cur.fetchone()
        cur.execute(STEPS_BY_KEY, {"keys": list(keys), "agent_id": agent_id, "request_id": request_id})
        jobs = {row["key"]: row for row in cur.fetchall()}
        end_read(conn)
    return (None if found is None else found["input"]), jobs


#: A request's finished gates, latest first, through ``ix_jobs_gates``.
REQUEST_GATES = (
    "SELECT key, target, payload, result, finished_at FROM jobs"
    " WHERE request_id = %(request_id)s AND agent_id = %(agent_id)s AND operation = 'gate' AND status = 'succeeded'"
    " ORDER BY created_at DESC, key DESC"
)


def request_gates(db: Database, agent_id: UUID, request_id: str) -> list[dict[str, Any]]:
    """A request's gate steps that finished (each started a wait for a person), latest first."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(REQUEST_GATES, {"agent_id": agent_id, "request_id": request_id})
        rows = cur.fetchall()
        end_read(conn)
    return rows


def request_jobs(db: Database, agent_id: UUID, request_id: str) -> list[dict[str, Any]]:
    """Every job of agent ``agent_id``'s request, final ones included, oldest first (the fields of ``JobView``)."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT key, operation, target, status, queue, run_at, attempts, error_attempts, last_error FROM jobs"
            " WHERE request_id = %s AND agent_id = %s ORDER BY created_at, key",
            (request_id, agent_id),
        )
        rows = cur.fetchall()
        end_read(conn)
    return rows

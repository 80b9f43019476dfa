"""Hot-path SQL, run on raw psycopg cursors inside the caller's transaction: each ``*_txn`` helper takes the caller's
cursor and never commits, so it succeeds or rolls back with the transition that called it. Statements are plain
strings so psycopg can prepare them once per connection."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg import pq
from psycopg.rows import args_row, dict_row, tuple_row

from models.db import (
    Database,
    end_read,
    notifications_failed,
    notify_after_commit,
    pipeline_begun,
    queue_notifications,
    taken_notifications,
)
from models.jobs_sql import _LIVE_JOBS, FINISH
from models.schemas import AgentRow, DeletedAgent, Submitted

#: The ``agents`` columns, in :class:`AgentRow`'s order: its rows are built by position (:data:`AGENT_ROW`).
AGENT_COLUMNS = ", ".join(field.name for field in fields(AgentRow))
#: The row factory of a query selecting :data:`AGENT_COLUMNS`: one call per row, no lookup of the columns' names.
AGENT_ROW = args_row(AgentRow)

_LOCK_AGENT = f"SELECT {AGENT_COLUMNS} FROM agents WHERE id = %s FOR UPDATE"
# After the lock, in a statement of its own pipelined with it: the agent's live job count, the database's clock and
# the request's trace context (why apart: docs/explanation/storage-and-jobs.md#the-transitions-statements).
_LIVE_JOB_COUNT = (
    "(SELECT count(*) FROM jobs j WHERE j.agent_id = %(agent_id)s AND j.status IN ('pending', 'enqueued', 'running'))"
    " AS live_jobs"
)
_REQUEST_TRACEPARENT = (
    "(SELECT r.traceparent FROM agents a JOIN requests r ON r.agent_id = a.id AND r.request_id = a.request_id"
    " WHERE a.id = %(agent_id)s)"
    " AS request_traceparent"
)
_AFTER_LOCK = f"SELECT {_LIVE_JOB_COUNT}, clock_timestamp() AS at, {_REQUEST_TRACEPARENT}"

# A submit's request claimed in the read after the lock: inserted only if the agent is not on it already (a producer's
# retry claims nothing), at the transition's time. ``claimed`` false for a new request id: the agent had it before.
_AFTER_LOCK_CLAIMING = (
    "WITH claimed AS (INSERT INTO requests (request_id, agent_id, input, actor, submitted_at, traceparent)"
    " SELECT %(request_id)s, a.id, %(input)s::jsonb, %(actor)s, clock_timestamp(), %(traceparent)s FROM agents a"
    " WHERE a.id = %(agent_id)s AND a.request_id IS DISTINCT FROM %(request_id)s"
    " ON CONFLICT (agent_id, request_id) DO NOTHING RETURNING submitted_at)"
    f" SELECT {_LIVE_JOB_COUNT}, coalesce((SELECT submitted_at FROM claimed), clock_timestamp()) AS at,"
    f" {_REQUEST_TRACEPARENT}, EXISTS (SELECT 1 FROM claimed) AS claimed"
)

_EVENT_COLUMNS = (
    "agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision, details, at,"
    " prev_hash, hash, key_id"
)
#: The channel every appended journal event is announced on (payload ``"<agent id>:<seq>"``): only a wake-up, sent
#: once its transaction committed (:func:`models.db.notify_after_commit`), never if it rolls back.
JOURNAL_CHANNEL = "keel_journal"
# Every journal append goes through this one INSERT (and announces itself after the commit: _appended).
_EVENT_CTE = f"WITH ev AS (INSERT INTO audit.journal ({_EVENT_COLUMNS}) VALUES ({', '.join(['%s'] * 15)}) RETURNING 1) "

# One statement writes the journal event and the row it explains (a deferred trigger checks they agree at commit).
# The WHERE clause repeats the revision read under the lock: the database refuses a lost update by itself.
_SET_AGENT = (
    "UPDATE agents SET phase = %s, revision = %s, request_id = %s, soft_deadline = %s,"
    " hard_deadline = %s, updated_at = %s, journal_seq = %s, journal_head = %s, spent_tokens = %s, spent_cost = %s,"
    " priority = %s, waiting_since = %s, request_key = %s WHERE id = %s AND revision = %s AND EXISTS (SELECT 1 FROM ev)"
)
_UPDATE_AGENT = _EVENT_CTE + _SET_AGENT + f" RETURNING {AGENT_COLUMNS}"
# A job's final outcome, the event and the row in one statement (when nothing else is written between them): the
# row only if the outcome was written under the claim's fencing token. Otherwise the event is left past the chain's
# head, which the commit refuses: nothing of the transition is written.
_FINISH_AND_UPDATE_AGENT = (
    f"WITH fin AS ({FINISH} RETURNING 1), {_EVENT_CTE.removeprefix('WITH ')}{_SET_AGENT}"
    f" AND EXISTS (SELECT 1 FROM fin) RETURNING {AGENT_COLUMNS}"
)

# Rejections and suppressions leave the agent's state alone; only its journal chain advances.
_ADVANCE_CHAIN = (
    _EVENT_CTE + "UPDATE agents SET journal_seq = %s, journal_head = %s"
    " WHERE id = %s AND journal_seq = %s AND EXISTS (SELECT 1 FROM ev)"
)

# Archiving leaves the agent's state alone too: it sets or clears archived_at and advances the chain.
_SET_ARCHIVED = (
    _EVENT_CTE + "UPDATE agents SET archived_at = %s, journal_seq = %s, journal_head = %s"
    " WHERE id = %s AND journal_seq = %s AND EXISTS (SELECT 1 FROM ev)"
)


@dataclass(frozen=True, slots=True)
class NewEvent:
    """A journal event ready to insert (its hash already computed over these very values, an HMAC under the audit
    key ``key_id``)."""

    agent_id: UUID
    seq: int
    kind: str
    event: str
    actor: str
    request_id: str | None
    from_phase: str | None
    to_phase: str | None
    revision: int
    decision: str
    details_json: str
    at: datetime
    prev_hash: str
    hash: str
    key_id: str

    def params(self) -> tuple[Any, ...]:
        return (
            self.agent_id, self.seq, self.kind, self.event, self.actor, self.request_id, self.from_phase,
            self.to_phase, self.revision, self.decision, self.details_json, self.at, self.prev_hash, self.hash,
            self.key_id,
        )  # fmt: skip


_INSERT_AGENT = (
    "INSERT INTO agents (name, budget_tokens, budget_cost, created_at, updated_at)"
    " VALUES (%s, %s, %s, clock_timestamp(), clock_timestamp())"
    f" ON CONFLICT (name) DO NOTHING RETURNING {AGENT_COLUMNS}"
)

# A request as it was first submitted: its input and the details of the submit's journal event (the job it scheduled,
# the deadlines as given). Read only when a request id is submitted again.
_REQUEST_AS_SUBMITTED = (
    "SELECT r.input, CASE WHEN r.pruned_at IS NOT NULL"
    " THEN r.input_sha256 = encode(sha256(convert_to(%(input)s::jsonb::text, 'UTF8')), 'hex')"
    " ELSE coalesce(r.input, 'null'::jsonb)::text = %(input)s::jsonb::text END AS same_input,"
    " (SELECT j.details FROM audit.journal j WHERE j.request_id = r.request_id"
    " AND j.agent_id = r.agent_id AND j.kind = 'transition' AND j.event = 'submit' ORDER BY j.id LIMIT 1) AS submit"
    " FROM requests r WHERE r.agent_id = %(agent_id)s AND r.request_id = %(request_id)s"
)


# A request as submitted: its row and its submit event (the first of its agent's chain for it).
_REQUEST_RECORD = (
    "SELECT r.request_id, r.agent_id, r.input, r.actor, r.submitted_at, j.revision, j.details"
    " FROM requests r LEFT JOIN LATERAL (SELECT revision, details FROM audit.journal"
    " WHERE agent_id = r.agent_id AND request_id = r.request_id AND kind = 'transition' AND event = 'submit'"
    " ORDER BY id LIMIT 1) j ON true WHERE r.agent_id = %s AND r.request_id = %s"
)
# The agents that have a request of this id (ids are each agent's own): the caller keeps those its reader may see.
_REQUEST_AGENTS = "SELECT agent_id FROM requests WHERE request_id = %s ORDER BY submitted_at"


@dataclass(frozen=True, slots=True)
class Locked:
    """An agent row under its lock, the number of its live jobs, the database's clock at the lock, and the trace
    context stored with the agent's request in flight (None: none, or traces were off at its submit)."""

    row: AgentRow
    live_jobs: int
    at: datetime
    request_traceparent: str | None = None
    #: With a ``claim``: whether its request was recorded, for this agent, at ``at``. False: the agent is on that
    #: request already (a retry), or it had a request of that id before.
    claimed: bool | None = None


@dataclass(frozen=True, slots=True)
class RequestClaim:
    """A submit's new request, recorded with the agent's lock (:func:`lock_agent_txn`)."""

    request_id: str
    input_json: str
    actor: str
    traceparent: str | None = None


def lock_agent_txn(cur: psycopg.Cursor[Any], agent_id: UUID, *, claim: RequestClaim | None = None) -> Locked | None:
    """Take the agent row's lock (``SELECT … FOR UPDATE``) and read it, with its number of live jobs and the
    database's clock; None if there is no such agent. With ``claim`` (a submit) its request is recorded in the same
    round trip, unless the agent is on it already (see :data:`_AFTER_LOCK_CLAIMING`). ``cur`` must be the first use of
    its transaction's cursor: its current result is discarded (the ``BEGIN``'s lands there)."""
    # On cursors of the caller's connection (same transaction); the BEGIN on the caller's, whose result is not read.
    # Pipelined: the transaction's BEGIN, the lock and what is read after it go in one round trip.
    conn = cur.connection
    with conn.cursor(row_factory=AGENT_ROW) as locking, conn.cursor(row_factory=tuple_row) as after:
        with pipeline_begun(conn, cur):
            locking.execute(_LOCK_AGENT, (agent_id,))
            if claim is None:
                after.execute(_AFTER_LOCK, {"agent_id": agent_id})
            else:
                request = {"request_id": claim.request_id, "input": claim.input_json, "actor": claim.actor}
                after.execute(_AFTER_LOCK_CLAIMING, {"agent_id": agent_id, **request, "traceparent": claim.traceparent})
        row = locking.fetchone()
        found = after.fetchone()
    if row is None or found is None:
        return None
    live_jobs, at, traceparent = found[:3]
    return Locked(row, int(live_jobs), at, traceparent, None if claim is None else bool(found[3]))


def update_agent_and_commit_txn(
    cur: psycopg.Cursor[Any],
    before: AgentRow,
    after: AgentRow,
    event: NewEvent,
    *,
    live_jobs_of: UUID | None = None,
    finish: tuple[Any, ...] | None = None,
) -> tuple[AgentRow | None, list[dict[str, Any]] | None]:
    """Write ``after`` over ``before`` with the event that explains it (and with ``finish`` a job's final outcome), read
    the live jobs of ``live_jobs_of``, ``COMMIT`` and send the journal's wake-ups, in one round trip. Returns the row as
    stored and the jobs read, or (None, None) when nothing was committed; either way the transaction has ended, so the
    caller must not write more. Why: docs/explanation/storage-and-jobs.md#the-transitions-statements."""
    conn = cur.connection
    _appended(cur, event)  # announced in the commit's round trip, right after it (never if it is refused)
    reads_jobs = conn.cursor(row_factory=dict_row) if live_jobs_of is not None else contextlib.nullcontext()
    with conn.cursor(row_factory=AGENT_ROW) as named, conn.cursor() as commit, reads_jobs as jobs:
        pending = taken_notifications(conn)
        try:
            with conn.pipeline():  # its end sends it all and waits once (conn.commit() would wait, then the end again)
                _execute_update(named, before, after, event, finish)
                if jobs is not None:
                    jobs.execute(_LIVE_JOBS, (live_jobs_of,))
                commit.execute("COMMIT", prepare=False)
                queue_notifications(cur, pending)  # (the caller's cursor: their results are not read)
        except psycopg.Error as exc:
            if named.pgresult is not None and named.pgresult.ntuples == 0:
                return None, None  # the lost update the commit refused (and nothing was announced)
            if not _committed(commit):
                raise
            notifications_failed(pending, exc)  # committed: the command happened; only its wake-up was lost
        stored = named.fetchone()
        live = jobs.fetchall() if jobs is not None else None
    if stored is None:  # pragma: no cover - refused at commit above: an update that wrote no row cannot commit
        return None, None
    return stored, live


def _committed(commit: psycopg.Cursor[Any]) -> bool:
    result = commit.pgresult
    return result is not None and result.status == pq.ExecStatus.COMMAND_OK and result.command_status == b"COMMIT"


def _execute_update(
    cur: psycopg.Cursor[AgentRow], before: AgentRow, after: AgentRow, event: NewEvent, finish: tuple[Any, ...] | None
) -> None:
    cur.execute(
        _UPDATE_AGENT if finish is None else _FINISH_AND_UPDATE_AGENT,
        (
            *(finish or ()),
            *event.params(),
            after.phase,
            after.revision,
            after.request_id,
            after.soft_deadline,
            after.hard_deadline,
            after.updated_at,
            after.journal_seq,
            after.journal_head,
            after.spent_tokens,
            after.spent_cost,
            after.priority,
            after.waiting_since,
            after.request_key,
            before.id,
            before.revision,
        ),
    )


def advance_chain_txn(cur: psycopg.Cursor[Any], event: NewEvent) -> bool:
    """Append ``event`` (a rejection, a suppression) and move the agent's chain head to it, state untouched;
    False if the chain moved on behind the lock."""
    cur.execute(_ADVANCE_CHAIN, (*event.params(), event.seq, event.hash, event.agent_id, event.seq - 1))
    if cur.rowcount != 1:
        return False
    _appended(cur, event)
    return True


def _appended(cur: psycopg.Cursor[Any], event: NewEvent) -> None:
    notify_after_commit(cur.connection, JOURNAL_CHANNEL, f"{event.agent_id}:{event.seq}")


def insert_agent_txn(
    cur: psycopg.Cursor[Any], *, name: str, budget_tokens: int | None, budget_cost: Any
) -> AgentRow | None:
    """Insert a new idle agent, created at the database's clock; None if the name is taken."""
    with cur.connection.cursor(row_factory=AGENT_ROW) as rows:
        rows.execute(_INSERT_AGENT, (name, budget_tokens, budget_cost))
        return rows.fetchone()


def request_as_submitted_txn(
    cur: psycopg.Cursor[Any], agent_id: UUID, request_id: str, input_json: str = "null"
) -> Submitted | None:
    """Agent ``agent_id``'s request ``request_id`` as first submitted, or None if there is no such request, with
    whether its input is ``input_json`` (``same_input``): compared as jsonb's text (``1`` and ``1.0``, ``1`` and
    ``true`` differ; key order and spacing do not), before retention pruned the input as after, when the digest of
    that text stands in for it."""
    with cur.connection.cursor(row_factory=dict_row) as named:
        named.execute(_REQUEST_AS_SUBMITTED, {"agent_id": agent_id, "request_id": request_id, "input": input_json})
        row = named.fetchone()
    if row is None:
        return None
    return Submitted(row["input"], row["submit"], same_input=row["same_input"])


def request_record(conn: psycopg.Connection[Any], agent_id: UUID, request_id: str) -> dict[str, Any] | None:
    """Agent ``agent_id``'s request ``request_id``: its row and its submit event (``revision``, ``details``; None when
    the journal has no submit for it)."""
    with conn.cursor(row_factory=dict_row) as named:
        named.execute(_REQUEST_RECORD, (agent_id, request_id))
        return named.fetchone()


def request_agents(conn: psycopg.Connection[Any], request_id: str) -> list[UUID]:
    """Every agent with a request ``request_id``, first submitted first (for a reader who names no agent)."""
    with conn.cursor() as cur:
        cur.execute(_REQUEST_AGENTS, (request_id,))
        return [row[0] for row in cur.fetchall()]


def set_archived_txn(cur: psycopg.Cursor[Any], event: NewEvent, archived_at: datetime | None) -> bool:
    """Append ``event`` and set (or, with None, clear) the agent's ``archived_at`` with it; False if the chain
    moved on behind the lock."""
    cur.execute(_SET_ARCHIVED, (*event.params(), archived_at, event.seq, event.hash, event.agent_id, event.seq - 1))
    if cur.rowcount != 1:
        return False
    _appended(cur, event)
    return True


_TOMBSTONE_COLUMNS = "name, created_at, deleted_at, deleted_by, phase, revision, request_id, journal_seq, journal_head"
#: A deleted agent's tombstone, mapped by name onto :class:`~models.schemas.DeletedAgent`.
DELETED_AGENT_COLUMNS = f"agent_id AS id, {_TOMBSTONE_COLUMNS}"
_INSERT_TOMBSTONE = (
    f"INSERT INTO audit.deleted_agents (agent_id, {_TOMBSTONE_COLUMNS}) VALUES ({', '.join(['%s'] * 10)})"
)
_AGENT_SCHEDULES = "SELECT name FROM schedules WHERE agent_id = %s ORDER BY name"
# The database accepts the row's deletion only with the tombstone that carries its head (triggers, migration 0006).
_DELETE_AGENT = "DELETE FROM agents WHERE id = %s AND journal_seq = %s AND journal_head = %s"


def agent_schedules_txn(cur: psycopg.Cursor[Any], agent_id: UUID) -> list[str]:
    """The names of the agent's schedules."""
    cur.execute(_AGENT_SCHEDULES, (agent_id,))
    return [r[0] for r in cur.fetchall()]


def delete_agent_txn(cur: psycopg.Cursor[Any], tombstone: DeletedAgent) -> bool:
    """Write the agent's tombstone (its head is the agent's delete event, already appended), remove its schedules and
    its row; False if the row's chain moved on behind the lock (the caller must not commit)."""
    t = tombstone
    cur.execute(
        _INSERT_TOMBSTONE,
        (
            t.id, t.name, t.created_at, t.deleted_at, t.deleted_by, t.phase, t.revision, t.request_id,
            t.journal_seq, t.journal_head,
        ),
    )  # fmt: skip
    cur.execute("DELETE FROM schedules WHERE agent_id = %s", (t.id,))
    cur.execute(_DELETE_AGENT, (t.id, t.journal_seq, t.journal_head))
    return cur.rowcount == 1


def deleted_agent_txn(cur: psycopg.Cursor[Any], agent_id: UUID) -> DeletedAgent | None:
    """The tombstone of agent ``agent_id``, if it was deleted."""
    with cur.connection.cursor(row_factory=dict_row) as named:
        named.execute(f"SELECT {DELETED_AGENT_COLUMNS} FROM audit.deleted_agents WHERE agent_id = %s", (agent_id,))
        row = named.fetchone()
    return None if row is None else DeletedAgent(**row)


def agent_name(db: Database, agent_id: UUID) -> str | None:
    """The agent's name, or None if there is no such agent."""
    with db.connection() as conn:
        row = conn.execute("SELECT name FROM agents WHERE id = %s", (agent_id,)).fetchone()
        end_read(conn)
    return None if row is None else str(row[0])


_AGENT_BY_ID = f"SELECT {AGENT_COLUMNS} FROM agents WHERE id = %s"
_AGENT_BY_NAME = f"SELECT {AGENT_COLUMNS} FROM agents WHERE name = %s"


def find_agent(db: Database, *, agent_id: UUID | None = None, name: str | None = None) -> AgentRow | None:
    """The agent's row by id, else by name (no lock, one statement committed by itself); None if there is none."""
    with db.autocommit() as cur, cur.connection.cursor(row_factory=AGENT_ROW) as named:
        if agent_id is not None:
            named.execute(_AGENT_BY_ID, (agent_id,))
        else:
            named.execute(_AGENT_BY_NAME, (name,))
        return named.fetchone()

"""Deadline SQL: which active agents passed a deadline, judged on the database's clock."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from psycopg import sql
from psycopg.rows import class_row, dict_row

from models.db import Database, end_read


@dataclass(frozen=True, slots=True)
class PastDeadline:
    id: UUID
    hard: bool  # past the hard deadline (stop); otherwise past only the soft one while still at normal priority
    deadline: datetime  # the deadline it passed: with ``id``, where the next batch of the same kind starts
    revision: int  # the agent's revision when it was seen past it: the move applies to that state or to none


# Each kind is a range of its own partial index (ix_agents_hard_deadline, ix_agents_soft_deadline), read from
# where the previous batch ended: a pass costs the agents it moves, never the agents there are. The phases are
# written into the statement (not bound) so that the planner can match the indexes' predicate.
_PAST_HARD = (
    "SELECT id, true AS hard, hard_deadline AS deadline, revision FROM agents"
    " WHERE {active} AND hard_deadline IS NOT NULL AND hard_deadline <= %(at)s"
    " AND (hard_deadline, id) > (%(after_deadline)s, %(after_id)s)"
    " ORDER BY hard_deadline, id LIMIT %(limit)s"
)
_PAST_SOFT = (
    "SELECT id, false AS hard, soft_deadline AS deadline, revision FROM agents"
    " WHERE {active} AND priority = 'normal' AND soft_deadline IS NOT NULL AND soft_deadline <= %(at)s"
    " AND (hard_deadline IS NULL OR hard_deadline > %(at)s)"
    " AND (soft_deadline, id) > (%(after_deadline)s, %(after_id)s)"
    " ORDER BY soft_deadline, id LIMIT %(limit)s"
)
#: Before every deadline and every id: where a pass starts.
START = (datetime(1, 1, 1, tzinfo=UTC), UUID(int=0))


def past_deadline_query(active: Iterable[str], *, hard: bool) -> sql.Composed:
    """The statement of :func:`agents_past_deadline` (parameters ``at``, ``after_deadline``, ``after_id``,
    ``limit``)."""
    phases = sql.SQL("phase IN ({})").format(sql.SQL(", ").join(map(sql.Literal, sorted(active))))
    return sql.SQL(_PAST_HARD if hard else _PAST_SOFT).format(active=phases)


def agents_past_deadline(
    db: Database,
    active: Iterable[str],
    *,
    hard: bool,
    at: datetime,
    after: tuple[datetime, UUID] = START,
    limit: int,
) -> list[PastDeadline]:
    """At most ``limit`` active agents past their hard deadline at ``at`` (``hard``), or past only their soft one
    while still at normal priority, in deadline order after ``after`` (a previous batch's last deadline and id)."""
    query = past_deadline_query(active, hard=hard)
    with db.connection() as conn, conn.cursor(row_factory=class_row(PastDeadline)) as cur:
        cur.execute(query, {"at": at, "after_deadline": after[0], "after_id": after[1], "limit": limit})
        found = cur.fetchall()
        end_read(conn)
    return found


def seen_again(db: Database, past: PastDeadline, active: Iterable[str]) -> PastDeadline | None:
    """``past`` as it is now, if it still passes the very same deadline (so it is the same request: a new one sets
    deadlines of its own) and is still active — at normal priority, for a soft one — with its revision now."""
    column = "hard_deadline" if past.hard else "soft_deadline"
    extra = "" if past.hard else " AND priority = 'normal'"
    with db.connection() as conn, conn.cursor(row_factory=class_row(PastDeadline)) as cur:
        cur.execute(
            f"SELECT id, %(hard)s AS hard, {column} AS deadline, revision FROM agents"
            f" WHERE id = %(id)s AND phase = ANY(%(active)s) AND {column} = %(deadline)s{extra}",
            {"hard": past.hard, "id": past.id, "active": list(active), "deadline": past.deadline},
        )
        found = cur.fetchone()
        end_read(conn)
    return found


def last_event(db: Database, agent_id: UUID) -> dict[str, Any] | None:
    """The agent's latest journal event (kind, event, decision, details), or None."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT kind, event, decision, details FROM audit.journal WHERE agent_id = %s ORDER BY seq DESC LIMIT 1",
            (agent_id,),
        )
        row = cur.fetchone()
        end_read(conn)
    return row

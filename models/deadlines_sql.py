"""Deadline SQL: which active agents passed a deadline, judged on the database's clock."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from psycopg.rows import class_row, dict_row

from models.db import Database


@dataclass(frozen=True, slots=True)
class PastDeadline:
    id: UUID
    hard: bool  # past the hard deadline (stop); otherwise past only the soft one while still at normal priority


def agents_past_deadlines(db: Database, active: Iterable[str], at: datetime | None = None) -> list[PastDeadline]:
    """Active agents past their hard deadline, and those past their soft one while still at normal priority,
    oldest deadline first. ``at`` is the database's ``clock_timestamp()`` unless given (tests)."""
    with db.connection() as conn, conn.cursor(row_factory=class_row(PastDeadline)) as cur:
        cur.execute(
            "WITH t AS (SELECT COALESCE(%(at)s::timestamptz, clock_timestamp()) AS at)"
            " SELECT a.id, COALESCE(a.hard_deadline <= t.at, false) AS hard FROM agents a, t"
            " WHERE a.phase = ANY(%(phases)s)"
            " AND (a.hard_deadline <= t.at OR (a.priority = 'normal' AND a.soft_deadline <= t.at))"
            " ORDER BY COALESCE(a.hard_deadline, a.soft_deadline), a.id",
            {"at": at, "phases": list(active)},
        )
        found = cur.fetchall()
        conn.rollback()
    return found


def last_event(db: Database, agent_id: UUID) -> dict[str, Any] | None:
    """The agent's latest journal event (kind, event, decision, details), or None."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT kind, event, decision, details FROM audit.journal WHERE agent_id = %s ORDER BY seq DESC LIMIT 1",
            (agent_id,),
        )
        row = cur.fetchone()
        conn.rollback()
    return row

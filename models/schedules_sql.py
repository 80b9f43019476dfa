"""Schedule SQL. ``*_txn`` helpers run inside the caller's transaction. Stored times are the database's clock."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row

_COLUMNS = "name, agent_id, every_seconds, cron, operation, input, next_fire_at"


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    name: str
    agent_id: UUID
    every_seconds: int | None
    cron: str | None
    operation: str
    input: Any
    next_fire_at: datetime  # in the session's time zone as psycopg reads it: convert before naming anything


def upsert_schedule_txn(
    cur: psycopg.Cursor[Any],
    *,
    name: str,
    agent_id: UUID,
    every_seconds: int | None,
    cron: str | None,
    operation: str,
    input_json: str,
    first_fire_at: datetime,
) -> tuple[ScheduleRow, bool]:
    """Insert schedule ``name`` or update it in place if its definition changed; returns it and whether it changed."""
    cur.execute(
        "INSERT INTO schedules (name, agent_id, every_seconds, cron, operation, input, next_fire_at,"
        " created_at, updated_at)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, clock_timestamp(), clock_timestamp())"
        " ON CONFLICT (name) DO UPDATE SET agent_id = EXCLUDED.agent_id, every_seconds = EXCLUDED.every_seconds,"
        " cron = EXCLUDED.cron, operation = EXCLUDED.operation, input = EXCLUDED.input,"
        " next_fire_at = EXCLUDED.next_fire_at, updated_at = clock_timestamp()"
        " WHERE (schedules.agent_id, schedules.every_seconds, schedules.cron, schedules.operation, schedules.input)"
        " IS DISTINCT FROM (EXCLUDED.agent_id, EXCLUDED.every_seconds, EXCLUDED.cron, EXCLUDED.operation,"
        " EXCLUDED.input)"
        " RETURNING xmax = 0",
        (name, agent_id, every_seconds, cron, operation, input_json, first_fire_at),
    )
    changed = cur.fetchone() is not None
    with cur.connection.cursor(row_factory=class_row(ScheduleRow)) as rows:
        rows.execute(f"SELECT {_COLUMNS} FROM schedules WHERE name = %s", (name,))
        row = rows.fetchone()
    assert row is not None
    return row, changed


#: Due schedules a batch at a time, through ``ix_schedules_due``.
LOCK_DUE = (
    f"SELECT {_COLUMNS} FROM schedules WHERE enabled AND next_fire_at <= %(at)s"
    " AND (next_fire_at, name) > (%(after_at)s, %(after_name)s)"
    " ORDER BY next_fire_at, name LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
)
#: Before every fire time and name: where a pass starts.
START: tuple[datetime, str] = (datetime(1, 1, 1, tzinfo=UTC), "")


def lock_due_schedules_txn(
    cur: psycopg.Cursor[Any], at: datetime, *, limit: int, after: tuple[datetime, str] = START
) -> list[ScheduleRow]:
    """At most ``limit`` enabled schedules due at ``at`` and after ``after`` in (next fire, name) order, oldest
    fire first, locked; rows another dispatcher holds are skipped. Read through ``ix_schedules_due``: the cost is
    the batch, not the schedules there are. A pass goes on after its last batch's last schedule, so one whose fire
    stayed due (the database could not take it) is tried by the next pass, not again and again by this one."""
    with cur.connection.cursor(row_factory=class_row(ScheduleRow)) as rows:
        rows.execute(LOCK_DUE, {"at": at, "limit": limit, "after_at": after[0], "after_name": after[1]})
        return rows.fetchall()


def agent_archived_txn(cur: psycopg.Cursor[Any], agent_id: UUID) -> bool:
    """Whether the schedule's agent is archived (its fires are skipped, not journaled as refused submits)."""
    cur.execute("SELECT archived_at IS NOT NULL FROM agents WHERE id = %s", (agent_id,))
    found = cur.fetchone()
    return bool(found and found[0])


def record_fire_txn(
    cur: psycopg.Cursor[Any], name: str, *, fired_at: datetime, next_fire_at: datetime, outcome: str
) -> None:
    """Move schedule ``name`` on past the fire at ``fired_at``."""
    cur.execute(
        "UPDATE schedules SET next_fire_at = %s, last_fire_at = %s, last_outcome = %s, updated_at = clock_timestamp()"
        " WHERE name = %s",
        (next_fire_at, fired_at, outcome, name),
    )


def disable_broken_txn(cur: psycopg.Cursor[Any], name: str, *, outcome: str) -> None:
    """Turn schedule ``name`` off, saying why in its last outcome: its next fire time cannot be worked out."""
    cur.execute(
        "UPDATE schedules SET enabled = false, last_outcome = %s, updated_at = clock_timestamp() WHERE name = %s",
        (outcome, name),
    )

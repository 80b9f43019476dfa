"""The journal's monthly partitions (migration 0017, docs/audit-retention.md): which exist, with their bounds and
event counts, and creating the months ahead through ``audit.keel_ensure_partitions``, which the owner owns."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from models.db import Database

# Each partition's bounds, parsed from the catalog's own rendering in UTC ("FOR VALUES FROM (MINVALUE) TO ('…')").
_BOUNDS = (
    "SELECT c.relname AS name,"
    " (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''([^'']+)''\\)'))[1]::timestamptz AS from_at,"
    " (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz AS to_at"
    " FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'audit.journal'::regclass"
)
# Whole months after the current one (UTC) that partitions cover.
_MONTHS_AHEAD = (
    "SELECT (extract(year FROM max(to_at)) * 12 + extract(month FROM max(to_at)))::int"
    " - (extract(year FROM now()) * 12 + extract(month FROM now()))::int - 1 AS months"
    f" FROM ({_BOUNDS}) b"
)


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of the journal: ``from_at`` None for the legacy one (everything before migration 0017's month
    boundary); ``events`` None when not counted."""

    name: str
    from_at: datetime | None
    to_at: datetime
    events: int | None = None


def _utc(cur: psycopg.Cursor[Any]) -> None:
    cur.execute("SET LOCAL TimeZone = 'UTC'")  # bounds render and months count in UTC, as the function makes them


def partitions(db: Database, *, count: bool = False) -> list[Partition]:
    """The journal's partitions, oldest first; with ``count``, each one's number of events (a scan of the journal)."""
    with db.transaction() as cur:
        _utc(cur)
        with cur.connection.cursor(row_factory=dict_row) as named:
            named.execute(f"{_BOUNDS} ORDER BY 2 NULLS FIRST, 1")
            rows = named.fetchall()
            counts: dict[str, int] = {}
            if count:
                named.execute(
                    "SELECT c.relname AS name, count(*) AS events FROM audit.journal j"
                    " JOIN pg_class c ON c.oid = j.tableoid GROUP BY 1"
                )
                counts = {r["name"]: int(r["events"]) for r in named.fetchall()}
    return [Partition(r["name"], r["from_at"], r["to_at"], counts.get(r["name"], 0) if count else None) for r in rows]


def months_ahead(db: Database) -> int:
    """How many whole months after the current one (UTC) the journal's partitions cover: an event's ``at`` outside
    every partition is refused, so this must never reach 0."""
    with db.transaction() as cur:
        _utc(cur)
        cur.execute(_MONTHS_AHEAD)
        row = cur.fetchone()
    return int(row[0]) if row is not None and row[0] is not None else -1


def ensure_partitions(db: Database, months: int) -> list[str]:
    """Create the partitions missing for the current month and the ``months`` after it (1 to 12): empty, of the
    fixed shape, the owner's. Returns the names of those created (none when all were there)."""
    with db.transaction() as cur:
        cur.execute("SELECT * FROM audit.keel_ensure_partitions(%s)", (months,))
        return [str(r[0]) for r in cur.fetchall()]

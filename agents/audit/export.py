"""`keel audit export`: one request's story for an auditor — every journal event carrying its request id, across agents,
oldest first (by the journal's global id), every stored field, as JSON Lines or CSV — read in one snapshot and written a
batch at a time. How ``details``, times and formula-looking CSV cells are written:
docs/explanation/ingress-and-audit.md#exporting-one-requests-story."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import IO, Any, Literal
from uuid import UUID

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from agents.core.commands import check_text
from agents.core.errors import KeelError, quoted
from models.clock import rfc3339
from models.db import Database

Format = Literal["jsonl", "csv"]
FORMATS: tuple[Format, ...] = ("jsonl", "csv")

#: Events fetched per round trip of the server-side cursor.
BATCH = 1000

#: A CSV cell starting with one of these is written with a leading ``'``, so a spreadsheet does not run it as a
#: formula (docs/explanation/ingress-and-audit.md).
CSV_GUARDED = ("=", "+", "-", "@", "\t", "\r", "'")


class NoEvents(KeelError):
    """No journal event of this agent has this request id."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"no journal event of the agent has the request id {quoted(request_id)}: nothing to export")


# The journal's columns in table order, read from the catalog (the schema may have grown: a key id, say); the names
# of the agent (a deleted one's from its tombstone, as "NAME (deleted)") come after the id.
_COLUMNS = (
    "SELECT attname FROM pg_attribute WHERE attrelid = 'audit.journal'::regclass AND attnum > 0 AND NOT attisdropped"
    " ORDER BY attnum"
)
_EXPORT = sql.SQL(
    "SELECT {columns}, coalesce(a.name, d.name || ' (deleted)') AS agent"
    " FROM audit.journal j LEFT JOIN agents a ON a.id = j.agent_id"
    " LEFT JOIN audit.deleted_agents d ON d.agent_id = j.agent_id"
    " WHERE j.agent_id = %s AND j.request_id = %s ORDER BY j.seq"
)


@contextmanager
def request_events(
    db: Database, agent_id: UUID, request_id: str, *, batch: int = BATCH
) -> Iterator[tuple[list[str], Iterator[Any]]]:
    """The columns of an export of agent ``agent_id``'s request ``request_id`` (request ids are each agent's own) and
    its rows (dicts by column name), read lazily through a server-side cursor in
    one read-only snapshot; raises :class:`NoEvents` before anything is yielded when the request has none."""
    check_text("request_id", request_id, limit=200)
    with db.connection() as raw:
        raw.rollback()
        raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        raw.read_only = True
        try:
            table = [row[0] for row in raw.execute(_COLUMNS).fetchall()]
            names = ["id", "agent_id", "agent", *(c for c in table if c not in ("id", "agent_id"))]
            selected = sql.SQL(", ").join(
                sql.SQL("j.details::text AS details") if c == "details" else sql.Identifier("j", c)
                for c in names
                if c != "agent"
            )
            query = _EXPORT.format(columns=selected)
            with raw.cursor(name="keel_audit_export", row_factory=dict_row) as cur:
                cur.itersize = batch
                cur.execute(query, (agent_id, request_id))
                first = cur.fetchmany(batch)
                if not first:
                    raise NoEvents(request_id)

                def rows() -> Iterator[Any]:
                    yield from first
                    yield from cur  # FETCH FORWARD batch, as it is consumed

                yield names, rows()
        finally:
            raw.rollback()
            raw.isolation_level = None
            raw.read_only = None


def _jsonl_value(name: str, value: Any) -> Any:
    if name == "details":
        return json.loads(value)
    if isinstance(value, datetime):
        return rfc3339(value)
    if isinstance(value, int | float | bool) or value is None:
        return value
    return str(value)


def csv_cell(value: Any) -> str:
    """One value as a CSV cell: NULL empty, times in Keel's format, a cell a spreadsheet would run as a formula
    guarded with a leading ``'``."""
    if value is None:
        return ""
    text = rfc3339(value) if isinstance(value, datetime) else str(value)
    return "'" + text if text.startswith(CSV_GUARDED) else text


def csv_cell_value(cell: str) -> str:
    """A CSV cell's text as it was stored: the guard's leading ``'`` taken off (the inverse of :func:`csv_cell`
    for text; an empty cell is NULL)."""
    return cell[1:] if cell.startswith("'") else cell


def write_export(out: IO[str], fmt: Format, columns: list[str], rows: Iterator[Any]) -> int:
    """Write ``rows`` to ``out`` as ``fmt``, one at a time; the number written."""
    written = 0
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\r\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([csv_cell(row[c]) for c in columns])
            written += 1
    else:
        for row in rows:
            out.write(json.dumps({c: _jsonl_value(c, row[c]) for c in columns}, ensure_ascii=False) + "\n")
            written += 1
    return written

"""The console's list of agents, a page at a time, in the order people handle them: waiting for approval first
(longest waiting first), then executing, planning, failed, idle and done, newest first within each; each page read
run by run with keyset conditions in one REPEATABLE READ snapshot. Why, and what a page costs:
docs/explanation/storage-and-jobs.md#the-consoles-agent-list."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from models.db import Database, end_read
from models.schemas import AgentRow
from models.sql import AGENT_COLUMNS, AGENT_ROW

#: The runs of the list, in order.
AGENT_ORDER = ("waiting_approval", "executing", "planning", "failed", "idle", "done")
#: The one run ordered oldest first, by when its agents' waits began.
WAITING = "waiting_approval"
#: That run's order, as its index (``ix_agents_waiting_since``) holds it.
_WAITED = "coalesce(waiting_since, updated_at)"

_WAITING_RUN = f"SELECT {AGENT_COLUMNS} FROM agents WHERE archived_at IS NULL AND phase = 'waiting_approval'"
_PHASE_RUN = f"SELECT {AGENT_COLUMNS} FROM agents WHERE archived_at IS NULL AND phase = %(phase)s"
_PREFIX = " AND starts_with(name, %(prefix)s)"
_WAITING_AFTER = f" AND ({_WAITED}, id) > (%(at)s, %(id)s)"
_PHASE_AFTER = " AND (created_at, id) < (%(at)s, %(id)s)"
_WAITING_ORDER = f" ORDER BY {_WAITED}, id LIMIT %(limit)s"
_PHASE_ORDER = " ORDER BY created_at DESC, id DESC LIMIT %(limit)s"


@dataclass(frozen=True, slots=True)
class AgentKey:
    """Where a page of the list ends: its last agent's phase, its time in that run's order (when its wait began
    while waiting for approval, ``created_at`` otherwise) and its id. The next page starts right after it."""

    phase: str
    at: datetime
    id: UUID

    @classmethod
    def of(cls, row: AgentRow) -> AgentKey:
        if row.phase == WAITING:
            return cls(row.phase, row.waiting_since or row.updated_at, row.id)
        return cls(row.phase, row.created_at, row.id)


def _run_sql(phase: str, *, after: bool, prefix: bool) -> str:
    waiting = phase == WAITING
    sql = _WAITING_RUN if waiting else _PHASE_RUN
    if prefix:
        sql += _PREFIX
    if after:
        sql += _WAITING_AFTER if waiting else _PHASE_AFTER
    return sql + (_WAITING_ORDER if waiting else _PHASE_ORDER)


def agents_page(
    db: Database,
    *,
    phases: Sequence[str] = (),
    after: AgentKey | None = None,
    limit: int,
    name_prefix: str | None = None,
) -> tuple[list[AgentRow], AgentKey | None]:
    """At most ``limit`` agents not archived, in the list's order, from right after ``after`` (None: the first page);
    only those in ``phases`` if given, whose name starts with ``name_prefix`` if given. With them, the key the next
    page starts after (None: this is the last page). ``after.phase`` must be one of the phases listed."""
    runs = [phase for phase in AGENT_ORDER if not phases or phase in phases]
    if after is not None:
        if after.phase not in runs:
            raise ValueError(f"a page key in phase {after.phase!r} does not belong to a list of {runs}")
        runs = runs[runs.index(after.phase) :]
    found: list[AgentRow] = []
    with db.connection() as conn, conn.cursor(row_factory=AGENT_ROW) as cur:
        try:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            for phase in runs:
                keyed = after is not None and after.phase == phase
                params: dict[str, Any] = {"phase": phase, "prefix": name_prefix, "limit": limit + 1 - len(found)}
                if keyed:
                    assert after is not None
                    params.update(at=after.at, id=after.id)
                cur.execute(_run_sql(phase, after=keyed, prefix=bool(name_prefix)), params)
                found.extend(cur.fetchall())
                if len(found) > limit:  # one more than a page: another page follows
                    break
        finally:
            end_read(conn)
    if len(found) > limit:
        page = found[:limit]
        return page, AgentKey.of(page[-1])
    return found, None


# --- sign-outs ---------------------------------------------------------------------------------------------------


def sign_out(db: Database, session_id: str, expires_at: datetime) -> None:
    """Record that the session ``session_id`` was signed out (until it would have expired), and forget the
    sign-outs of sessions that have expired since (the cookie's own lifetime refuses those)."""
    with db.connection() as conn:
        conn.execute(
            "INSERT INTO console_signouts (session_id, expires_at) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            (session_id, expires_at),
        )
        conn.execute("DELETE FROM console_signouts WHERE expires_at < now()")
        conn.commit()


def signed_out(db: Database, session_id: str) -> bool:
    """Whether the session ``session_id`` was signed out."""
    with db.connection() as conn:
        row = conn.execute("SELECT 1 FROM console_signouts WHERE session_id = %s", (session_id,)).fetchone()
        end_read(conn)
    return row is not None

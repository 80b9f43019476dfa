"""Calls waiting for approval across agents: the inbox, and the ones past their tool's approval timeout. An agent
waits on the latest gate step of its request; both queries start from the waiting agents (``ix_agents_waiting``),
find each one's gate by ``ix_jobs_gates``, and take their times from the database's clock."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row

from models.db import Database, end_read

# Whether the waiting call's escalation is journaled (an ``approval_escalated`` event naming its gate).
_ESCALATED = """EXISTS (
    SELECT 1 FROM audit.journal e WHERE e.agent_id = a.id AND e.request_id = a.request_id
    AND e.decision = 'approval_escalated' AND e.details::jsonb->>'gate' = g.key)"""

_WAITING = f"""
SELECT a.id AS agent_id, a.name AS agent, a.revision, a.request_id, g.key, g.target, g.payload,
       g.finished_at AS since, clock_timestamp() AS now, {_ESCALATED} AS escalated
FROM agents a
CROSS JOIN LATERAL (
    SELECT j.key, j.target, j.payload, j.finished_at FROM jobs j
    WHERE j.agent_id = a.id AND j.request_id = a.request_id AND j.operation = 'gate' AND j.status = 'succeeded'
    ORDER BY j.finished_at DESC, j.key DESC LIMIT 1
) g
WHERE a.phase = 'waiting_approval'
"""


@dataclass(frozen=True, slots=True)
class WaitingCall:
    agent_id: UUID
    agent: str
    revision: int
    request_id: str
    key: str  # the gate step's key
    target: str
    payload: dict[str, Any]
    since: datetime
    now: datetime  # the database's clock when read
    escalated: bool  # its approval timeout passed and it was escalated (it waits on)


def waiting_calls(
    db: Database,
    *,
    tool: str | None = None,
    min_age: timedelta | None = None,
    agent_prefix: str | None = None,
    after: tuple[datetime, UUID] | None = None,
    limit: int = 100,
) -> list[WaitingCall]:
    """Calls waiting for approval, oldest first (by when they started waiting, then agent id), at most ``limit``,
    after the keyset ``after`` (``since``, ``agent_id``) of the previous page."""
    sql = _WAITING
    params: dict[str, Any] = {"limit": limit}
    if tool is not None:
        sql += " AND g.payload->>'tool' = %(tool)s"
        params["tool"] = tool
    if min_age is not None:
        sql += " AND g.finished_at <= clock_timestamp() - %(min_age)s"
        params["min_age"] = min_age
    if agent_prefix:
        sql += " AND starts_with(a.name, %(prefix)s)"
        params["prefix"] = agent_prefix
    if after is not None:
        sql += " AND (g.finished_at, a.id) > (%(since)s, %(agent_id)s)"
        params["since"], params["agent_id"] = after
    sql += " ORDER BY g.finished_at, a.id LIMIT %(limit)s"
    with db.connection() as conn, conn.cursor(row_factory=class_row(WaitingCall)) as cur:
        cur.execute(sql, params)
        found = cur.fetchall()
        end_read(conn)
    return found


@dataclass(frozen=True, slots=True)
class Gate:
    """The gate step an agent waiting for approval waits on."""

    key: str
    target: str
    tool: str


def waited_gate_txn(cur: psycopg.Cursor[Any], agent_id: UUID, request_id: str) -> Gate | None:
    """The gate the request's wait for approval is on: its latest finished gate (``ix_jobs_gates``)."""
    with cur.connection.cursor(row_factory=class_row(Gate)) as named:
        named.execute(
            "SELECT key, target, coalesce(payload->>'tool', '') AS tool FROM jobs"
            " WHERE request_id = %s AND agent_id = %s AND operation = 'gate' AND status = 'succeeded'"
            " ORDER BY finished_at DESC, key DESC LIMIT 1",
            (request_id, agent_id),
        )
        return named.fetchone()


def waiting_call(db: Database, agent_id: UUID) -> WaitingCall | None:
    """The call ``agent_id`` waits on, if it waits for approval: since when is when its gate finished, which stays
    put while the agent moves within the wait (an escalation is a move: its ``updated_at`` is not the wait's start)."""
    with db.connection() as conn, conn.cursor(row_factory=class_row(WaitingCall)) as cur:
        cur.execute(_WAITING + " AND a.id = %(agent_id)s", {"agent_id": agent_id})
        found = cur.fetchone()
        end_read(conn)
    return found


def calls_past_approval_timeout(
    db: Database, *, after: tuple[datetime, UUID] | None = None, limit: int | None = None
) -> list[WaitingCall]:
    """Waiting calls whose tool has an approval timeout that has passed, oldest first (by when they started waiting,
    then agent id), at most ``limit``, after the keyset ``after`` (``since``, ``agent_id``) of the previous batch; an
    escalated call whose escalation is journaled already is not among them (it waits on, and is escalated once)."""
    sql = (
        _WAITING + " AND g.payload ? 'approval_timeout_seconds'"
        " AND g.finished_at + make_interval(secs => (g.payload->>'approval_timeout_seconds')::float8)"
        " <= clock_timestamp()"
        f" AND NOT (g.payload->>'on_timeout' = 'escalate' AND {_ESCALATED})"
    )
    params: dict[str, Any] = {}
    if after is not None:
        sql += " AND (g.finished_at, a.id) > (%(since)s, %(agent_id)s)"
        params["since"], params["agent_id"] = after
    sql += " ORDER BY g.finished_at, a.id"
    if limit is not None:
        sql += " LIMIT %(limit)s"
        params["limit"] = limit
    with db.connection() as conn, conn.cursor(row_factory=class_row(WaitingCall)) as cur:
        cur.execute(sql, params)
        found = cur.fetchall()
        end_read(conn)
    return found

"""Reading the journal back: an agent's events, a request's (always with its agent: :func:`request_scope`), the
newest page, what a follower has not seen yet, and a consistent snapshot for reads that must agree with each other."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import select

from agents.core.errors import InvalidInput
from models.db import Database, end_read
from models.schemas import JournalEvent
from models.tables import journal


def request_scope(agent_id: object | None, request_id: str | None) -> None:
    """Refuse a read of a request that names no agent: a request id is its agent's own (another tenant's agent may
    use the same one), so every request-scoped read takes the agent it reads for."""
    if request_id is not None and agent_id is None:
        raise InvalidInput(f"request_id {request_id!r} names a request of one agent: give its agent too")


def events(
    db: Database, *, agent_id: UUID | None = None, request_id: str | None = None, limit: int | None = None
) -> list[JournalEvent]:
    """Journal events, oldest first, of an agent, or of one of its requests (with ``request_id``)."""
    request_scope(agent_id, request_id)
    query = select(journal).order_by(journal.c.id)
    if agent_id is not None:
        query = query.where(journal.c.agent_id == agent_id)
    if request_id is not None:
        query = query.where(journal.c.request_id == request_id)
    if limit is not None:
        query = query.limit(limit)
    with db.engine.connect() as conn:
        events = [JournalEvent.model_validate(r, from_attributes=True) for r in conn.execute(query)]
        conn.commit()  # a read: see models.db.end_read
    return events


def latest_events(
    db: Database,
    *,
    agent_id: UUID | None = None,
    request_id: str | None = None,
    limit: int,
    before: int | None = None,
) -> list[JournalEvent]:
    """Up to ``limit`` journal events, newest first, filtered by agent and/or request, older than ``before``: an
    event ``seq`` of the agent's chain when ``agent_id`` is given (its unique (agent_id, seq) index is read
    backwards), else a journal id (the primary key's, or a request's events by the request_id index). The cost is
    the page's, not the journal's."""
    request_scope(agent_id, request_id)
    if agent_id is not None:
        query = select(journal).where(journal.c.agent_id == agent_id).order_by(journal.c.seq.desc())
        if before is not None:
            query = query.where(journal.c.seq < before)
    else:
        query = select(journal).order_by(journal.c.id.desc())
        if before is not None:
            query = query.where(journal.c.id < before)
    if request_id is not None:
        query = query.where(journal.c.request_id == request_id)
    with db.engine.connect() as conn:
        events = [JournalEvent.model_validate(r, from_attributes=True) for r in conn.execute(query.limit(limit))]
        conn.commit()  # a read: see models.db.end_read
    return events


#: Events read per pass of a follower.
FOLLOW_BATCH = 500
# Per agent, the events past what a follower has seen: "head > seen" skips none and repeats none, as a chain commits
# in seq order (docs/explanation/journal-and-transitions.md#reading-the-journal-while-it-is-written).
_FOLLOW = """
WITH seen AS (SELECT * FROM unnest(%(ids)s::uuid[], %(seqs)s::bigint[]) AS s(agent_id, seq)),
     heads AS (SELECT id, journal_seq FROM agents
               UNION ALL SELECT agent_id, journal_seq FROM audit.deleted_agents)
SELECT j.* FROM heads a
LEFT JOIN seen s ON s.agent_id = a.id
JOIN audit.journal j ON j.agent_id = a.id AND j.seq > coalesce(s.seq, 0)
WHERE a.journal_seq > coalesce(s.seq, 0) AND (%(agent)s::uuid IS NULL OR a.id = %(agent)s::uuid)
ORDER BY j.id
LIMIT %(limit)s
"""


def events_after(
    db: Database,
    seen: Mapping[UUID, int],
    *,
    agent_id: UUID | None = None,
    request_id: str | None = None,
    limit: int = FOLLOW_BATCH,
) -> list[JournalEvent]:
    """The events committed past ``seen`` (agent id -> last seq read; absent: none read), in time order, at most
    ``limit``; each agent's events come as a prefix of its chain, so a caller that advances ``seen`` by what it got
    and asks again reads every event once. With ``request_id`` only that request's agent is read (the caller
    filters its other requests' events out, after advancing ``seen`` past them)."""
    request_scope(agent_id, request_id)
    params = {
        "ids": list(seen),
        "seqs": list(seen.values()),
        "agent": agent_id,
        "limit": limit,
    }
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_FOLLOW, params)
        rows = cur.fetchall()
        end_read(conn)
    return [JournalEvent.model_validate(r) for r in rows]


def events_at_revision(db: Database, agent_id: UUID, revision: int, *, limit: int = 100) -> list[JournalEvent]:
    """An agent's events at ``revision``: the transition that moved it there, and what was refused or suppressed
    while it stood there, oldest first."""
    query = (
        select(journal)
        .where(journal.c.agent_id == agent_id, journal.c.revision == revision)
        .order_by(journal.c.seq)
        .limit(limit)
    )
    with db.engine.connect() as conn:
        events = [JournalEvent.model_validate(r, from_attributes=True) for r in conn.execute(query)]
        conn.commit()  # a read: see models.db.end_read
    return events


# One agent's chain is appended under its row's lock, so its events commit in seq order: a snapshot that holds
# event n holds every event before it, and "seq > seen" never skips one (the unique (agent_id, seq) index serves it).
_AGENT_AFTER = "SELECT * FROM audit.journal WHERE agent_id = %s AND seq > %s ORDER BY seq LIMIT %s"


def agent_events_after(
    db: Database, agent_id: UUID, after_seq: int, *, limit: int = FOLLOW_BATCH
) -> list[JournalEvent]:
    """The agent's journal events with ``seq > after_seq``, in seq order, at most ``limit``: a follower that asks
    again after the last one it got reads every committed event once, with no gap (a deleted agent's too)."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_AGENT_AFTER, (agent_id, after_seq, limit))
        rows = cur.fetchall()
        end_read(conn)
    return [JournalEvent.model_validate(r) for r in rows]


# Named apart from the verify's _HEADS below, which would otherwise replace it.
_SEQ_HEADS = "SELECT id, journal_seq FROM agents WHERE id = ANY(%s)"


def journal_heads(db: Database, agent_ids: list[UUID]) -> dict[UUID, int]:
    """The seq of each of these agents' last journal event (a deleted agent is left out): one statement for all."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_SEQ_HEADS, (agent_ids,))
        rows = cur.fetchall()
        end_read(conn)
    return {row["id"]: row["journal_seq"] for row in rows}


@contextmanager
def snapshot(db: Database) -> Iterator[psycopg.Connection[Any]]:
    # Heads, seals and chains read in one snapshot: transitions committing meanwhile cannot look like tampering.
    with db.connection() as raw:
        raw.rollback()
        raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        raw.read_only = True
        try:
            yield raw
        finally:
            raw.rollback()
            raw.isolation_level = None
            raw.read_only = None

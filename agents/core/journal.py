"""The immutable journal: appending events to an agent's hash chain, reading them back, verifying the chains.

Each event stores the hash of the agent's previous event (``prev_hash``) and its own hash over every field, so a
changed, removed or reordered event breaks the chain at that point. The agent row stores the chain's head; a deleted
agent's tombstone (``audit.deleted_agents``) stores its last one, the agent's delete event.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row, dict_row
from sqlalchemy import select

from agents.core.errors import LostUpdate
from agents.core.redaction import redact_value
from models.clock import rfc3339
from models.db import Database
from models.schemas import AgentRow, JournalEvent
from models.sql import NewEvent, advance_chain_txn
from models.tables import GENESIS_HASH, journal


def canonical_json(value: Mapping[str, Any]) -> str:
    """The one JSON text of ``value`` that is hashed and stored; a time in it is written in Keel's one format."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain)


def _plain(value: Any) -> str:
    return rfc3339(value) if isinstance(value, datetime) else str(value)


def event_hash(
    *,
    prev_hash: str,
    agent_id: UUID,
    seq: int,
    kind: str,
    event: str,
    actor: str,
    request_id: str | None,
    from_phase: str | None,
    to_phase: str | None,
    revision: int,
    decision: str,
    details_json: str,
    at: datetime,
) -> str:
    """sha256 over the previous hash and every field of the event, in a fixed unambiguous encoding."""
    fields = [
        prev_hash,
        str(agent_id),
        seq,
        kind,
        event,
        actor,
        request_id,
        from_phase,
        to_phase,
        revision,
        decision,
        details_json,
        at.astimezone(UTC).isoformat(),
    ]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()


def new_event(
    row: AgentRow,
    *,
    kind: str,
    event: str,
    actor: str,
    request_id: str | None,
    from_phase: str | None,
    to_phase: str | None,
    revision: int,
    decision: str,
    details: Mapping[str, Any],
    at: datetime,
) -> NewEvent:
    """The next event of ``row``'s chain, hashed onto its head (the caller holds the row's lock)."""
    fields: dict[str, Any] = {
        "agent_id": row.id,
        "seq": row.journal_seq + 1,
        "kind": kind,
        "event": event,
        "actor": actor,
        "request_id": request_id,
        "from_phase": from_phase,
        "to_phase": to_phase,
        "revision": revision,
        "decision": decision,
        # The one place every journaled detail passes through: secrets are masked before they are hashed and kept.
        "details_json": canonical_json(redact_value(details)),
        "at": at,
    }
    return NewEvent(**fields, prev_hash=row.journal_head, hash=event_hash(prev_hash=row.journal_head, **fields))


def append_side_event_txn(
    cur: psycopg.Cursor[Any],
    row: AgentRow,
    *,
    kind: str,
    event: str,
    actor: str,
    decision: str,
    details: Mapping[str, Any],
    at: datetime,
    request_id: str | None = None,
) -> NewEvent:
    """Journal an event that leaves the agent's state as it is (created, rejected, suppressed); move the head."""
    appended = new_event(
        row,
        kind=kind,
        event=event,
        actor=actor,
        request_id=request_id if request_id is not None else row.request_id,
        from_phase=row.phase,
        to_phase=row.phase,
        revision=row.revision,
        decision=decision,
        details=details,
        at=at,
    )
    if not advance_chain_txn(cur, appended):
        raise LostUpdate(f"agent {row.id}'s journal chain is no longer at event {row.journal_seq}")
    return appended


def events(
    db: Database, *, agent_id: UUID | None = None, request_id: str | None = None, limit: int | None = None
) -> list[JournalEvent]:
    """Journal events, oldest first, filtered by agent and/or request."""
    query = select(journal).order_by(journal.c.id)
    if agent_id is not None:
        query = query.where(journal.c.agent_id == agent_id)
    if request_id is not None:
        query = query.where(journal.c.request_id == request_id)
    if limit is not None:
        query = query.limit(limit)
    with db.engine.connect() as conn:
        return [JournalEvent.model_validate(r, from_attributes=True) for r in conn.execute(query)]


# Per agent, the events past the position a follower has seen. An agent's chain is appended under its row's lock
# and its head moves in the same transaction, so within one statement's snapshot "head > seen" finds exactly the
# committed events a follower lacks: none skipped (a global id can commit out of order, a chain cannot), none twice.
#: Events read per pass of a follower.
FOLLOW_BATCH = 500
# A deleted agent's head is its tombstone's, written with its delete event: a follower reads that event too.
_FOLLOW = """
WITH seen AS (SELECT * FROM unnest(%(ids)s::uuid[], %(seqs)s::bigint[]) AS s(agent_id, seq)),
     heads AS (SELECT id, journal_seq FROM agents
               UNION ALL SELECT agent_id, journal_seq FROM audit.deleted_agents)
SELECT j.* FROM heads a
LEFT JOIN seen s ON s.agent_id = a.id
JOIN audit.journal j ON j.agent_id = a.id AND j.seq > coalesce(s.seq, 0)
WHERE a.journal_seq > coalesce(s.seq, 0) AND (%(agent)s::uuid IS NULL OR a.id = %(agent)s::uuid)
  AND (%(request)s::text IS NULL OR a.id IN (SELECT agent_id FROM requests WHERE request_id = %(request)s::text))
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
    params = {
        "ids": list(seen),
        "seqs": list(seen.values()),
        "agent": agent_id,
        "request": request_id,
        "limit": limit,
    }
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_FOLLOW, params)
        rows = cur.fetchall()
        conn.rollback()
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
        return [JournalEvent.model_validate(r, from_attributes=True) for r in conn.execute(query)]


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
        conn.rollback()
    return [JournalEvent.model_validate(r) for r in rows]


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """The first broken link of one agent's chain."""

    agent_id: UUID
    seq: int
    journal_id: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    agents: int
    events: int
    breaks: tuple[ChainBreak, ...]

    @property
    def ok(self) -> bool:
        return not self.breaks


# The hashed fields, in event_hash's keyword names; the chain query selects them in this order after id and hash.
_HASHED = (
    "prev_hash", "seq", "kind", "event", "actor", "request_id", "from_phase", "to_phase", "revision", "decision",
    "details_json", "at",
)  # fmt: skip
_CHAIN_QUERY = (
    "SELECT id, hash, prev_hash, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,"
    " details::text AS details_json, at FROM audit.journal WHERE agent_id = %s ORDER BY seq"
)


@dataclass(frozen=True, slots=True)
class _Head:
    agent_id: UUID
    seq: int
    hash: str
    revision: int
    phase: str
    request_id: str | None
    deleted: bool  # the head is a deleted agent's tombstone: its chain must end with its delete event


# Every chain's head: an agent row's, or a deleted agent's tombstone's.
_HEADS = (
    "SELECT id AS agent_id, journal_seq AS seq, journal_head AS hash, revision, phase, request_id, false AS deleted"
    " FROM agents UNION ALL"
    " SELECT agent_id, journal_seq, journal_head, revision, phase, request_id, true FROM audit.deleted_agents"
    " ORDER BY agent_id"
)
# Events of an agent that has neither a row nor a tombstone: removed behind Keel's back, head and all.
_HEADLESS = (
    "SELECT j.agent_id, min(j.seq) AS seq, min(j.id) AS id FROM audit.journal j"
    " WHERE NOT EXISTS (SELECT 1 FROM agents a WHERE a.id = j.agent_id)"
    " AND NOT EXISTS (SELECT 1 FROM audit.deleted_agents d WHERE d.agent_id = j.agent_id)"
    " GROUP BY j.agent_id ORDER BY j.agent_id"
)


def _is_delete(fields: dict[str, Any]) -> bool:
    return bool(fields["kind"] == "operator" and fields["event"] == "delete")


def _first_break(rows: Iterator[dict[str, Any]], head: _Head) -> tuple[int, ChainBreak | None]:
    agent_id = head.agent_id
    expected_prev, expected_seq, count = GENESIS_HASH, 1, 0
    state: tuple[int, str | None, str | None] = (0, "idle", None)  # revision, phase, request as the journal tells
    deleted_at = 0  # the seq of the agent's delete event: nothing may follow it
    for row in rows:
        count += 1
        jid, digest = row["id"], row["hash"]
        fields = {name: row[name] for name in _HASHED}
        seq = fields["seq"]
        if deleted_at:
            return count, ChainBreak(agent_id, seq, jid, f"event {seq} follows the agent's delete event {deleted_at}")
        if seq != expected_seq:
            return count, ChainBreak(agent_id, expected_seq, jid, f"event {expected_seq} is missing (found {seq})")
        if fields["prev_hash"] != expected_prev:
            return count, ChainBreak(agent_id, seq, jid, "prev_hash does not match the previous event's hash")
        if event_hash(agent_id=agent_id, **fields) != digest:
            return count, ChainBreak(agent_id, seq, jid, "the event's content does not match its hash")
        if fields["kind"] == "transition":
            state = (fields["revision"], fields["to_phase"], fields["request_id"])
        if _is_delete(fields):
            deleted_at = seq
        expected_prev, expected_seq = digest, seq + 1
    last = expected_seq - 1
    if last < head.seq:
        reason = (
            f"event {expected_seq} is missing: the chain ends at event {last} but the agent's head is event {head.seq}"
        )
        return count, ChainBreak(agent_id, expected_seq, None, reason)
    if last > head.seq or expected_prev != head.hash:
        return count, ChainBreak(agent_id, last, None, "the agent's head does not match its last event")
    if head.deleted and not deleted_at:
        reason = f"the agent was deleted (its tombstone's head is event {head.seq}) but that is not its delete event"
        return count, ChainBreak(agent_id, last, None, reason)
    if deleted_at and not head.deleted:
        reason = f"event {deleted_at} deleted the agent, but its row is still there and it has no tombstone"
        return count, ChainBreak(agent_id, last, None, reason)
    if state != (head.revision, head.phase, head.request_id):
        reason = (
            f"the agent row says revision {head.revision} ({head.phase}, request {head.request_id}) but its last"
            f" transition event says revision {state[0]} ({state[1]}, request {state[2]})"
        )
        return count, ChainBreak(agent_id, last, None, reason)
    return count, None


def verify_chain(db: Database, agent_id: UUID) -> ChainBreak | None:
    """Walk one agent's chain (what :func:`verify` does for every agent): its first broken link, or None when the
    chain is intact from genesis to its head. An agent with no head at all is a break too."""
    with db.connection() as raw:
        raw.rollback()
        raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        raw.read_only = True
        try:
            with raw.cursor(row_factory=class_row(_Head)) as heads_cur:
                heads_cur.execute(f"SELECT * FROM ({_HEADS}) h WHERE h.agent_id = %s", (agent_id,))
                head = heads_cur.fetchone()
            if head is None:
                return ChainBreak(agent_id, 0, None, "the agent has neither a row nor a tombstone")
            with raw.cursor(row_factory=dict_row) as cur:
                cur.execute(_CHAIN_QUERY, (agent_id,))
                return _first_break(iter(cur), head)[1]
        finally:
            raw.rollback()
            raw.isolation_level = None
            raw.read_only = None


@dataclass(frozen=True, slots=True)
class JournalPage:
    """A window of one agent's chain (events ``first_seq``..``last_seq``, shown newest first) and what was checked of
    it: each event's content against its hash, each one's link to the one before — the first one's to event
    ``first_seq - 1``'s stored hash, or to the chain's start — and, when the window reaches the agent's head, that
    the head is its last event and the agent's state its last transition's. Nothing before ``first_seq - 1`` was
    read: only a full walk (:func:`verify_chain`, ``keel audit verify``) vouches for those."""

    events: tuple[JournalEvent, ...]
    first_seq: int
    last_seq: int
    head_seq: int
    broken: ChainBreak | None

    @property
    def at_head(self) -> bool:
        return self.last_seq == self.head_seq

    @property
    def older(self) -> int | None:
        """Where the next (older) page ends: before the first event shown, if there is any before it."""
        return self.first_seq if self.first_seq > 1 else None


_WINDOW_QUERY = (
    "SELECT *, details::text AS details_json FROM audit.journal WHERE agent_id = %s AND seq BETWEEN %s AND %s"
    " ORDER BY seq"
)


def journal_page(db: Database, agent_id: UUID, *, before: int | None, limit: int) -> JournalPage | None:
    """Up to ``limit`` of the agent's events before event ``before`` (None: its latest), checked as
    :class:`JournalPage` says, in one snapshot with the agent's row; None when the agent has no row. The cost is
    the window's, not the chain's: one index range read of ``limit + 1`` events."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    with db.connection() as raw:
        raw.rollback()
        raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        raw.read_only = True
        try:
            with raw.cursor(row_factory=class_row(_Head)) as heads_cur:
                heads_cur.execute(
                    "SELECT id AS agent_id, journal_seq AS seq, journal_head AS hash, revision, phase, request_id,"
                    " false AS deleted FROM agents WHERE id = %s",
                    (agent_id,),
                )
                head = heads_cur.fetchone()
            if head is None:
                return None
            last = head.seq if before is None else min(before - 1, head.seq)
            first = max(1, last - limit + 1)
            with raw.cursor(row_factory=dict_row) as cur:
                # One event past the head too, if there is one: nothing may follow the head.
                cur.execute(_WINDOW_QUERY, (agent_id, first - 1, last + 1 if last == head.seq else last))
                rows = cur.fetchall()
        finally:
            raw.rollback()
            raw.isolation_level = None
            raw.read_only = None
    shown = [row for row in rows if first <= row["seq"] <= last]
    broken = _window_break(agent_id, rows, first, last, head)
    events = tuple(JournalEvent.model_validate(row) for row in reversed(shown))
    return JournalPage(events, first, last, head.seq, broken)


def _window_break(agent_id: UUID, rows: list[dict[str, Any]], first: int, last: int, head: _Head) -> ChainBreak | None:
    """The first broken link among events ``first``..``last`` (``rows`` may hold event ``first - 1``, read only for
    its hash, and at the head event ``last + 1``, which must not exist)."""
    if last < first:
        return None
    by_seq = {row["seq"]: row for row in rows}
    expected_prev = GENESIS_HASH if first == 1 else None
    if first > 1:
        before = by_seq.get(first - 1)
        if before is None:
            return ChainBreak(agent_id, first - 1, None, f"event {first - 1} is missing")
        expected_prev = before["hash"]
    state: tuple[int, str | None, str | None] | None = None
    for seq in range(first, last + 1):
        row = by_seq.get(seq)
        if row is None:
            return ChainBreak(agent_id, seq, None, f"event {seq} is missing")
        fields = {name: row[name] for name in _HASHED}
        if fields["prev_hash"] != expected_prev:
            return ChainBreak(agent_id, seq, row["id"], "prev_hash does not match the previous event's hash")
        if event_hash(agent_id=agent_id, **fields) != row["hash"]:
            return ChainBreak(agent_id, seq, row["id"], "the event's content does not match its hash")
        if fields["kind"] == "transition":
            state = (fields["revision"], fields["to_phase"], fields["request_id"])
        expected_prev = row["hash"]
    if last == head.seq:
        if last + 1 in by_seq:
            return ChainBreak(agent_id, last + 1, by_seq[last + 1]["id"], f"event {last + 1} follows the agent's head")
        if expected_prev != head.hash:
            return ChainBreak(agent_id, last, None, "the agent's head does not match its last event")
        if state is not None and state != (head.revision, head.phase, head.request_id):
            return ChainBreak(
                agent_id,
                last,
                None,
                f"the agent row says revision {head.revision} ({head.phase}, request {head.request_id}) but its last"
                f" transition event says revision {state[0]} ({state[1]}, request {state[2]})",
            )
    return None


def verify(db: Database) -> VerifyReport:
    """Walk every agent's chain from genesis to its head (a deleted agent's: to its tombstone's, which must be its
    delete event); report the first broken link of each broken chain, and chains that have no head at all.

    Heads and chains are read in one snapshot, so transitions committing meanwhile cannot look like tampering.
    """
    breaks: list[ChainBreak] = []
    total = 0
    with db.connection() as raw:
        raw.rollback()
        raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        raw.read_only = True
        try:
            with raw.cursor(row_factory=class_row(_Head)) as heads_cur:
                heads_cur.execute(_HEADS)
                heads = heads_cur.fetchall()
            for head in heads:
                with raw.cursor(row_factory=dict_row) as cur:
                    cur.execute(_CHAIN_QUERY, (head.agent_id,))
                    count, broken = _first_break(iter(cur), head)
                total += count
                if broken is not None:
                    breaks.append(broken)
            with raw.cursor(row_factory=dict_row) as cur:
                cur.execute(_HEADLESS)
                for row in cur:
                    reason = "the agent has neither a row nor a tombstone: it was removed without keel agent delete"
                    breaks.append(ChainBreak(row["agent_id"], row["seq"], row["id"], reason))
        finally:
            raw.rollback()
            raw.isolation_level = None
            raw.read_only = None
    return VerifyReport(agents=len(heads), events=total, breaks=tuple(breaks))

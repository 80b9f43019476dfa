"""The immutable journal: appending events to an agent's keyed chain, reading them back, verifying the chains.

Each event stores the hash of the agent's previous event (``prev_hash``) and its own ``hash``: an HMAC-SHA256 under
an audit key (models/audit_keys.py) over the previous hash and every field of the event, and the id of that key
(``key_id``). A changed, removed, inserted or reordered event breaks the chain at that point, and without the key no
one can compute a link that fits — not by re-hashing one event, not by recomputing the whole chain (with plain
sha256, or under a key of their own). The agent row stores the chain's head; a deleted agent's tombstone
(``audit.deleted_agents``) stores its last one, the agent's delete event.

Why an HMAC on every event rather than Ed25519-signed checkpoints: each event is keyed in the very transaction that
writes it, so there is no window between checkpoints in which recent events are linked only by an unkeyed hash that
anyone with write access to the database could recompute; and it costs one HMAC per transition (microseconds), no
signing service, no checkpoint schedule. The price: checking needs the secret, so whoever verifies (the auditor, the
beat's periodic verify, the console) holds the key that could also forge links; a leaked key lets its holder forge
links under it that verify accepts, even after new events have moved to another key. Signed checkpoints would let
anyone check with a public key and keep the forging key with the writer alone; a copy of the journal kept in a
separate store is where that kind of outside check belongs.

Keys rotate: every event stores its key's id, so new events take the new key (``KEEL_AUDIT_KEY_ID``) while the old
keys stay in the ring (``KEEL_AUDIT_KEYS``) to check the events they linked. An event whose key is not in the ring is
reported as not checked (the chain's other links are still checked), never as intact, never as tampered.

Legacy events, written before the journal was keyed (migration 0015), have no key id and a plain sha256 ``hash``;
they are checked as they were written. The upgrade sealed each chain's length and head at that moment under the key
(``audit.legacy_chains``), and the chain's first keyed event links onto that head, so a legacy event changed after
the upgrade breaks the chain, and an unkeyed event anywhere else is a break too. What was changed before the upgrade,
by someone who recomputed the plain chain, cannot be told.

From the database alone, no chain check can tell that the newest events of a chain were cut off by someone who also
rewound the agent row's head (a superuser): that is what the shipped copy of the journal is for.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row, dict_row
from sqlalchemy import select

from agents.core.errors import LostUpdate
from agents.core.redaction import redact_value
from models.audit_keys import AuditKeyMissing, AuditKeys, legacy_seal_parts
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


def _linked(
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
) -> list[str | int | None]:
    # The fields a link covers, in a fixed order; written as one JSON array, which no other list of them shares.
    return [
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
    """The unkeyed link of a legacy event (written before migration 0015): sha256 over the previous hash and every
    field of the event, in a fixed unambiguous encoding. Anyone can compute it: new events use :func:`event_mac`."""
    fields = _linked(
        prev_hash, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,
        details_json, at,
    )  # fmt: skip
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()


#: Starts what an event's HMAC covers, so no other use of the audit key (a legacy seal) shares its input.
_EVENT_TAG = "keel-journal-v1"


def mac_parts(
    key_id: str,
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
) -> list[str | int | None]:
    """What an event's HMAC covers: the fields :func:`event_hash` covers, and the id of the key."""
    return [
        _EVENT_TAG,
        key_id,
        *_linked(
            prev_hash, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,
            details_json, at,
        ),
    ]  # fmt: skip


def event_mac(keys: AuditKeys, key_id: str, **fields: Any) -> str:
    """An event's keyed link: HMAC-SHA256 under key ``key_id`` of :func:`mac_parts` (``fields``: its keywords)."""
    return keys.mac(key_id, mac_parts(key_id, **fields))


def signing_keys(db: Database) -> AuditKeys:
    """The key ring journal events are linked with, or :class:`~models.audit_keys.AuditKeyMissing` (before anything
    is written) when ``db`` has none."""
    if db.audit_keys is None:
        raise AuditKeyMissing()
    return db.audit_keys


def new_event(
    row: AgentRow,
    *,
    keys: AuditKeys,
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
    """The next event of ``row``'s chain, linked onto its head with an HMAC under the ring's current key (the
    caller holds the row's lock)."""
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
    digest = event_mac(keys, keys.current, prev_hash=row.journal_head, **fields)
    return NewEvent(**fields, prev_hash=row.journal_head, hash=digest, key_id=keys.current)


def append_side_event_txn(
    cur: psycopg.Cursor[Any],
    row: AgentRow,
    *,
    keys: AuditKeys,
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
        keys=keys,
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
class Unchecked:
    """Events of one chain whose links could not be checked: their key (``key_id``) is not in the ring, or there is
    no ring. ``seq`` is the first of them. A legacy part whose seal's key is missing counts as its events."""

    agent_id: UUID
    key_id: str
    seq: int
    events: int


@dataclass(frozen=True, slots=True)
class LegacyPart:
    """Events 1 to ``events`` of one chain were written before the journal was keyed: checked with plain sha256,
    protected by the seal the upgrade (migration 0015) put on them, not before it."""

    agent_id: UUID
    events: int


@dataclass(frozen=True, slots=True)
class ChainCheck:
    """What checking one chain found: its first broken link (None: none), the events it could not check, and how
    many of its events are legacy (unkeyed)."""

    agent_id: UUID
    events: int
    broken: ChainBreak | None
    unchecked: tuple[Unchecked, ...] = ()
    legacy: int = 0

    @property
    def ok(self) -> bool:
        """Every link checked and intact."""
        return self.broken is None and not self.unchecked


@dataclass(frozen=True, slots=True)
class VerifyReport:
    agents: int
    events: int
    breaks: tuple[ChainBreak, ...]
    unchecked: tuple[Unchecked, ...] = ()
    legacy: tuple[LegacyPart, ...] = ()
    #: The ids of the keys the verify held (empty: none, and no keyed link could be checked).
    key_ids: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No broken link, and every link checked: events whose key was missing are not called intact."""
        return not self.breaks and not self.unchecked


# The linked fields, in _linked's keyword names; the chain query selects them after id, hash and key_id.
_HASHED = (
    "prev_hash", "seq", "kind", "event", "actor", "request_id", "from_phase", "to_phase", "revision", "decision",
    "details_json", "at",
)  # fmt: skip
_CHAIN_QUERY = (
    "SELECT id, hash, key_id, prev_hash, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,"
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


@dataclass(frozen=True, slots=True)
class _Seal:
    """A chain's legacy part as migration 0015 sealed it."""

    agent_id: UUID
    seq: int
    head: str
    key_id: str
    seal: str


# Every chain's head: an agent row's, or a deleted agent's tombstone's.
_HEADS = (
    "SELECT id AS agent_id, journal_seq AS seq, journal_head AS hash, revision, phase, request_id, false AS deleted"
    " FROM agents UNION ALL"
    " SELECT agent_id, journal_seq, journal_head, revision, phase, request_id, true FROM audit.deleted_agents"
    " ORDER BY agent_id"
)
_SEALS = "SELECT agent_id, seq, head, key_id, seal FROM audit.legacy_chains"
# Events of an agent that has neither a row nor a tombstone: removed behind Keel's back, head and all.
_HEADLESS = (
    "SELECT j.agent_id, min(j.seq) AS seq, min(j.id) AS id FROM audit.journal j"
    " WHERE NOT EXISTS (SELECT 1 FROM agents a WHERE a.id = j.agent_id)"
    " AND NOT EXISTS (SELECT 1 FROM audit.deleted_agents d WHERE d.agent_id = j.agent_id)"
    " GROUP BY j.agent_id ORDER BY j.agent_id"
)


def _is_delete(fields: dict[str, Any]) -> bool:
    return bool(fields["kind"] == "operator" and fields["event"] == "delete")


def _seal_holds(seal: _Seal, keys: AuditKeys) -> bool:
    return keys.verifies(seal.key_id, legacy_seal_parts(str(seal.agent_id), seal.seq, seal.head), seal.seal)


def _check_chain(rows: Iterator[dict[str, Any]], head: _Head, seal: _Seal | None, keys: AuditKeys | None) -> ChainCheck:
    agent_id = head.agent_id
    expected_prev, expected_seq, count, legacy = GENESIS_HASH, 1, 0, 0
    state: tuple[int, str | None, str | None] = (0, "idle", None)  # revision, phase, request as the journal tells
    deleted_at = 0  # the seq of the agent's delete event: nothing may follow it
    keyed_at = 0  # the seq of the chain's first keyed event: no unkeyed event may follow it
    unchecked: dict[str, list[int]] = {}  # key id -> [first seq, events]

    def found(seq: int, jid: int | None, reason: str) -> ChainCheck:
        missing = tuple(Unchecked(agent_id, k, first, n) for k, (first, n) in unchecked.items())
        return ChainCheck(agent_id, count, ChainBreak(agent_id, seq, jid, reason), missing, legacy)

    def not_checked(key_id: str, seq: int, events: int = 1) -> None:
        entry = unchecked.setdefault(key_id, [seq, 0])
        entry[1] += events

    if seal is not None:
        if keys is None or seal.key_id not in keys:
            not_checked(seal.key_id, 1, seal.seq)
        elif not _seal_holds(seal, keys):
            return found(
                seal.seq,
                None,
                f"the seal on events 1-{seal.seq} (audit.legacy_chains) does not match its HMAC under key"
                f" {seal.key_id!r}: it was not written by the upgrade that keyed the journal",
            )
    for row in rows:
        count += 1
        jid, digest, key_id = row["id"], row["hash"], row["key_id"]
        fields = {name: row[name] for name in _HASHED}
        seq = fields["seq"]
        if deleted_at:
            return found(seq, jid, f"event {seq} follows the agent's delete event {deleted_at}")
        if seq != expected_seq:
            return found(expected_seq, jid, f"event {expected_seq} is missing (found {seq})")
        if fields["prev_hash"] != expected_prev:
            return found(seq, jid, "prev_hash does not match the previous event's hash")
        if key_id is None:
            if keyed_at:
                return found(
                    seq,
                    jid,
                    f"event {seq} has no key but follows keyed event {keyed_at}: it was written without the key",
                )
            if seal is None:
                return found(
                    seq,
                    jid,
                    f"event {seq} has no key, and this chain had no events when the journal was keyed: it was written"
                    " without the key",
                )
            if seq > seal.seq:
                return found(
                    seq,
                    jid,
                    f"event {seq} has no key, but only events 1-{seal.seq} of this chain were written before the"
                    " journal was keyed: it was written without the key",
                )
            if event_hash(agent_id=agent_id, **fields) != digest:
                return found(seq, jid, "the event's content does not match its hash")
            if seq == seal.seq and digest != seal.head:
                return found(
                    seq,
                    jid,
                    f"events 1-{seq} were written before the journal was keyed, but they no longer end at the head"
                    " sealed then: one of them was changed",
                )
            legacy += 1
        else:
            if seal is not None and seq <= seal.seq:
                return found(
                    seq,
                    jid,
                    f"event {seq} has key {key_id!r}, but the upgrade that keyed the journal sealed events"
                    f" 1-{seal.seq} as written without one",
                )
            keyed_at = keyed_at or seq
            if keys is None or key_id not in keys:
                not_checked(key_id, seq)
            elif not keys.verifies(key_id, mac_parts(key_id, agent_id=agent_id, **fields), digest):
                return found(
                    seq,
                    jid,
                    f"the event's content does not match its HMAC under key {key_id!r}: it was changed or forged"
                    " (or KEEL_AUDIT_KEYS holds another secret under that id)",
                )
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
        return found(expected_seq, None, reason)
    if seal is not None and last < seal.seq:
        reason = (
            f"event {expected_seq} is missing: the chain ends at event {last} but it had {seal.seq} events when the"
            " journal was keyed"
        )
        return found(expected_seq, None, reason)
    if last > head.seq or expected_prev != head.hash:
        return found(last, None, "the agent's head does not match its last event")
    if head.deleted and not deleted_at:
        reason = f"the agent was deleted (its tombstone's head is event {head.seq}) but that is not its delete event"
        return found(last, None, reason)
    if deleted_at and not head.deleted:
        reason = f"event {deleted_at} deleted the agent, but its row is still there and it has no tombstone"
        return found(last, None, reason)
    if state != (head.revision, head.phase, head.request_id):
        reason = (
            f"the agent row says revision {head.revision} ({head.phase}, request {head.request_id}) but its last"
            f" transition event says revision {state[0]} ({state[1]}, request {state[2]})"
        )
        return found(last, None, reason)
    missing = tuple(Unchecked(agent_id, k, first, n) for k, (first, n) in unchecked.items())
    return ChainCheck(agent_id, count, None, missing, legacy)


@contextmanager
def _snapshot(db: Database) -> Iterator[psycopg.Connection[Any]]:
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
    #: Events shown whose link is keyed with a key this process's ring lacks: their links were not checked.
    unchecked: int = 0

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
    broken, unchecked = _window_break(agent_id, rows, first, last, head, db.audit_keys)
    events = tuple(JournalEvent.model_validate(row) for row in reversed(shown))
    return JournalPage(events, first, last, head.seq, broken, unchecked)


def _window_break(
    agent_id: UUID, rows: list[dict[str, Any]], first: int, last: int, head: _Head, keys: AuditKeys | None
) -> tuple[ChainBreak | None, int]:
    """The first broken link among events ``first``..``last`` (``rows`` may hold event ``first - 1``, read only for
    its hash, and at the head event ``last + 1``, which must not exist), and how many of them are keyed with a key
    ``keys`` lacks (their links are not checked: only that they follow on)."""
    found = _window_link_break(agent_id, rows, first, last, head, keys)
    if isinstance(found, ChainBreak):
        return found, 0
    return None, found or 0


def _window_link_break(
    agent_id: UUID, rows: list[dict[str, Any]], first: int, last: int, head: _Head, keys: AuditKeys | None
) -> ChainBreak | int | None:
    # The break, or (none found) how many events' keys the ring lacks.
    unchecked = 0
    keyed_at = 0
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
        key_id = row.get("key_id")
        if key_id is None:
            if keyed_at:
                return ChainBreak(
                    agent_id, seq, row["id"], f"event {seq} has no key but follows keyed event {keyed_at}"
                )
            if event_hash(agent_id=agent_id, **fields) != row["hash"]:
                return ChainBreak(agent_id, seq, row["id"], "the event's content does not match its hash")
        else:
            keyed_at = keyed_at or seq
            if keys is None or key_id not in keys:
                unchecked += 1
            elif event_mac(keys, key_id, agent_id=agent_id, **fields) != row["hash"]:
                reason = f"the event's content does not match its HMAC under key {key_id!r}"
                return ChainBreak(agent_id, seq, row["id"], reason)
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
    return unchecked or None


def verify_chain(db: Database, agent_id: UUID) -> ChainCheck:
    """Walk one agent's chain (what :func:`verify` does for every agent) with ``db``'s key ring: its first broken
    link, the events it could not check, its legacy events. An agent with no head at all is a break too."""
    with _snapshot(db) as raw:
        with raw.cursor(row_factory=class_row(_Head)) as heads_cur:
            heads_cur.execute(f"SELECT * FROM ({_HEADS}) h WHERE h.agent_id = %s", (agent_id,))
            head = heads_cur.fetchone()
        if head is None:
            return ChainCheck(agent_id, 0, ChainBreak(agent_id, 0, None, "the agent has neither a row nor a tombstone"))
        with raw.cursor(row_factory=class_row(_Seal)) as seals_cur:
            seals_cur.execute(f"{_SEALS} WHERE agent_id = %s", (agent_id,))
            seal = seals_cur.fetchone()
        with raw.cursor(row_factory=dict_row) as cur:
            cur.execute(_CHAIN_QUERY, (agent_id,))
            return _check_chain(iter(cur), head, seal, db.audit_keys)


def verify(db: Database) -> VerifyReport:
    """Walk every agent's chain from genesis to its head (a deleted agent's: to its tombstone's, which must be its
    delete event) with ``db``'s key ring; report the first broken link of each broken chain, chains that have no head
    at all, the events whose key the ring lacks (not checked, so not ok), and each chain's legacy (unkeyed) events.

    Heads and chains are read in one snapshot, so transitions committing meanwhile cannot look like tampering.
    """
    keys = db.audit_keys
    breaks: list[ChainBreak] = []
    unchecked: list[Unchecked] = []
    legacy: list[LegacyPart] = []
    total = 0
    with _snapshot(db) as raw:
        with raw.cursor(row_factory=class_row(_Head)) as heads_cur:
            heads_cur.execute(_HEADS)
            heads = heads_cur.fetchall()
        with raw.cursor(row_factory=class_row(_Seal)) as seals_cur:
            seals_cur.execute(_SEALS)
            seals = {seal.agent_id: seal for seal in seals_cur}
        for head in heads:
            with raw.cursor(row_factory=dict_row) as cur:
                cur.execute(_CHAIN_QUERY, (head.agent_id,))
                checked = _check_chain(iter(cur), head, seals.pop(head.agent_id, None), keys)
            total += checked.events
            if checked.broken is not None:
                breaks.append(checked.broken)
            unchecked.extend(checked.unchecked)
            if checked.legacy:
                legacy.append(LegacyPart(head.agent_id, checked.legacy))
        with raw.cursor(row_factory=dict_row) as cur:
            cur.execute(_HEADLESS)
            for row in cur:
                seals.pop(row["agent_id"], None)
                reason = "the agent has neither a row nor a tombstone: it was removed without keel agent delete"
                breaks.append(ChainBreak(row["agent_id"], row["seq"], row["id"], reason))
        # What is left: chains the upgrade sealed that have no head and no event any more.
        for seal in seals.values():
            reason = (
                f"the journal was keyed when this agent had {seal.seq} events, but it now has no event, no row and no"
                " tombstone: its whole chain was removed"
            )
            if keys is not None and seal.key_id in keys and not _seal_holds(seal, keys):
                reason = "a seal in audit.legacy_chains does not match its HMAC: it was not written by the upgrade"
            breaks.append(ChainBreak(seal.agent_id, seal.seq, None, reason))
    return VerifyReport(
        agents=len(heads),
        events=total,
        breaks=tuple(breaks),
        unchecked=tuple(unchecked),
        legacy=tuple(legacy),
        key_ids=keys.ids if keys is not None else (),
    )

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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row, dict_row
from sqlalchemy import select

from agents.core.errors import InvalidInput, LostUpdate
from agents.core.redaction import redact_value
from models.audit_keys import AuditKeyMissing, AuditKeys, legacy_seal_parts
from models.audit_records import (
    Checkpoint,
    checkpoint_parts_of,
    checkpoint_seal_parts,
    checkpoints_txn,
    save_checkpoints_txn,
    seal_problem,
)
from models.clock import rfc3339
from models.db import Database, end_read
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
    many of its events are legacy (unkeyed). ``events``: those read and checked in this walk; ``trusted``: those an
    incremental pass took on the strength of the checkpoint made at ``checkpoint_at``, not checked again."""

    agent_id: UUID
    events: int
    broken: ChainBreak | None
    unchecked: tuple[Unchecked, ...] = ()
    legacy: int = 0
    trusted: int = 0
    checkpoint_at: datetime | None = None

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
    #: What is wrong with the archive records (audit.archived_partitions): a seal, their order.
    archive_problems: tuple[str, ...] = ()
    #: Every chain walked from its start (True), or each from its checkpoint (an incremental pass).
    full: bool = True
    #: The events this pass read and checked: the only ones it may call verified. ``events`` adds ``trusted``.
    read_events: int = 0
    #: Checkpoints (audit_verified_chains) whose seal does not hold: not Keel's, so not believed.
    checkpoint_problems: tuple[str, ...] = ()
    #: Events an incremental pass did not check but took from the checkpoints of ``trusted_chains`` chains, made
    #: (by an earlier verify) between ``trusted_from`` and ``trusted_to``; only each checkpoint's own event was
    #: checked again (its stored hash and its HMAC), not its link to the events below it.
    trusted: int = 0
    trusted_chains: int = 0
    trusted_from: datetime | None = None
    trusted_to: datetime | None = None

    @property
    def ok(self) -> bool:
        """No broken link, every link checked (events whose key was missing are not called intact), every archive
        record sound, and no checkpoint forged."""
        return not self.breaks and not self.unchecked and not self.archive_problems and not self.checkpoint_problems


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


def _is_delete(fields: Mapping[str, Any]) -> bool:
    return bool(fields["kind"] == "operator" and fields["event"] == "delete")


def legacy_seals(conn: psycopg.Connection[Any], agent_ids: list[UUID]) -> dict[UUID, _Seal]:
    """The legacy seals (migration 0015) of these agents' chains, in the caller's transaction."""
    with conn.cursor(row_factory=class_row(_Seal)) as cur:
        cur.execute(f"{_SEALS} WHERE agent_id = ANY(%s)", (agent_ids,))
        return {seal.agent_id: seal for seal in cur}


def _seal_holds(seal: _Seal, keys: AuditKeys) -> bool:
    return keys.verifies(seal.key_id, legacy_seal_parts(str(seal.agent_id), seal.seq, seal.head), seal.seal)


#: (revision, phase, request id) as a chain's last transition event left them.
_State = tuple[int, str | None, str | None]
_GENESIS_STATE: _State = (0, "idle", None)


@dataclass(frozen=True, slots=True)
class ChainPosition:
    """Where a walk along one chain stands: past event ``seq`` (0: none yet), whose hash is ``hash``; the state its
    last transition event left (None: not known — a window that starts mid-chain), the seq of the chain's first keyed
    event and of its delete event (0: none yet), and how many of its events so far are legacy (unkeyed).
    ``archived``: the events up to ``seq`` left the database (`keel audit archive`); this is their archived head."""

    seq: int = 0
    hash: str = GENESIS_HASH
    state: _State | None = _GENESIS_STATE
    keyed_at: int = 0
    deleted_at: int = 0
    legacy: int = 0
    archived: bool = False

    def as_head(self) -> dict[str, Any]:
        """The position as ``audit.archived_partitions.heads`` keeps it for one agent."""
        revision, phase, request_id = self.state or _GENESIS_STATE
        return {
            "last_seq": self.seq,
            "hash": self.hash,
            "revision": revision,
            "phase": phase,
            "request_id": request_id,
            "keyed_at": self.keyed_at,
            "deleted_at": self.deleted_at,
            "legacy": self.legacy,
        }

    @classmethod
    def from_head(cls, head: Mapping[str, Any]) -> ChainPosition:
        """An archived head (:meth:`as_head`) as the position a walk starts from."""
        state = (int(head["revision"]), head["phase"], head["request_id"])
        return cls(
            int(head["last_seq"]),
            str(head["hash"]),
            state,
            int(head.get("keyed_at", 0)),
            int(head.get("deleted_at", 0)),
            int(head.get("legacy", 0)),
            archived=True,
        )


def _link_problem(
    agent_id: UUID, keys: AuditKeys | None, key_id: str | None, fields: Mapping[str, Any], digest: str
) -> str | None:
    """Why an event's content does not match its link: its plain hash (a legacy event, ``key_id`` None) or its HMAC
    under ``key_id``, which the ring must hold; None: it matches."""
    if key_id is None:
        if event_hash(agent_id=agent_id, **fields) == digest:
            return None
        return "the event's content does not match its hash"
    assert keys is not None and key_id in keys
    if keys.verifies(key_id, mac_parts(key_id, agent_id=agent_id, **fields), digest):
        return None
    return (
        f"the event's content does not match its HMAC under key {key_id!r}: it was changed or forged (or"
        " KEEL_AUDIT_KEYS holds another secret under that id)"
    )


class ChainWalk:
    """The one check of one chain's events, one at a time in seq order, from a :class:`ChainPosition`: seq continuity,
    ``prev_hash``, the keyed link (or, for a legacy event, its plain hash and the upgrade's seal), nothing after the
    delete event; then, at the end, that the head is the last event. `keel audit verify` walks from genesis or from
    the chain's archived head, the console's window from the event before it, `keel audit archive` over a month:
    every one judges an event the same way."""

    def __init__(
        self, agent_id: UUID, keys: AuditKeys | None, seal: _Seal | None, start: ChainPosition | None = None
    ) -> None:
        start = start or ChainPosition()
        self.agent_id, self.keys, self.seal = agent_id, keys, seal
        self.expected_prev, self.expected_seq, self.state = start.hash, start.seq + 1, start.state
        self.keyed_at, self.deleted_at, self.legacy = start.keyed_at, start.deleted_at, start.legacy
        self.archived_to = start.seq if start.archived else 0
        self.events = 0
        self.unchecked: dict[str, list[int]] = {}  # key id -> [first seq, events]

    @property
    def position(self) -> ChainPosition:
        return ChainPosition(
            self.expected_seq - 1, self.expected_prev, self.state, self.keyed_at, self.deleted_at, self.legacy
        )

    def unchecked_parts(self) -> tuple[Unchecked, ...]:
        return tuple(Unchecked(self.agent_id, k, first, n) for k, (first, n) in self.unchecked.items())

    def _break(self, seq: int, jid: int | None, reason: str) -> ChainBreak:
        return ChainBreak(self.agent_id, seq, jid, reason)

    def _not_checked(self, key_id: str, seq: int, events: int = 1) -> None:
        entry = self.unchecked.setdefault(key_id, [seq, 0])
        entry[1] += events

    def check_seal(self, *, count_unchecked: bool = True) -> ChainBreak | None:
        """The legacy seal's HMAC (when the ring holds its key; otherwise its events count as not checked)."""
        seal, keys = self.seal, self.keys
        if seal is None:
            return None
        if keys is None or seal.key_id not in keys:
            if count_unchecked:
                self._not_checked(seal.key_id, 1, seal.seq)
            return None
        if not _seal_holds(seal, keys):
            return self._break(
                seal.seq,
                None,
                f"the seal on events 1-{seal.seq} (audit.legacy_chains) does not match its HMAC under key"
                f" {seal.key_id!r}: it was not written by the upgrade that keyed the journal",
            )
        return None

    def step(self, row: Mapping[str, Any]) -> ChainBreak | None:
        """Check the next event (a row of the chain query: id, hash, key_id and the linked fields); None: intact."""
        self.events += 1
        jid, digest, key_id = row["id"], row["hash"], row.get("key_id")
        fields = {name: row[name] for name in _HASHED}
        seq, seal, keys, agent_id = fields["seq"], self.seal, self.keys, self.agent_id
        if self.deleted_at:
            return self._break(seq, jid, f"event {seq} follows the agent's delete event {self.deleted_at}")
        if seq != self.expected_seq:
            if self.archived_to and seq <= self.archived_to:
                return self._break(
                    seq,
                    jid,
                    f"event {seq} is at or below the head of the chain's archived part (event {self.archived_to}):"
                    " it was inserted after that part was archived",
                )
            if self.expected_seq == 1 and seq > 1:
                missing = "event 1 is" if seq == 2 else f"events 1..{seq - 1} are"
                return self._break(1, jid, f"{missing} missing and no archive covers them")
            return self._break(self.expected_seq, jid, f"event {self.expected_seq} is missing (found {seq})")
        if fields["prev_hash"] != self.expected_prev:
            if self.archived_to and seq == self.archived_to + 1:
                return self._break(seq, jid, "prev_hash does not match the head of its archived part")
            return self._break(seq, jid, "prev_hash does not match the previous event's hash")
        if key_id is None:
            if self.keyed_at:
                return self._break(
                    seq, jid, f"event {seq} has no key but follows keyed event {self.keyed_at}: it was written without"
                    " the key",
                )  # fmt: skip
            if seal is None:
                return self._break(
                    seq, jid, f"event {seq} has no key, and this chain had no events when the journal was keyed: it"
                    " was written without the key",
                )  # fmt: skip
            if seq > seal.seq:
                return self._break(
                    seq, jid, f"event {seq} has no key, but only events 1-{seal.seq} of this chain were written before"
                    " the journal was keyed: it was written without the key",
                )  # fmt: skip
            if problem := _link_problem(agent_id, keys, None, fields, digest):
                return self._break(seq, jid, problem)
            if seq == seal.seq and digest != seal.head:
                return self._break(
                    seq, jid, f"events 1-{seq} were written before the journal was keyed, but they no longer end at"
                    " the head sealed then: one of them was changed",
                )  # fmt: skip
            self.legacy += 1
        else:
            if seal is not None and seq <= seal.seq:
                return self._break(
                    seq, jid, f"event {seq} has key {key_id!r}, but the upgrade that keyed the journal sealed events"
                    f" 1-{seal.seq} as written without one",
                )  # fmt: skip
            self.keyed_at = self.keyed_at or seq
            if keys is None or key_id not in keys:
                self._not_checked(key_id, seq)
            elif problem := _link_problem(agent_id, keys, key_id, fields, digest):
                return self._break(seq, jid, problem)
        if fields["kind"] == "transition":
            self.state = (fields["revision"], fields["to_phase"], fields["request_id"])
        if _is_delete(fields):
            self.deleted_at = seq
        self.expected_prev, self.expected_seq = digest, seq + 1
        return None

    def end(self, head: _Head) -> ChainBreak | None:
        """Once every event up to the head was stepped: the head is the last event, and the agent's state is what its
        last transition event says (when the walk knows it)."""
        last, expected, seal = self.expected_seq - 1, self.expected_seq, self.seal
        if last < head.seq:
            reason = (
                f"event {expected} is missing: the chain ends at event {last} but the agent's head is event {head.seq}"
            )
            return self._break(expected, None, reason)
        if seal is not None and last < seal.seq:
            reason = (
                f"event {expected} is missing: the chain ends at event {last} but it had {seal.seq} events when the"
                " journal was keyed"
            )
            return self._break(expected, None, reason)
        if last > head.seq or self.expected_prev != head.hash:
            if self.events == 0 and self.archived_to:
                return self._break(
                    last, None, f"the agent's head (event {head.seq}) is not the head of its archived part (event"
                    f" {last}), and no event of it is left in the database",
                )  # fmt: skip
            return self._break(last, None, "the agent's head does not match its last event")
        if head.deleted and not self.deleted_at:
            reason = (
                f"the agent was deleted (its tombstone's head is event {head.seq}) but that is not its delete event"
            )
            return self._break(last, None, reason)
        if self.deleted_at and not head.deleted:
            reason = f"event {self.deleted_at} deleted the agent, but its row is still there and it has no tombstone"
            return self._break(last, None, reason)
        state = self.state
        if state is not None and state != (head.revision, head.phase, head.request_id):
            reason = (
                f"the agent row says revision {head.revision} ({head.phase}, request {head.request_id}) but its last"
                f" transition event says revision {state[0]} ({state[1]}, request {state[2]})"
            )
            return self._break(last, None, reason)
        return None


def _check_chain(
    rows: Iterator[Mapping[str, Any]],
    head: _Head,
    seal: _Seal | None,
    keys: AuditKeys | None,
    start: ChainPosition | None = None,
) -> ChainCheck:
    return _check_chain_at(rows, head, seal, keys, start)[0]


def _check_chain_at(
    rows: Iterator[Mapping[str, Any]],
    head: _Head,
    seal: _Seal | None,
    keys: AuditKeys | None,
    start: ChainPosition | None = None,
) -> tuple[ChainCheck, ChainPosition]:
    """The chain's check and where the walk ended (its head, when the check holds)."""
    walk = ChainWalk(head.agent_id, keys, seal, start)
    broken = walk.check_seal()
    for row in rows:
        if broken is not None:
            break
        broken = walk.step(row)
    if broken is None:
        broken = walk.end(head)
    check = ChainCheck(head.agent_id, walk.events, broken, walk.unchecked_parts(), walk.legacy)
    return check, walk.position


# --- archived parts of the journal (`keel audit archive`) ----------------------------------------------------------

#: Starts what an archive record's seal covers, so no other use of the audit key shares its input.
_ARCHIVE_TAG = "keel-archived-partition-v1"


@dataclass(frozen=True, slots=True)
class ArchivedPart:
    """One row of ``audit.archived_partitions``: a month of the journal that left the database, once shipped."""

    partition: str
    from_at: datetime | None
    to_at: datetime
    first_id: int | None
    last_id: int | None
    events: int
    manifests: list[dict[str, Any]]
    heads: dict[str, dict[str, Any]]
    archived_by: str
    archived_at: datetime
    key_id: str
    seal: str


def _exact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def archive_seal_parts(
    *,
    key_id: str,
    partition: str,
    from_at: datetime | None,
    to_at: datetime,
    first_id: int | None,
    last_id: int | None,
    events: int,
    manifests: list[dict[str, Any]],
    heads: dict[str, dict[str, Any]],
    archived_by: str,
    archived_at: datetime,
) -> list[str | int | None]:
    """What an archive record's seal (an HMAC under key ``key_id``) covers: every other column of the row."""
    return [
        _ARCHIVE_TAG,
        key_id,
        partition,
        None if from_at is None else rfc3339(from_at),
        rfc3339(to_at),
        first_id,
        last_id,
        events,
        _exact(manifests),
        _exact(heads),
        archived_by,
        rfc3339(archived_at),
    ]


def _archive_parts_of(part: ArchivedPart) -> list[str | int | None]:
    return archive_seal_parts(
        key_id=part.key_id, partition=part.partition, from_at=part.from_at, to_at=part.to_at,
        first_id=part.first_id, last_id=part.last_id, events=part.events, manifests=part.manifests,
        heads=part.heads, archived_by=part.archived_by, archived_at=part.archived_at,
    )  # fmt: skip


_ARCHIVED = "SELECT * FROM audit.archived_partitions ORDER BY to_at, partition"


def archived_parts(conn: psycopg.Connection[Any]) -> list[ArchivedPart]:
    """Every archive record, oldest month first, in the caller's transaction."""
    with conn.cursor(row_factory=class_row(ArchivedPart)) as cur:
        cur.execute(_ARCHIVED)
        return cur.fetchall()


def archive_seal_problem(part: ArchivedPart, keys: AuditKeys | None) -> str | None:
    """What is wrong with the record's seal (None: it holds)."""
    if keys is None or part.key_id not in keys:
        return (
            f"archive record {part.partition} is sealed with audit key {part.key_id!r}, which the key ring"
            " (KEEL_AUDIT_KEYS) does not hold: the archived heads could not be checked"
        )
    if not keys.verifies(part.key_id, _archive_parts_of(part), part.seal):
        return (
            f"archive record {part.partition} does not match its seal under key {part.key_id!r}: it was altered, or"
            " not written by keel audit archive"
        )
    return None


def archived_heads(
    parts: list[ArchivedPart], keys: AuditKeys | None
) -> tuple[list[str], dict[UUID, tuple[ChainPosition, str]]]:
    """The records' problems (seals, order) and, per agent, the head of its archived part (from the newest record
    holding it) and that record's partition."""
    problems: list[str] = []
    heads: dict[UUID, tuple[ChainPosition, str]] = {}
    previous: ArchivedPart | None = None
    for part in parts:
        problem = archive_seal_problem(part, keys)
        if problem is not None:
            problems.append(problem)
        if previous is not None:
            if part.from_at is None or part.from_at < previous.to_at:
                problems.append(
                    f"archive record {part.partition} does not start after {previous.partition}'s month: archived"
                    " months leave in order"
                )
            # Ids are not compared across records: two transactions on either side of a month's end can take their
            # ids in the other order, so neighbouring months' id ranges may overlap there. The months may not.
        for agent, head in part.heads.items():
            position = ChainPosition.from_head(head)
            agent_id = UUID(agent)
            before = heads.get(agent_id)
            if before is not None and position.seq <= before[0].seq:
                problems.append(
                    f"archive record {part.partition} puts agent {agent}'s archived head at event {position.seq},"
                    f" not past {before[1]}'s event {before[0].seq}"
                )
            heads[agent_id] = (position, part.partition)
        previous = part
    return problems, heads


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
    ``first_seq - 1``'s stored hash, to the head of the chain's archived part, or to the chain's start — and, when the
    window reaches the agent's head, that the head is its last event and the agent's state its last transition's.
    Nothing before ``first_seq - 1`` was read: only a full walk (:func:`verify_chain`, ``keel audit verify``) vouches
    for those. Each event is judged by :class:`ChainWalk`, as the full walk judges it."""

    events: tuple[JournalEvent, ...]
    first_seq: int
    last_seq: int
    head_seq: int
    broken: ChainBreak | None
    #: Events shown whose link is keyed with a key this process's ring lacks: their links were not checked.
    unchecked: int = 0
    #: Events 1..archived_seq left the database (`keel audit archive`): there is nothing older to page to.
    archived_seq: int = 0

    @property
    def at_head(self) -> bool:
        return self.last_seq == self.head_seq

    @property
    def older(self) -> int | None:
        """Where the next (older) page ends: before the first event shown, if there is any before it."""
        return self.first_seq if self.first_seq > self.archived_seq + 1 else None


_WINDOW_QUERY = (
    "SELECT *, details::text AS details_json FROM audit.journal WHERE agent_id = %s AND seq BETWEEN %s AND %s"
    " ORDER BY seq"
)
# The newest archive record holding the agent: its head is where the agent's events in the database start.
_ARCHIVED_OF = (
    "SELECT * FROM audit.archived_partitions WHERE heads ? %s::text ORDER BY to_at DESC, partition DESC LIMIT 1"
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
            with raw.cursor(row_factory=class_row(_Seal)) as seals_cur:
                seals_cur.execute(f"{_SEALS} WHERE agent_id = %s", (agent_id,))
                seal = seals_cur.fetchone()
            with raw.cursor(row_factory=class_row(ArchivedPart)) as parts_cur:
                parts_cur.execute(_ARCHIVED_OF, (str(agent_id),))
                archived = parts_cur.fetchone()
            archived_seq = 0 if archived is None else int(archived.heads[str(agent_id)]["last_seq"])
            last = head.seq if before is None else min(before - 1, head.seq)
            last = max(last, archived_seq)
            first = max(1, archived_seq + 1, last - limit + 1)
            with raw.cursor(row_factory=dict_row) as cur:
                # One event past the head too, if there is one: nothing may follow the head.
                cur.execute(_WINDOW_QUERY, (agent_id, first - 1, last + 1 if last == head.seq else last))
                rows = cur.fetchall()
        finally:
            raw.rollback()
            raw.isolation_level = None
            raw.read_only = None
    shown = [row for row in rows if first <= row["seq"] <= last]
    broken, unchecked = _window_break(agent_id, rows, first, last, head, seal, archived, db.audit_keys)
    events = tuple(JournalEvent.model_validate(row) for row in reversed(shown))
    return JournalPage(events, first, last, head.seq, broken, unchecked, archived_seq)


def _window_break(
    agent_id: UUID,
    rows: list[dict[str, Any]],
    first: int,
    last: int,
    head: _Head,
    seal: _Seal | None,
    archived: ArchivedPart | None,
    keys: AuditKeys | None,
) -> tuple[ChainBreak | None, int]:
    """The first broken link among events ``first``..``last`` (``rows`` may hold event ``first - 1``, read only for
    its hash, and at the head event ``last + 1``, which must not exist), judged by :class:`ChainWalk` as the full
    walk judges them; and how many of them are keyed with a key ``keys`` lacks (their links are not checked: only
    that they follow on)."""
    by_seq = {row["seq"]: row for row in rows}
    archived_head = None if archived is None else archived.heads.get(str(agent_id))
    if archived is not None and archived_head is not None and first == int(archived_head["last_seq"]) + 1:
        problem = archive_seal_problem(archived, keys)
        if problem is not None:
            return ChainBreak(agent_id, first - 1, None, problem), 0
        start = ChainPosition.from_head(archived_head)
    elif first == 1:
        start = ChainPosition()
    else:
        before = by_seq.get(first - 1)
        if before is None:
            return ChainBreak(agent_id, first - 1, None, f"event {first - 1} is missing"), 0
        keyed = before.get("key_id") is not None
        # What came before event first - 1 is not read: its state is not known, only its link and whether it is keyed.
        start = ChainPosition(first - 1, before["hash"], None, first - 1 if keyed else 0, 0)
    walk = ChainWalk(agent_id, keys, seal, start)
    broken = walk.check_seal(count_unchecked=False)
    for seq in range(first, last + 1):
        if broken is not None:
            break
        row = by_seq.get(seq)
        if row is None:
            broken = ChainBreak(agent_id, seq, None, f"event {seq} is missing")
        else:
            broken = walk.step(row)
    if broken is None and last == head.seq:
        if last + 1 in by_seq:
            broken = ChainBreak(
                agent_id, last + 1, by_seq[last + 1]["id"], f"event {last + 1} follows the agent's head"
            )
        else:
            broken = walk.end(head)
    if broken is not None:
        return broken, 0
    return None, sum(n for _, n in walk.unchecked.values())


def verify_chain(db: Database, agent_id: UUID) -> ChainCheck:
    """Walk one agent's chain (what :func:`verify` does for every agent) with ``db``'s key ring: its first broken
    link, the events it could not check, its legacy events. An agent with no head at all is a break too. A chain
    whose early events were archived starts at its archived head (the newest archive record holding it; the
    records themselves are checked by :func:`verify`)."""
    with _snapshot(db) as raw:
        with raw.cursor(row_factory=class_row(_Head)) as heads_cur:
            heads_cur.execute(f"SELECT * FROM ({_HEADS}) h WHERE h.agent_id = %s", (agent_id,))
            head = heads_cur.fetchone()
        if head is None:
            return ChainCheck(agent_id, 0, ChainBreak(agent_id, 0, None, "the agent has neither a row nor a tombstone"))
        with raw.cursor(row_factory=class_row(_Seal)) as seals_cur:
            seals_cur.execute(f"{_SEALS} WHERE agent_id = %s", (agent_id,))
            seal = seals_cur.fetchone()
        _, archived = archived_heads(archived_parts(raw), db.audit_keys)
        start = archived.get(agent_id)
        with raw.cursor(row_factory=dict_row) as cur:
            cur.execute(_CHAIN_QUERY, (agent_id,))
            return _check_chain(iter(cur), head, seal, db.audit_keys, None if start is None else start[0])


#: Chains walked per transaction of a verify (``KEEL_AUDIT_VERIFY_CHUNK_CHAINS``).
VERIFY_CHUNK_CHAINS = 500
#: Events a verify reads per transaction, about (``KEEL_AUDIT_VERIFY_CHUNK_EVENTS``): a chunk ends at the chain that
#: would take it past this, so long chains make short chunks (a chain longer than this is a chunk of its own).
VERIFY_CHUNK_EVENTS = 50_000
_NIL = UUID(int=0)
_TOP = UUID(int=(1 << 128) - 1)
# A chunk: the next chains by agent id, heads of agent rows and of tombstones merged (each by its primary key).
_CHUNK_HEADS = ("SELECT * FROM ({heads}) h WHERE h.agent_id {low} %(low)s ORDER BY h.agent_id LIMIT %(limit)s").format(
    heads=_HEADS.removesuffix(" ORDER BY agent_id"), low="{low}"
)
_CHUNK_SEALS = f"{_SEALS} WHERE agent_id {{low}} %(low)s AND agent_id <= %(high)s"
_CHUNK_HEADLESS = (
    "SELECT j.agent_id, min(j.seq) AS seq, min(j.id) AS id FROM audit.journal j"
    " WHERE j.agent_id {low} %(low)s AND j.agent_id <= %(high)s"
    " AND NOT EXISTS (SELECT 1 FROM agents a WHERE a.id = j.agent_id)"
    " AND NOT EXISTS (SELECT 1 FROM audit.deleted_agents d WHERE d.agent_id = j.agent_id)"
    " GROUP BY j.agent_id ORDER BY j.agent_id"
)
_CHUNK_EVENTS = (
    "SELECT j.agent_id, j.id, j.hash, j.key_id, j.prev_hash, j.seq, j.kind, j.event, j.actor, j.request_id,"
    " j.from_phase, j.to_phase, j.revision, j.decision, j.details::text AS details_json, j.at"
    " FROM unnest(%(ids)s::uuid[], %(after)s::bigint[]) AS w(agent_id, after)"
    " JOIN audit.journal j ON j.agent_id = w.agent_id AND j.seq > w.after ORDER BY j.agent_id, j.seq"
)


@dataclass(frozen=True, slots=True)
class _Planned:
    """One chain of a chunk to walk: from ``start`` (None: genesis), past its checkpoint ``cp`` if it is believed;
    events 1..``base`` were archived. ``broken``: an earlier verify found the chain broken at that event (its
    checkpoint's mark, believed or not: a mark can only make a verify fail)."""

    head: _Head
    start: ChainPosition | None
    cp: Checkpoint | None
    seal: _Seal | None
    base: int
    broken: int | None = None

    @property
    def trusted(self) -> Checkpoint | None:
        """The checkpoint the walk starts from (None: it starts at genesis or at its archived head)."""
        return self.cp if self.start is not None and not self.start.archived else None

    @property
    def read_after(self) -> int:
        # From an archived head the chain is read whole: an event inserted at or below that head is a break. From a
        # checkpoint, its own event is read again (:func:`_checkpoint_event`).
        if self.start is None or self.start.archived:
            return 0
        return self.start.seq - 1


class _Rows:
    """A chunk's events in (agent id, seq) order, handed out chain by chain."""

    def __init__(self, rows: Iterator[dict[str, Any]]) -> None:
        self._rows = rows
        self._next = next(rows, None)

    def of(self, agent_id: UUID) -> Iterator[dict[str, Any]]:
        while self._next is not None and self._next["agent_id"] == agent_id:
            row, self._next = self._next, next(self._rows, None)
            yield row

    def skip(self, agent_id: UUID) -> None:
        for _ in self.of(agent_id):
            pass


@contextmanager
def _chunk(db: Database) -> Iterator[psycopg.Connection[Any]]:
    # One chunk's heads, seals, checkpoints and chains in one snapshot, which ends with the chunk: a verify never
    # holds back vacuum for longer than a chunk takes.
    with _snapshot(db) as raw:
        yield raw


def _position_of(cp: Checkpoint) -> ChainPosition:
    return ChainPosition(cp.seq, cp.hash, (cp.revision, cp.phase, cp.request_id), cp.keyed_at, cp.deleted_at, cp.legacy)


def _checkpoint_problem(cp: Checkpoint, keys: AuditKeys | None) -> tuple[str | None, bool]:
    """Why the checkpoint cannot be believed (None: it can), and whether to say so: one sealed with a key the ring
    no longer holds is merely passed over (the chain is walked from its start)."""
    if keys is None or cp.key_id not in keys:
        return "", False
    problem = seal_problem(keys, cp.key_id, checkpoint_parts_of(cp), cp.seal)
    if problem is None:
        return None, False
    return (
        f"the checkpoint of agent {cp.agent_id}'s chain (audit_verified_chains, event {cp.seq}) cannot be believed:"
        f" {problem}; the chain was walked from its start instead",
        True,
    )


def _checkpoint_event(
    w: _Planned, cp: Checkpoint, row: Mapping[str, Any] | None, keys: AuditKeys | None
) -> tuple[ChainBreak | None, Unchecked | None]:
    """Check the event an incremental walk's checkpoint stands on, as it is now: there, with the hash the checkpoint
    holds, and its content still matching that hash (its HMAC, or a legacy event's plain hash). An edit of that
    event, or of the chain at it, is caught without reading the events below it; an edit below it is not."""
    agent_id, seq = w.head.agent_id, cp.seq
    where = f"the event an earlier verify checked this chain up to (audit_verified_chains, of {_utc(cp.verified_at)})"
    if row is None or row["seq"] != seq:
        return ChainBreak(agent_id, seq, None, f"event {seq} is missing: it is {where}"), None
    if row["hash"] != cp.hash:
        return ChainBreak(agent_id, seq, row["id"], f"event {seq} no longer has the hash of {where}: rewritten"), None
    key_id = row.get("key_id")
    if key_id is not None and (keys is None or key_id not in keys):
        return None, Unchecked(agent_id, key_id, seq, 1)
    problem = _link_problem(agent_id, keys, key_id, {name: row[name] for name in _HASHED}, row["hash"])
    if problem is not None:
        return ChainBreak(agent_id, seq, row["id"], f"{problem}; it is {where}"), None
    return None, None


def _utc(at: datetime | None) -> str:
    return "an unknown time" if at is None else at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _sealed(agent_id: UUID, position: ChainPosition, keys: AuditKeys, *, broken_seq: int | None = None) -> Checkpoint:
    revision, phase, request_id = position.state or _GENESIS_STATE
    fields: dict[str, Any] = {
        "agent_id": agent_id,
        "seq": position.seq,
        "hash": position.hash,
        "revision": revision,
        "phase": phase,
        "request_id": request_id,
        "keyed_at": position.keyed_at,
        "deleted_at": position.deleted_at,
        "legacy": position.legacy,
        "broken_seq": broken_seq,
    }
    seal = keys.mac(keys.current, checkpoint_seal_parts(**fields))
    return Checkpoint(**fields, key_id=keys.current, seal=seal)


def _within_events(
    heads: list[_Head],
    checkpoints: dict[UUID, Checkpoint],
    archived: dict[UUID, tuple[ChainPosition, str]],
    *,
    full: bool,
    cap: int,
) -> list[_Head]:
    """The first of ``heads`` whose walks read at most ``cap`` events together, by their heads' and starts' event
    numbers (at least the first head, however long its chain). An estimate: it sizes chunks, it decides nothing."""
    total = 0
    for n, head in enumerate(heads):
        arch = archived.get(head.agent_id)
        start = 0 if arch is None else arch[0].seq
        cp = checkpoints.get(head.agent_id)
        if not full and cp is not None and cp.broken_seq is None and start <= cp.seq <= head.seq:
            start = cp.seq
        total += max(head.seq - start, 0)
        if total > cap and n > 0:
            return heads[:n]
    return heads


def verify(
    db: Database,
    *,
    full: bool = True,
    save_checkpoints: bool = False,
    chunk_chains: int = VERIFY_CHUNK_CHAINS,
    chunk_events: int = VERIFY_CHUNK_EVENTS,
    on_chunk: Callable[[psycopg.Connection[Any]], None] | None = None,
    on_chain: Callable[[ChainCheck], None] | None = None,
) -> VerifyReport:
    """Walk every agent's chain to its head (a deleted agent's: to its tombstone's, which must be its delete event)
    with ``db``'s key ring, ``chunk_chains`` chains per transaction and fewer when their walks would read more than
    ``chunk_events`` events together (one chain at least); report the archive records' problems (seal,
    order), the first broken link of each broken chain, chains that have no head at all, the events whose key the
    ring lacks (not checked, so not ok), and each chain's legacy (unkeyed) events.

    ``full``: every chain from genesis, or from the head of its archived part as the newest archive record holding
    it says. Otherwise (incremental) each chain from its checkpoint (``audit_verified_chains``) when its seal holds:
    only the checkpoint's own event (:func:`_checkpoint_event`) and the events after it are read, so the pass costs
    the new events, not the history; the report counts the events below a checkpoint as ``trusted``, never as
    checked. An incremental pass cannot see what changed below a checkpoint (an edited, removed or inserted old
    event), nor events of an agent that has no row, no tombstone and no checkpoint: the full pass does. A checkpoint
    whose seal fails is reported, and its chain walked from its start. ``save_checkpoints``: each chain found
    intact, every link checked, gets its checkpoint moved to its head (a full pass stamps it anew), committed after
    its chunk (a pass killed midway leaves only true checkpoints); each
    chain found broken gets its checkpoint marked with the break, so every later pass, incremental or full, walks it
    from its start and fails on it (on the mark itself, should the chain walk intact again) until the owner deletes
    the checkpoint: an edit below a checkpoint that only a full pass saw is not forgotten by the next incremental one.

    Each chunk's heads and chains are read in one snapshot, so transitions committing meanwhile cannot look like
    tampering; ``on_chunk`` is called inside each chunk's transaction, once its reads are done; ``on_chain`` with
    each chain's check once it is walked (its events checked and trusted).
    """
    if chunk_chains < 1:
        raise ValueError(f"chunk_chains must be at least 1, got {chunk_chains}")
    if chunk_events < 1:
        raise ValueError(f"chunk_events must be at least 1, got {chunk_events}")
    keys = db.audit_keys
    breaks: list[ChainBreak] = []
    unchecked: list[Unchecked] = []
    legacy: list[LegacyPart] = []
    problems: list[str] = []
    chains = total = read = trusted = trusted_chains = 0
    trusted_from: datetime | None = None
    trusted_to: datetime | None = None
    with _snapshot(db) as raw:
        parts = archived_parts(raw)
    archive_problems, archived = archived_heads(parts, keys)
    low, first = _NIL, True
    while True:
        params = {"low": low, "limit": chunk_chains}
        op = ">=" if first else ">"
        saved: list[Checkpoint] = []
        walks: list[_Planned] = []
        with _chunk(db) as raw:
            with raw.cursor(row_factory=class_row(_Head)) as heads_cur:
                heads_cur.execute(_CHUNK_HEADS.format(low=op), params)
                heads = heads_cur.fetchall()
            high = heads[-1].agent_id if len(heads) == chunk_chains else _TOP
            checkpoints = {cp.agent_id: cp for cp in checkpoints_txn(raw, low, high, inclusive=first)}
            kept = _within_events(heads, checkpoints, archived, full=full, cap=chunk_events)
            if len(kept) < len(heads):  # the chunk ends early; the next one starts after its last chain
                heads, high = kept, kept[-1].agent_id
                checkpoints = {agent_id: cp for agent_id, cp in checkpoints.items() if agent_id <= high}
            bounds = {"low": low, "high": high}
            with raw.cursor(row_factory=class_row(_Seal)) as seals_cur:
                seals_cur.execute(_CHUNK_SEALS.format(low=op), bounds)
                seals = {seal.agent_id: seal for seal in seals_cur}
            for head in heads:
                cp = checkpoints.pop(head.agent_id, None)
                arch = archived.pop(head.agent_id, None)
                start = None if arch is None else arch[0]
                base = 0 if start is None else start.seq  # events 1..base are not in the database
                broken = None if cp is None else cp.broken_seq
                if cp is not None:
                    problem, say = _checkpoint_problem(cp, keys)
                    if say and problem:
                        problems.append(problem)
                    if problem is not None:
                        cp = None
                # Heads only move forward: one behind its checkpoint, or elsewhere at the same event, was set back.
                if cp is not None and (cp.seq > head.seq or (cp.seq == head.seq and cp.hash != head.hash)):
                    reason = (
                        f"the agent's head is event {head.seq}, but its chain was verified up to event {cp.seq}"
                        " (audit_verified_chains): events were removed or rewritten since"
                    )
                    breaks.append(ChainBreak(head.agent_id, min(cp.seq, head.seq), None, reason))
                    seals.pop(head.agent_id, None)
                    chains += 1
                    continue
                if cp is not None and not full and cp.seq > base and broken is None:
                    start = _position_of(cp)
                walks.append(_Planned(head, start, cp, seals.pop(head.agent_id, None), base, broken))
            with raw.cursor(name="keel-verify-chunk", row_factory=dict_row) as cur:
                # One read for the chunk's chains, each past where its walk starts, streamed in chain order.
                cur.itersize = 2000
                cur.execute(
                    _CHUNK_EVENTS,
                    {"ids": [w.head.agent_id for w in walks], "after": [w.read_after for w in walks]},
                )
                rows = _Rows(iter(cur))
                for w in walks:
                    chain_rows = rows.of(w.head.agent_id)
                    tcp, cp_break, cp_unchecked = w.trusted, None, None
                    if tcp is not None:
                        cp_break, cp_unchecked = _checkpoint_event(w, tcp, next(chain_rows, None), keys)
                    if tcp is not None and cp_break is not None:
                        checked, position = ChainCheck(w.head.agent_id, 0, cp_break), _position_of(tcp)
                    else:
                        checked, position = _check_chain_at(chain_rows, w.head, w.seal, keys, w.start)
                    rows.skip(w.head.agent_id)  # what a broken walk left unread
                    if cp_unchecked is not None:
                        checked = replace(checked, unchecked=(cp_unchecked, *checked.unchecked))
                    if tcp is not None and cp_break is None:
                        checked = replace(checked, trusted=tcp.seq - w.base, checkpoint_at=tcp.verified_at)
                        trusted_chains += 1
                        if (at := tcp.verified_at) is not None:
                            trusted_from = at if trusted_from is None else min(trusted_from, at)
                            trusted_to = at if trusted_to is None else max(trusted_to, at)
                    chains += 1
                    read += checked.events
                    trusted += checked.trusted
                    total += checked.events + checked.trusted
                    if on_chain is not None:
                        on_chain(checked)
                    if checked.broken is not None:
                        breaks.append(checked.broken)
                        if save_checkpoints and keys is not None and w.cp is not None and w.broken is None:
                            mark = _sealed(w.head.agent_id, _position_of(w.cp), keys, broken_seq=checked.broken.seq)
                            saved.append(mark)
                    elif w.broken is not None:
                        reason = (
                            f"an earlier keel audit verify found this chain broken at event {w.broken} and marked its"
                            " checkpoint (audit_verified_chains); it walks intact now (restored?): once the chain has"
                            " been looked at, the owner clears the mark by deleting the checkpoint (docs/runbook.md)"
                        )
                        breaks.append(ChainBreak(w.head.agent_id, w.broken, None, reason))
                    unchecked.extend(checked.unchecked)
                    if checked.legacy:
                        legacy.append(LegacyPart(w.head.agent_id, checked.legacy))
                    if save_checkpoints and keys is not None and checked.ok and position.seq > 0 and w.broken is None:
                        # A full pass stamps every chain anew: its checkpoint's time says when it was last walked whole.
                        if w.cp is None or position.seq != w.cp.seq or full:
                            saved.append(_sealed(w.head.agent_id, position, keys))
            if full:
                with raw.cursor(row_factory=dict_row) as cur:
                    cur.execute(_CHUNK_HEADLESS.format(low=op), bounds)
                    for row in cur:
                        seals.pop(row["agent_id"], None)
                        archived.pop(row["agent_id"], None)
                        checkpoints.pop(row["agent_id"], None)
                        reason = "the agent has neither a row nor a tombstone: it was removed without keel agent delete"
                        breaks.append(ChainBreak(row["agent_id"], row["seq"], row["id"], reason))
            # What is left in this range: chains the upgrade sealed, or verify checkpointed, that have no head now.
            for seal in seals.values():
                archived.pop(seal.agent_id, None)
                checkpoints.pop(seal.agent_id, None)
                reason = (
                    f"the journal was keyed when this agent had {seal.seq} events, but it now has no event, no row and"
                    " no tombstone: its whole chain was removed"
                )
                if keys is not None and seal.key_id in keys and not _seal_holds(seal, keys):
                    reason = "a seal in audit.legacy_chains does not match its HMAC: it was not written by the upgrade"
                breaks.append(ChainBreak(seal.agent_id, seal.seq, None, reason))
            for cp in checkpoints.values():
                problem, say = _checkpoint_problem(cp, keys)
                if problem is not None:
                    if say and problem:
                        problems.append(problem)
                    continue
                reason = (
                    f"its chain was verified up to event {cp.seq} (audit_verified_chains), but the agent has neither a"
                    " row nor a tombstone now: it was removed without keel agent delete"
                )
                archived.pop(cp.agent_id, None)
                breaks.append(ChainBreak(cp.agent_id, cp.seq, None, reason))
            if on_chunk is not None:
                on_chunk(raw)
        if saved:
            with db.transaction() as cur:
                save_checkpoints_txn(cur, saved)
        if high == _TOP:
            break
        low, first = high, False
    for agent_id, (position, partition) in archived.items():
        reason = (
            f"archive {partition} holds events 1-{position.seq} of this agent, but it now has no event, no row and"
            " no tombstone: the rest of its chain was removed"
        )
        breaks.append(ChainBreak(agent_id, position.seq, None, reason))
    return VerifyReport(
        agents=chains,
        events=total,
        breaks=tuple(breaks),
        unchecked=tuple(unchecked),
        legacy=tuple(legacy),
        key_ids=keys.ids if keys is not None else (),
        archive_problems=tuple(archive_problems),
        full=full,
        read_events=read,
        checkpoint_problems=tuple(problems),
        trusted=trusted,
        trusted_chains=trusted_chains,
        trusted_from=trusted_from,
        trusted_to=trusted_to,
    )

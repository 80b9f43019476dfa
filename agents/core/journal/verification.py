"""`keel audit verify`: every chain walked to its head, in chunks of short snapshots, from genesis, from its archived
head or (incrementally) from its sealed checkpoint, and what the pass found (:class:`VerifyReport`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row, dict_row

from agents.core.journal.archived import archived_heads, archived_parts
from agents.core.journal.chain import HASHED, link_problem
from agents.core.journal.reads import snapshot
from agents.core.journal.walk import (
    GENESIS_STATE,
    SEALS_QUERY,
    ChainBreak,
    ChainCheck,
    ChainHead,
    ChainPosition,
    LegacySeal,
    Unchecked,
    check_chain,
    seal_holds,
)
from models.audit_keys import AuditKeys
from models.audit_records import (
    Checkpoint,
    checkpoint_parts_of,
    checkpoint_seal_parts,
    checkpoints_txn,
    save_checkpoints_txn,
    seal_problem,
)
from models.db import Database


@dataclass(frozen=True, slots=True)
class LegacyPart:
    """Events 1 to ``events`` of one chain were written before the journal was keyed: checked with plain sha256,
    protected by the seal the upgrade (migration 0015) put on them, not before it."""

    agent_id: UUID
    events: int


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What one pass over every chain found; :class:`~agents.core.journal.verdict.Verdict` tells it in a sentence."""

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
    #: Events an incremental pass took, unchecked, from the checkpoints of ``trusted_chains`` chains made between
    #: ``trusted_from`` and ``trusted_to`` (only each checkpoint's own event was checked again).
    trusted: int = 0
    trusted_chains: int = 0
    trusted_from: datetime | None = None
    trusted_to: datetime | None = None

    @property
    def ok(self) -> bool:
        """No broken link, every link checked (events whose key was missing are not called intact), every archive
        record sound, and no checkpoint forged."""
        return not self.breaks and not self.unchecked and not self.archive_problems and not self.checkpoint_problems


_CHAIN_QUERY = (
    "SELECT id, hash, key_id, prev_hash, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,"
    " details::text AS details_json, at FROM audit.journal WHERE agent_id = %s ORDER BY seq"
)


# Every chain's head: an agent row's, or a deleted agent's tombstone's.
_HEADS = (
    "SELECT id AS agent_id, journal_seq AS seq, journal_head AS hash, revision, phase, request_id, false AS deleted"
    " FROM agents UNION ALL"
    " SELECT agent_id, journal_seq, journal_head, revision, phase, request_id, true FROM audit.deleted_agents"
    " ORDER BY agent_id"
)


def verify_chain(db: Database, agent_id: UUID) -> ChainCheck:
    """Walk one agent's chain (what :func:`verify` does for every agent) with ``db``'s key ring: its first broken
    link, the events it could not check, its legacy events. An agent with no head at all is a break too. A chain
    whose early events were archived starts at its archived head (the newest archive record holding it; the
    records themselves are checked by :func:`verify`)."""
    with snapshot(db) as raw:
        with raw.cursor(row_factory=class_row(ChainHead)) as heads_cur:
            heads_cur.execute(f"SELECT * FROM ({_HEADS}) h WHERE h.agent_id = %s", (agent_id,))
            head = heads_cur.fetchone()
        if head is None:
            return ChainCheck(agent_id, 0, ChainBreak(agent_id, 0, None, "the agent has neither a row nor a tombstone"))
        with raw.cursor(row_factory=class_row(LegacySeal)) as seals_cur:
            seals_cur.execute(f"{SEALS_QUERY} WHERE agent_id = %s", (agent_id,))
            seal = seals_cur.fetchone()
        _, archived = archived_heads(archived_parts(raw), db.audit_keys)
        start = archived.get(agent_id)
        with raw.cursor(row_factory=dict_row) as cur:
            cur.execute(_CHAIN_QUERY, (agent_id,))
            return check_chain(iter(cur), head, seal, db.audit_keys, None if start is None else start[0])[0]


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
_CHUNK_SEALS = f"{SEALS_QUERY} WHERE agent_id {{low}} %(low)s AND agent_id <= %(high)s"
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

    head: ChainHead
    start: ChainPosition | None
    cp: Checkpoint | None
    seal: LegacySeal | None
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
    with snapshot(db) as raw:
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
    problem = link_problem(agent_id, keys, key_id, {name: row[name] for name in HASHED}, row["hash"])
    if problem is not None:
        return ChainBreak(agent_id, seq, row["id"], f"{problem}; it is {where}"), None
    return None, None


def _utc(at: datetime | None) -> str:
    return "an unknown time" if at is None else at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _sealed(agent_id: UUID, position: ChainPosition, keys: AuditKeys, *, broken_seq: int | None = None) -> Checkpoint:
    revision, phase, request_id = position.state or GENESIS_STATE
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
    heads: list[ChainHead],
    checkpoints: dict[UUID, Checkpoint],
    archived: dict[UUID, tuple[ChainPosition, str]],
    *,
    full: bool,
    cap: int,
) -> list[ChainHead]:
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
    """Walk every agent's chain to its head with ``db``'s key ring, ``chunk_chains`` chains per snapshot (fewer when
    they would read over ``chunk_events`` events), and report what is wrong. ``full``: from genesis or the archived
    head; otherwise from each chain's sealed checkpoint, counting the events below it as trusted, not checked.
    ``save_checkpoints``: move intact chains' checkpoints to their heads and mark broken ones'. ``on_chunk`` is called
    inside each chunk's transaction after its reads, ``on_chain`` with each chain's check. What each pass can and
    cannot see: docs/explanation/journal-and-transitions.md#keel-audit-verify."""
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
    with snapshot(db) as raw:
        parts = archived_parts(raw)
    archive_problems, archived = archived_heads(parts, keys)
    low, first = _NIL, True
    while True:
        params = {"low": low, "limit": chunk_chains}
        op = ">=" if first else ">"
        saved: list[Checkpoint] = []
        walks: list[_Planned] = []
        with _chunk(db) as raw:
            with raw.cursor(row_factory=class_row(ChainHead)) as heads_cur:
                heads_cur.execute(_CHUNK_HEADS.format(low=op), params)
                heads = heads_cur.fetchall()
            high = heads[-1].agent_id if len(heads) == chunk_chains else _TOP
            checkpoints = {cp.agent_id: cp for cp in checkpoints_txn(raw, low, high, inclusive=first)}
            kept = _within_events(heads, checkpoints, archived, full=full, cap=chunk_events)
            if len(kept) < len(heads):  # the chunk ends early; the next one starts after its last chain
                heads, high = kept, kept[-1].agent_id
                checkpoints = {agent_id: cp for agent_id, cp in checkpoints.items() if agent_id <= high}
            bounds = {"low": low, "high": high}
            with raw.cursor(row_factory=class_row(LegacySeal)) as seals_cur:
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
                        checked, position = check_chain(chain_rows, w.head, w.seal, keys, w.start)
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
                if keys is not None and seal.key_id in keys and not seal_holds(seal, keys):
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

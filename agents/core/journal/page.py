"""The console's window on one agent's chain: a page of its events, each judged by :class:`ChainWalk` as the full
walk judges it, at the cost of the page rather than the chain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from psycopg.rows import class_row, dict_row

from agents.core.journal.archived import ArchivedPart, archive_seal_problem
from agents.core.journal.reads import snapshot
from agents.core.journal.walk import SEALS_QUERY, ChainBreak, ChainHead, ChainPosition, ChainWalk, LegacySeal
from models.audit_keys import AuditKeys
from models.db import Database
from models.schemas import JournalEvent


@dataclass(frozen=True, slots=True)
class JournalPage:
    """A window of one agent's chain (events ``first_seq``..``last_seq``, shown newest first) and its first broken
    link, each event judged by :class:`ChainWalk` as the full walk judges it; nothing before ``first_seq - 1`` is
    read (docs/explanation/journal-and-transitions.md#the-consoles-window)."""

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
    with snapshot(db) as raw:
        with raw.cursor(row_factory=class_row(ChainHead)) as heads_cur:
            heads_cur.execute(
                "SELECT id AS agent_id, journal_seq AS seq, journal_head AS hash, revision, phase, request_id,"
                " false AS deleted FROM agents WHERE id = %s",
                (agent_id,),
            )
            head = heads_cur.fetchone()
        if head is None:
            return None
        with raw.cursor(row_factory=class_row(LegacySeal)) as seals_cur:
            seals_cur.execute(f"{SEALS_QUERY} WHERE agent_id = %s", (agent_id,))
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
    shown = [row for row in rows if first <= row["seq"] <= last]
    broken, unchecked = _window_break(agent_id, rows, first, last, head, seal, archived, db.audit_keys)
    events = tuple(JournalEvent.model_validate(row) for row in reversed(shown))
    return JournalPage(events, first, last, head.seq, broken, unchecked, archived_seq)


def _window_break(
    agent_id: UUID,
    rows: list[dict[str, Any]],
    first: int,
    last: int,
    head: ChainHead,
    seal: LegacySeal | None,
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

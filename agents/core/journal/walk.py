"""How one chain is judged, event by event (:class:`ChainWalk`): `keel audit verify`, the console's window and
`keel audit archive` all judge an event with it, so they cannot disagree. Also what a walk reports (a break, events it
could not check) and where it stands (:class:`ChainPosition`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row

from agents.core.journal.chain import HASHED, link_problem
from models.audit_keys import AuditKeys, legacy_seal_parts
from models.tables import GENESIS_HASH


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
class ChainHead:
    """Where a chain ends, as its agent row (or a deleted agent's tombstone) says, with the state it records."""

    agent_id: UUID
    seq: int
    hash: str
    revision: int
    phase: str
    request_id: str | None
    deleted: bool  # the head is a deleted agent's tombstone: its chain must end with its delete event


@dataclass(frozen=True, slots=True)
class LegacySeal:
    """A chain's legacy part as migration 0015 sealed it."""

    agent_id: UUID
    seq: int
    head: str
    key_id: str
    seal: str


#: The legacy seals, as :class:`LegacySeal` rows; callers add the agents they want.
SEALS_QUERY = "SELECT agent_id, seq, head, key_id, seal FROM audit.legacy_chains"


def _is_delete(fields: Mapping[str, Any]) -> bool:
    return bool(fields["kind"] == "operator" and fields["event"] == "delete")


def legacy_seals(conn: psycopg.Connection[Any], agent_ids: list[UUID]) -> dict[UUID, LegacySeal]:
    """The legacy seals (migration 0015) of these agents' chains, in the caller's transaction."""
    with conn.cursor(row_factory=class_row(LegacySeal)) as cur:
        cur.execute(f"{SEALS_QUERY} WHERE agent_id = ANY(%s)", (agent_ids,))
        return {seal.agent_id: seal for seal in cur}


def seal_holds(seal: LegacySeal, keys: AuditKeys) -> bool:
    return keys.verifies(seal.key_id, legacy_seal_parts(str(seal.agent_id), seal.seq, seal.head), seal.seal)


#: (revision, phase, request id) as a chain's last transition event left them.
ChainState = tuple[int, str | None, str | None]
GENESIS_STATE: ChainState = (0, "idle", None)


@dataclass(frozen=True, slots=True)
class ChainPosition:
    """Where a walk along one chain stands: past event ``seq`` (0: none yet), whose hash is ``hash``; the state its
    last transition event left (None: not known — a window that starts mid-chain), the seq of the chain's first keyed
    event and of its delete event (0: none yet), and how many of its events so far are legacy (unkeyed).
    ``archived``: the events up to ``seq`` left the database (`keel audit archive`); this is their archived head."""

    seq: int = 0
    hash: str = GENESIS_HASH
    state: ChainState | None = GENESIS_STATE
    keyed_at: int = 0
    deleted_at: int = 0
    legacy: int = 0
    archived: bool = False

    def as_head(self) -> dict[str, Any]:
        """The position as ``audit.archived_partitions.heads`` keeps it for one agent."""
        revision, phase, request_id = self.state or GENESIS_STATE
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


class ChainWalk:
    """The one check of one chain's events, in seq order from a :class:`ChainPosition` (:meth:`step`), then of its
    head (:meth:`end`); what it checks: docs/explanation/journal-and-transitions.md#how-one-chain-is-judged."""

    def __init__(
        self, agent_id: UUID, keys: AuditKeys | None, seal: LegacySeal | None, start: ChainPosition | None = None
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
        if not seal_holds(seal, keys):
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
        fields = {name: row[name] for name in HASHED}
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
            if problem := link_problem(agent_id, keys, None, fields, digest):
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
            elif problem := link_problem(agent_id, keys, key_id, fields, digest):
                return self._break(seq, jid, problem)
        if fields["kind"] == "transition":
            self.state = (fields["revision"], fields["to_phase"], fields["request_id"])
        if _is_delete(fields):
            self.deleted_at = seq
        self.expected_prev, self.expected_seq = digest, seq + 1
        return None

    def end(self, head: ChainHead) -> ChainBreak | None:
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


def check_chain(
    rows: Iterator[Mapping[str, Any]],
    head: ChainHead,
    seal: LegacySeal | None,
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

"""Seals on Keel's own audit records (``audit_verifications``, ``audit_shipments``, ``audit_verified_chains``): the
application role writes them, so each row carries an HMAC under the journal's key ring, and a row whose seal does not
hold is taken for a forgery. What that stops and what not, and how checkpoints and their marks hold:
docs/explanation/storage-and-jobs.md#sealed-audit-records."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Protocol
from uuid import UUID

import psycopg
from psycopg.rows import class_row, dict_row

from models.clock import rfc3339

VERIFICATION_SEAL = "keel-audit-verification-v1"
SHIPMENT_SEAL = "keel-audit-shipment-v1"
CHECKPOINT_SEAL = "keel-audit-checkpoint-v1"
CHECKPOINT_BROKEN_SEAL = "keel-audit-checkpoint-broken-v1"


def _details_text(details: Mapping[str, Any]) -> str:
    # jsonb keeps neither key order nor spacing: seal a canonical text, the same before and after a round trip.
    return json.dumps(details, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def verification_seal_parts(
    *, at: datetime, source: str, ok: bool, agents: int, events: int, breaks: int, details: Mapping[str, Any]
) -> list[str | int | None]:
    """What a verification's seal is an HMAC of (every field the alert and the console read)."""
    return [VERIFICATION_SEAL, rfc3339(at), source, int(ok), agents, events, breaks, _details_text(details)]


def shipment_seal_parts(
    *, destination: str, first_id: int, last_id: int, events: int, segment: str, manifest_sha256: str
) -> list[str | int | None]:
    """What a shipment's seal is an HMAC of (every field the shipper and the measures read)."""
    return [SHIPMENT_SEAL, destination, first_id, last_id, events, segment, manifest_sha256]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One row of ``audit_verified_chains``: chain ``agent_id`` was verified up to event ``seq``, whose link is
    ``hash``; the walk there had seen the state (revision, phase, request id) of its last transition event, its first
    keyed event ``keyed_at``, its delete event ``deleted_at`` (0: none) and ``legacy`` unkeyed events. ``broken_seq``:
    a verify found the chain broken at that event (None: never)."""

    agent_id: UUID
    seq: int
    hash: str
    revision: int
    phase: str | None
    request_id: str | None
    keyed_at: int
    deleted_at: int
    legacy: int
    key_id: str
    seal: str
    broken_seq: int | None = None
    #: When the verify that set it ran (the database's clock; not sealed: it says when, it proves nothing).
    verified_at: datetime | None = None


def checkpoint_seal_parts(
    *,
    agent_id: UUID,
    seq: int,
    hash: str,
    revision: int,
    phase: str | None,
    request_id: str | None,
    keyed_at: int,
    deleted_at: int,
    legacy: int,
    broken_seq: int | None = None,
) -> list[str | int | None]:
    """What a checkpoint's seal is an HMAC of (every field an incremental verify starts its walk from, and its mark)."""
    parts: list[str | int | None] = [
        str(agent_id),
        seq,
        hash,
        revision,
        phase,
        request_id,
        keyed_at,
        deleted_at,
        legacy,
    ]
    if broken_seq is None:
        return [CHECKPOINT_SEAL, *parts]
    return [CHECKPOINT_BROKEN_SEAL, *parts, broken_seq]


def checkpoint_parts_of(cp: Checkpoint) -> list[str | int | None]:
    return checkpoint_seal_parts(
        agent_id=cp.agent_id, seq=cp.seq, hash=cp.hash, revision=cp.revision, phase=cp.phase,
        request_id=cp.request_id, keyed_at=cp.keyed_at, deleted_at=cp.deleted_at, legacy=cp.legacy,
        broken_seq=cp.broken_seq,
    )  # fmt: skip


_CHECKPOINTS = (
    "SELECT agent_id, seq, hash, revision, phase, request_id, keyed_at, deleted_at, legacy, key_id, seal, broken_seq,"
    " verified_at FROM audit_verified_chains WHERE agent_id {low} %(low)s AND agent_id <= %(high)s ORDER BY agent_id"
)


def checkpoints_txn(conn: psycopg.Connection[Any], low: UUID, high: UUID, *, inclusive: bool) -> list[Checkpoint]:
    """The checkpoints of the chains from ``low`` (excluded unless ``inclusive``) to ``high``, in the caller's
    transaction (one index range read)."""
    with conn.cursor(row_factory=class_row(Checkpoint)) as cur:
        cur.execute(_CHECKPOINTS.format(low=">=" if inclusive else ">"), {"low": low, "high": high})
        return cur.fetchall()


_SAVE_CHECKPOINT = (
    "INSERT INTO audit_verified_chains"
    " (agent_id, seq, hash, revision, phase, request_id, keyed_at, deleted_at, legacy, key_id, seal, broken_seq)"
    " VALUES (%(agent_id)s, %(seq)s, %(hash)s, %(revision)s, %(phase)s, %(request_id)s, %(keyed_at)s,"
    " %(deleted_at)s, %(legacy)s, %(key_id)s, %(seal)s, %(broken_seq)s)"
    " ON CONFLICT (agent_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash, revision = excluded.revision,"
    " phase = excluded.phase, request_id = excluded.request_id, keyed_at = excluded.keyed_at,"
    " deleted_at = excluded.deleted_at, legacy = excluded.legacy, key_id = excluded.key_id, seal = excluded.seal,"
    " broken_seq = excluded.broken_seq, verified_at = clock_timestamp()"
    # A marked row stays as it is (its guard would refuse the UPDATE): a pass that read it before the mark skips it.
    " WHERE audit_verified_chains.broken_seq IS NULL"
)


def save_checkpoints_txn(cur: psycopg.Cursor[Any], checkpoints: list[Checkpoint]) -> None:
    """Store (or move, or mark broken) these chains' checkpoints in the caller's transaction; one marked broken
    already stays as it is. A concurrent verify may move one back to where its older snapshot stood: that only makes
    the next pass read a little more."""
    if checkpoints:
        cur.executemany(
            _SAVE_CHECKPOINT,
            [asdict(cp) for cp in checkpoints],
        )


class SealKeys(Protocol):
    """What checking a seal needs of the audit key ring (models/audit_keys.py)."""

    def __contains__(self, key_id: object) -> bool: ...

    def verifies(self, key_id: str, parts: list[str | int | None], digest: str) -> bool: ...


def seal_problem(
    keys: SealKeys | None, key_id: str | None, parts: list[str | int | None], seal: str | None
) -> str | None:
    """Why the record's seal cannot be believed, as a phrase; None when it holds."""
    if keys is None:
        return "no audit key ring to check its seal with (KEEL_AUDIT_KEYS)"
    if not key_id or not seal:
        return "it carries no seal"
    if key_id not in keys:
        return f"it is sealed with audit key {key_id!r}, which the key ring (KEEL_AUDIT_KEYS) does not hold"
    if not keys.verifies(key_id, parts, seal):
        return "its seal does not match its content: Keel did not write it (forged with database credentials?)"
    return None


@dataclass(frozen=True, slots=True)
class Recorded:
    """What ``audit_shipments`` says about a destination, believing only rows whose seal holds."""

    segment: str | None  # the last believed row's segment (None: none)
    last_id: int | None  # and the last journal id it covers
    forged: tuple[str, ...] = ()  # one line per row whose seal does not hold: passed over
    unchecked: tuple[str, ...] = ()  # one line per row sealed with a key the ring lacks: passed over too


def recorded_shipments(
    conn: psycopg.Connection[Any], destination: str, keys: SealKeys | None, *, every: bool = False
) -> Recorded:
    """The latest row of ``audit_shipments`` for ``destination`` whose seal holds under ``keys``, and a line for
    each row after it whose seal does not (a row inserted with the database's credentials but not the audit key:
    see models/audit_records.py) or cannot be checked (its key is not in the ring: taken for neither); with
    ``every``, for each such row of the destination. Without ``keys`` no seal can be checked: the latest row is
    taken, for what it is worth."""
    forged: list[str] = []
    unchecked: list[str] = []
    found: tuple[str, int] | None = None
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT first_id, last_id, events, segment, manifest_sha256, key_id, seal FROM audit_shipments"
            " WHERE destination = %s ORDER BY last_id DESC, shipped_at DESC",
            (destination,),
        )
        for row in cur:
            if keys is None:
                return Recorded(str(row["segment"]), int(row["last_id"]))
            parts = shipment_seal_parts(
                destination=destination,
                first_id=int(row["first_id"]),
                last_id=int(row["last_id"]),
                events=int(row["events"]),
                segment=str(row["segment"]),
                manifest_sha256=str(row["manifest_sha256"]),
            )
            problem = seal_problem(keys, row["key_id"], parts, row["seal"])
            if problem is None:
                if found is None:
                    found = (str(row["segment"]), int(row["last_id"]))
                if not every:
                    break
                continue
            line = (
                f"audit_shipments records {row['segment']} (ids {row['first_id']}..{row['last_id']}) as shipped to"
                f" {destination}, but {problem}"
            )
            (unchecked if row["key_id"] and row["key_id"] not in keys else forged).append(line)
    if found is None:
        return Recorded(None, None, tuple(forged), tuple(unchecked))
    return Recorded(found[0], found[1], tuple(forged), tuple(unchecked))


@dataclass(frozen=True, slots=True)
class ShipLag:
    """How far shipping to a destination is behind the journal, by the database's believed records and clock."""

    last_id: int  # the last journal id recorded (sealed) as shipped; 0: none
    unshipped: int  # events past it
    oldest_age_seconds: float  # how old the oldest of them is (0: none)


def ship_lag_txn(conn: psycopg.Connection[Any], destination: str, keys: SealKeys | None) -> ShipLag:
    """The journal events not yet recorded as shipped to ``destination`` (rows whose seal fails do not count), and
    the age of the oldest, measured on the database's clock."""
    last_id = recorded_shipments(conn, destination, keys).last_id or 0
    row = conn.execute(
        "SELECT count(*), coalesce(extract(epoch FROM clock_timestamp() - min(at)), 0)::float8"
        " FROM audit.journal WHERE id > %s",
        (last_id,),
    ).fetchone()
    assert row is not None
    return ShipLag(last_id, int(row[0]), max(0.0, float(row[1])))

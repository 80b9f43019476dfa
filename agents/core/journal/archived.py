"""The records of the journal's archived parts (``audit.archived_partitions``, written by `keel audit archive`):
their seals, their order, and the archived head each gives a chain's walk to start from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row

from agents.core.journal.walk import ChainPosition
from models.audit_keys import AuditKeys
from models.clock import rfc3339

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

"""Tampering with the journal as someone holding the database but not the audit key would: rewriting a chain and
relinking it with plain sha256 or a key of their own; and `keel audit verify` run as a process, to read what it says."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row

from agents.core import journal
from models.audit_keys import AuditKeys
from models.tables import GENESIS_HASH
from tests.support.audit import as_superuser, clean_env

KEEL = str(Path(sys.executable).parent / "keel")
HASHED = journal.HASHED  # the linked fields, as the chain query names them
#: An event's columns in INSERT order (below), as chain() names them.
COLUMNS = ("agent_id", *HASHED[1:], "prev_hash", "hash", "key_id")
#: A key of the attacker's own.
FORGER = "mallory-has-the-database-but-not-the-key-000"


def keel_verify(db_url: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KEEL, "audit", "verify"],
        env={**clean_env(), "KEEL_DATABASE_URL": db_url, "KEEL_HOME": str(tmp_path / ".keel"), **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


Link = Callable[[dict[str, Any]], tuple[str, str | None]]


def with_sha256(keep_key_id: bool = True) -> Link:
    """Relink with the plain sha256 anyone can compute (the pre-0015 link), keeping or dropping the key id."""
    return lambda e: (journal.event_hash(**linked_fields(e)), e["key_id"] if keep_key_id else None)


def under(keys: AuditKeys, key_id: str) -> Link:
    """Relink with an HMAC under a key of the attacker's own."""
    return lambda e: (journal.event_mac(keys, key_id, **linked_fields(e)), key_id)


def linked_fields(e: dict[str, Any]) -> dict[str, Any]:
    return {"agent_id": e["agent_id"], **{name: e[name] for name in HASHED}}


def chain(raw: psycopg.Connection[Any], agent_id: UUID) -> list[dict[str, Any]]:
    with raw.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT id, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,"
            " details::text AS details_json, at, prev_hash, hash, key_id FROM audit.journal WHERE agent_id = %s"
            " ORDER BY seq",
            (agent_id,),
        )
        return cur.fetchall()


def rewrite(
    raw: psycopg.Connection[Any],
    agent_id: UUID,
    events: list[dict[str, Any]],
    link: Link,
    *,
    from_seq: int = 1,
    extra: tuple[tuple[str, tuple[Any, ...]], ...] = (),
) -> None:
    """Replace the agent's chain with ``events``, numbered 1..n and relinked with ``link`` from ``from_seq`` on (the
    ones before keep their links), and move the agent's head to the new last event — a chain recomputed by a
    superuser who does not hold the key."""
    prev, rows = GENESIS_HASH, []
    for seq, original in enumerate(events, start=1):
        e = {**original, "seq": seq, "prev_hash": prev}
        digest, key_id = (original["hash"], original["key_id"]) if seq < from_seq else link(e)
        rows.append({**e, "hash": digest, "key_id": key_id})
        prev = digest
    inserts = [
        (
            "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision,"
            " decision, details, at, prev_hash, hash, key_id)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            tuple(r[c] for c in COLUMNS),
        )
        for r in rows
    ]
    as_superuser(
        raw,
        ("DELETE FROM audit.journal WHERE agent_id = %s", (agent_id,)),
        *inserts,
        ("UPDATE agents SET journal_seq = %s, journal_head = %s WHERE id = %s", (len(rows), prev, agent_id)),
        *extra,
    )


def edited_at(events: list[dict[str, Any]], seq: int) -> list[dict[str, Any]]:
    return [{**e, "actor": "mallory"} if e["seq"] == seq else e for e in events]

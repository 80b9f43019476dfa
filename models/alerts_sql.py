"""Alerts SQL: episodes, the beat leader's terms, the leader's periodic chores, recorded audit verifies. Every time
here is the database's (``clock_timestamp()``), so two beats whose hosts disagree by minutes still agree on when an
episode started, when a chore is due and how long nobody led."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row

from models.audit_keys import AuditKeyMissing
from models.audit_records import SealKeys, seal_problem, verification_seal_parts
from models.db import Database, end_read


@dataclass(frozen=True, slots=True)
class Episode:
    """One firing of an alert, open until ``resolved_at``."""

    id: int
    name: str
    started_at: datetime
    resolved_at: datetime | None
    value: float | None  # the measure when the episode opened
    threshold: float | None
    last_value: float | None
    last_evaluated_at: datetime
    details: dict[str, Any]


_EPISODE = "id, name, started_at, resolved_at, value, threshold, last_value, last_evaluated_at, details"


def lock_alert_txn(cur: psycopg.Cursor[Any], name: str) -> Episode | None:
    """Serialize evaluations of alert ``name`` until commit, and return its open episode, if any."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 11))", ("keel-alert:" + name,))
    with cur.connection.cursor(row_factory=class_row(Episode)) as rows:
        rows.execute(f"SELECT {_EPISODE} FROM alert_episodes WHERE name = %s AND resolved_at IS NULL", (name,))
        return rows.fetchone()


def open_episode_txn(
    cur: psycopg.Cursor[Any], name: str, *, value: float | None, threshold: float | None, details: dict[str, Any]
) -> Episode | None:
    """Open an episode of ``name`` starting now; None if one is open already (the partial unique index decides,
    whoever else is trying at the same moment)."""
    with cur.connection.cursor(row_factory=class_row(Episode)) as rows:
        rows.execute(
            "INSERT INTO alert_episodes (name, started_at, value, threshold, last_value, last_evaluated_at, details)"
            " VALUES (%s, clock_timestamp(), %s, %s, %s, clock_timestamp(), %s)"
            f" ON CONFLICT (name) WHERE resolved_at IS NULL DO NOTHING RETURNING {_EPISODE}",
            (name, value, threshold, value, json.dumps(details)),
        )
        return rows.fetchone()


def note_evaluation_txn(
    cur: psycopg.Cursor[Any], episode_id: int, *, value: float | None, clear_since: datetime | None
) -> None:
    """Record an evaluation of an open episode that stays open: the latest value, and since when the condition has
    been clear (None: it holds)."""
    cur.execute(
        "UPDATE alert_episodes SET last_value = %s, last_evaluated_at = clock_timestamp(),"
        " details = CASE WHEN %s::timestamptz IS NULL THEN details - 'clear_since'"
        "  ELSE details || jsonb_build_object('clear_since', %s::timestamptz) END"
        " WHERE id = %s AND resolved_at IS NULL",
        (value, clear_since, clear_since, episode_id),
    )


def resolve_episode_txn(
    cur: psycopg.Cursor[Any], episode_id: int, *, value: float | None, clear_since: datetime
) -> Episode | None:
    """Resolve an open episode now; None if it was resolved already."""
    with cur.connection.cursor(row_factory=class_row(Episode)) as rows:
        rows.execute(
            "UPDATE alert_episodes SET resolved_at = greatest(clock_timestamp(), started_at), last_value = %s,"
            " last_evaluated_at = clock_timestamp(),"
            " details = details || jsonb_build_object('clear_since', %s::timestamptz)"
            f" WHERE id = %s AND resolved_at IS NULL RETURNING {_EPISODE}",
            (value, clear_since, episode_id),
        )
        return rows.fetchone()


def open_episode_names_txn(conn: psycopg.Connection[Any]) -> set[str]:
    """The names of the alerts firing now."""
    return {row[0] for row in conn.execute("SELECT name FROM alert_episodes WHERE resolved_at IS NULL")}


def open_episodes(db: Database) -> list[Episode]:
    """The episodes firing now, by name."""
    return list_episodes(db, include_resolved=False, limit=None)


def list_episodes(db: Database, *, include_resolved: bool, limit: int | None) -> list[Episode]:
    """Open episodes (and resolved ones with ``include_resolved``), newest first; at most ``limit``."""
    with db.connection() as conn, conn.cursor(row_factory=class_row(Episode)) as cur:
        cur.execute(
            f"SELECT {_EPISODE} FROM alert_episodes WHERE %s OR resolved_at IS NULL"
            " ORDER BY started_at DESC, id DESC LIMIT %s",
            (include_resolved, limit),
        )
        rows = cur.fetchall()
        end_read(conn)
    return rows


# --- the leader's chores ----------------------------------------------------------------------------------------


def claim_chore(db: Database, name: str, every: timedelta) -> datetime | None:
    """Take chore ``name`` if it last ran at least ``every`` ago (or never): returns the database's time of this
    run, or None if it is not due. Atomic: of two beats asking at once, one gets it."""
    with db.autocommit() as cur:
        cur.execute(
            "INSERT INTO beat_chores (name, last_run_at) VALUES (%s, clock_timestamp())"
            " ON CONFLICT (name) DO UPDATE SET last_run_at = clock_timestamp()"
            " WHERE beat_chores.last_run_at <= clock_timestamp() - %s RETURNING last_run_at",
            (name, every),
        )
        row = cur.fetchone()
    return None if row is None else row[0]


# --- the beat leader's terms ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Term:
    id: int
    leader: str
    started_at: datetime
    gap_seconds: float | None  # how long nobody led before this term; None: the first term ever


def start_term(db: Database, leader: str) -> Term:
    """A new leadership term for ``leader``, starting now; it records how long the beat had no leader."""
    with db.transaction() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended('keel-beat-terms', 11))")
        with cur.connection.cursor(row_factory=class_row(Term)) as rows:
            rows.execute(
                "INSERT INTO beat_terms (leader, started_at, last_tick_at, gap_seconds)"
                " SELECT %s, clock_timestamp(), clock_timestamp(),"
                "  extract(epoch FROM clock_timestamp() - (SELECT max(last_tick_at) FROM beat_terms))::float"
                " RETURNING id, leader, started_at, gap_seconds",
                (leader,),
            )
            term = rows.fetchone()
        # Terms older than a month tell nothing any alert or gauge reads.
        cur.execute("DELETE FROM beat_terms WHERE last_tick_at < clock_timestamp() - interval '30 days'")
    assert term is not None
    return term


def heartbeat(db: Database, term_id: int) -> None:
    """The leader's tick, on the database's clock."""
    with db.autocommit() as cur:
        cur.execute("UPDATE beat_terms SET last_tick_at = clock_timestamp() WHERE id = %s", (term_id,))


def leader_tick_age_txn(conn: psycopg.Connection[Any]) -> float | None:
    """Seconds since a beat leader last ticked, on the database's clock (None: no beat ever led)."""
    row = conn.execute(
        "SELECT extract(epoch FROM clock_timestamp() - max(last_tick_at))::float8 FROM beat_terms"
    ).fetchone()
    return None if row is None or row[0] is None else max(0.0, float(row[0]))


def longest_leader_gap(db: Database, within: timedelta) -> float | None:
    """The longest time without a beat leader (seconds) before a term that began within ``within``; None if no
    term began in that time after one before it."""
    with db.connection() as conn:
        row = conn.execute(
            "SELECT max(gap_seconds) FROM beat_terms WHERE started_at >= clock_timestamp() - %s", (within,)
        ).fetchone()
        end_read(conn)
    return None if row is None or row[0] is None else float(row[0])


# --- audit verifications ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verification:
    id: int
    at: datetime
    source: str  # cli | beat
    ok: bool
    agents: int
    events: int
    breaks: int
    details: dict[str, Any]
    key_id: str | None = None
    seal: str | None = None
    #: Why this row cannot be believed (its seal fails: see models/audit_records.py); None when it holds.
    forged: str | None = None


def record_verification(
    db: Database, *, source: str, ok: bool, agents: int, events: int, breaks: int, details: dict[str, Any]
) -> None:
    """Record a verify's outcome, sealed with the current audit key (at the database's time, which the seal covers)."""
    keys = db.audit_keys
    if keys is None:
        raise AuditKeyMissing()
    with db.autocommit() as cur:
        cur.execute("SELECT clock_timestamp()")
        row = cur.fetchone()
        assert row is not None
        at = row[0]
        parts = verification_seal_parts(
            at=at, source=source, ok=ok, agents=agents, events=events, breaks=breaks, details=details
        )
        cur.execute(
            "INSERT INTO audit_verifications (at, source, ok, agents, events, breaks, details, key_id, seal)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (at, source, ok, agents, events, breaks, json.dumps(details), keys.current, keys.mac(keys.current, parts)),
        )


def may_record_verification(db: Database) -> bool:
    """Whether this database role may record a verification (the auditor role reads only)."""
    with db.connection() as conn:
        row = conn.execute("SELECT has_table_privilege('audit_verifications', 'INSERT')").fetchone()
        end_read(conn)
    return bool(row and row[0])


def last_verification(db: Database) -> Verification | None:
    """The latest recorded `keel audit verify`, whoever ran it, with ``forged`` saying why it cannot be believed
    when its seal does not hold under ``db``'s audit key ring (a row the application's database credentials alone
    could have inserted). A forged latest row is not skipped: it stands for a verify that did not pass."""
    with db.connection() as conn, conn.cursor(row_factory=class_row(Verification)) as cur:
        cur.execute(
            "SELECT id, at, source, ok, agents, events, breaks, details, key_id, seal FROM audit_verifications"
            # By id, not by the time written in the row: a row may not back- or forward-date itself to the top.
            " ORDER BY id DESC LIMIT 1"
        )
        row = cur.fetchone()
        end_read(conn)
    if row is None:
        return None
    parts = verification_seal_parts(
        at=row.at,
        source=row.source,
        ok=row.ok,
        agents=row.agents,
        events=row.events,
        breaks=row.breaks,
        details=row.details if isinstance(row.details, dict) else {},
    )
    problem = seal_problem(db.audit_keys, row.key_id, parts, row.seal)
    return replace(row, forged=problem) if problem is not None else row


#: How many of the latest passing verifications :func:`last_success_age_txn` looks through for one it can believe.
_SUCCESSES_READ = 100


def last_success_age_txn(conn: psycopg.Connection[Any], keys: SealKeys | None) -> float | None:
    """Seconds since the latest recorded `keel audit verify` that passed and whose seal holds under ``keys``, on the
    database's clock (it stamped the row); None when none of the latest passing ones can be believed, or none ran."""
    return _believed_age_txn(conn, keys, "ok")


def last_full_age(db: Database) -> float | None:
    """Seconds since the latest recorded full `keel audit verify` (passed or not) whose seal holds, on the database's
    clock; None when none can be believed, or none ran. The leading beat's full pass is due by it."""
    with db.connection() as conn:
        try:
            return _believed_age_txn(conn, db.audit_keys, "details->>'mode' = 'full'")
        finally:
            end_read(conn)


def _believed_age_txn(conn: psycopg.Connection[Any], keys: SealKeys | None, where: str) -> float | None:
    with conn.cursor(row_factory=class_row(Verification)) as cur:
        cur.execute(
            "SELECT id, at, source, ok, agents, events, breaks, details, key_id, seal FROM audit_verifications"
            f" WHERE {where} ORDER BY id DESC LIMIT %s",
            (_SUCCESSES_READ,),
        )
        rows = cur.fetchall()
    for row in rows:
        details = row.details if isinstance(row.details, dict) else {}
        parts = verification_seal_parts(
            at=row.at, source=row.source, ok=row.ok, agents=row.agents, events=row.events, breaks=row.breaks,
            details=details,
        )  # fmt: skip
        if seal_problem(keys, row.key_id, parts, row.seal) is None:
            found = conn.execute("SELECT extract(epoch FROM clock_timestamp() - %s)::float8", (row.at,)).fetchone()
            assert found is not None
            return max(0.0, float(found[0]))
    return None


def last_success_age(db: Database) -> float | None:
    """:func:`last_success_age_txn` with ``db``'s key ring, in a read of its own."""
    with db.connection() as conn:
        try:
            return last_success_age_txn(conn, db.audit_keys)
        finally:
            end_read(conn)


def outbox_key_exists(db: Database, key: str) -> bool:
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT 1 AS found FROM outbox WHERE key = %s", (key,))
        row = cur.fetchone()
        end_read(conn)
    return row is not None

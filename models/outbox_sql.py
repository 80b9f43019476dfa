"""Outbox SQL: emitting inside a transition, claiming heads of line for the relay, recording what happened."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row

from models.db import Database


@dataclass(frozen=True, slots=True)
class NewMessage:
    key: str
    agent_id: UUID
    request_id: str
    channel: str
    destination: str
    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ClaimedMessage:
    """The head of a destination's line, now this relay's until ``lease_until``."""

    key: str
    channel: str
    destination: str
    payload: dict[str, Any]
    attempts: int
    claim_token: int
    needs_reconcile: bool
    created_at: datetime
    agent_id: UUID


@dataclass(frozen=True, slots=True)
class Delivery:
    message: ClaimedMessage
    external_id: str
    external_url: str | None
    how: str  # sent | reconciled


class LostClaim(RuntimeError):
    """Another relay took the message over (this relay's lease expired): it may not record an outcome."""


def insert_messages_txn(
    cur: psycopg.Cursor[Any], messages: Sequence[NewMessage], now: datetime
) -> tuple[list[str], list[str]]:
    """Insert ``messages`` in order; an existing key is left alone. Returns (inserted, suppressed duplicate) keys."""
    inserted: list[str] = []
    suppressed: list[str] = []
    # seq is taken at insert, but a line is read in commit order only if no two transactions insert into one line
    # at once: hold each destination's advisory lock until commit (sorted, so two emitters cannot deadlock).
    for destination in sorted({m.destination for m in messages}):
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 7))", ("keel-outbox:" + destination,))
    for m in messages:
        cur.execute(
            "INSERT INTO outbox (key, agent_id, request_id, channel, destination, payload, next_attempt_at,"
            " created_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (key) DO NOTHING",
            (m.key, m.agent_id, m.request_id, m.channel, m.destination, json.dumps(m.payload), now, now, now),
        )
        (inserted if cur.rowcount == 1 else suppressed).append(m.key)
    return inserted, suppressed


_CLAIM_COLUMNS = (
    "o.key, o.channel, o.destination, o.payload, o.attempts, o.claim_token, o.needs_reconcile, o.created_at, o.agent_id"
)


_DUE = "((o.status = 'pending' AND o.next_attempt_at <= %(now)s) OR (o.status = 'sending' AND o.lease_until < %(now)s))"


def due_destinations(db: Database, now: datetime, limit: int) -> list[str]:
    """Destinations whose line's head is due (pending and its time come, or sending with an expired lease: a relay
    died mid-send), oldest head first. Heads another relay is claiming right now are skipped (``SKIP LOCKED``)."""
    with db.transaction() as cur:
        cur.execute(
            "WITH heads AS (SELECT DISTINCT ON (destination) key FROM outbox"
            " WHERE status IN ('pending', 'sending') ORDER BY destination, seq)"
            " SELECT o.destination FROM outbox o JOIN heads h ON h.key = o.key"
            f" WHERE {_DUE} ORDER BY o.seq LIMIT %(limit)s FOR UPDATE OF o SKIP LOCKED",
            {"now": now, "limit": limit},
        )
        return [row[0] for row in cur.fetchall()]


def claim_run(db: Database, destination: str, now: datetime, lease: timedelta, limit: int) -> list[ClaimedMessage]:
    """Claim the due messages at the front of ``destination``'s line, in order, up to ``limit``.

    Only a prefix of the line is ever claimed: the run stops at the first message that is not due (waiting out a
    backoff, or held by another relay's live lease), so a later message never overtakes an earlier one. The rows
    are locked in line order (no SKIP LOCKED here: skipping a locked head would let its followers overtake it).
    A message that was ``sending`` with an expired lease is claimed to be reconciled before anything is re-sent.
    """
    with db.transaction() as cur:
        cur.execute(
            f"SELECT o.key, {_DUE} FROM outbox o WHERE o.destination = %(destination)s"
            " AND o.status IN ('pending', 'sending') ORDER BY o.seq LIMIT %(limit)s FOR UPDATE",
            {"now": now, "destination": destination, "limit": limit},
        )
        keys = []
        for key, due in cur.fetchall():
            if not due:
                break
            keys.append(key)
        if not keys:
            return []
        cur.execute(
            "UPDATE outbox o SET needs_reconcile = o.needs_reconcile OR o.status = 'sending', status = 'sending',"
            " lease_until = clock_timestamp() + %(lease)s, attempts = o.attempts + 1, claim_token = o.claim_token + 1,"
            f" updated_at = %(now)s WHERE o.key = ANY(%(keys)s) RETURNING {_CLAIM_COLUMNS}, o.seq",
            {"now": now, "lease": lease, "keys": keys},
        )
        rows = cur.fetchall()
    return [ClaimedMessage(*row[:-1]) for row in sorted(rows, key=lambda r: r[-1])]


def renew(db: Database, message: ClaimedMessage, lease: timedelta) -> bool:
    """Right before a send: extend this relay's lease on ``message``. False if the claim was lost (the lease expired
    and another relay took it): then this relay must not send."""
    with db.autocommit() as cur:
        cur.execute(
            "UPDATE outbox SET lease_until = clock_timestamp() + %s"
            " WHERE key = %s AND claim_token = %s AND status = 'sending' AND lease_until > clock_timestamp()",
            (lease, message.key, message.claim_token),
        )
        return cur.rowcount == 1


def release(db: Database, messages: Sequence[ClaimedMessage], now: datetime) -> None:
    """Give claimed messages that were never attempted back to the line, as they were."""
    if not messages:
        return
    with db.transaction() as cur:
        cur.executemany(
            "UPDATE outbox SET status = 'pending', lease_until = NULL, attempts = attempts - 1, updated_at = %s"
            " WHERE key = %s AND claim_token = %s AND status = 'sending'",
            [(now, m.key, m.claim_token) for m in messages],
        )


def _fenced_update(db: Database, message: ClaimedMessage, sql: str, params: tuple[Any, ...]) -> None:
    with db.transaction() as cur:
        cur.execute(
            sql + " WHERE key = %s AND claim_token = %s AND status = 'sending'",
            (*params, message.key, message.claim_token),
        )
        if cur.rowcount != 1:
            raise LostClaim(message.key)


def record_delivered(db: Database, deliveries: Sequence[Delivery], *, now: datetime) -> None:
    """Mark messages sent and append their confirmations to the delivery log, all in one transaction."""
    if not deliveries:
        return
    with db.transaction() as cur:
        cur.execute(
            "UPDATE outbox o SET status = 'sent', external_id = d.external_id, external_url = d.external_url,"
            " sent_at = %(now)s, lease_until = NULL, needs_reconcile = false, last_error = NULL, updated_at = %(now)s"
            " FROM unnest(%(keys)s::text[], %(tokens)s::bigint[], %(ids)s::text[], %(urls)s::text[])"
            "  AS d(key, claim_token, external_id, external_url)"
            " WHERE o.key = d.key AND o.claim_token = d.claim_token AND o.status = 'sending' RETURNING o.key",
            {
                "now": now,
                "keys": [d.message.key for d in deliveries],
                "tokens": [d.message.claim_token for d in deliveries],
                "ids": [d.external_id for d in deliveries],
                "urls": [d.external_url for d in deliveries],
            },
        )
        recorded = {row[0] for row in cur.fetchall()}
        for d in deliveries:
            if d.message.key not in recorded:
                raise LostClaim(d.message.key)
        cur.execute(
            "INSERT INTO delivery_log (key, external_id, attempt, how, confirmed_at)"
            " SELECT * FROM unnest(%s::text[], %s::text[], %s::int[], %s::text[], %s::timestamptz[])",
            (
                [d.message.key for d in deliveries],
                [d.external_id for d in deliveries],
                [d.message.attempts for d in deliveries],
                [d.how for d in deliveries],
                [now] * len(deliveries),
            ),
        )


def record_retry(
    db: Database, message: ClaimedMessage, *, error: str, delay: timedelta, ambiguous: bool, now: datetime
) -> None:
    """Back to pending for ``delay``; ``ambiguous`` means the receiver may have it: reconcile before resending."""
    _fenced_update(
        db,
        message,
        "UPDATE outbox SET status = 'pending', next_attempt_at = clock_timestamp() + %s, last_error = %s,"
        " lease_until = NULL, needs_reconcile = needs_reconcile OR %s, updated_at = %s",
        (delay, error, ambiguous, now),
    )


def record_dead(db: Database, message: ClaimedMessage, *, error: str, now: datetime, ambiguous: bool = False) -> None:
    """Give up; an ``ambiguous`` last attempt is remembered, so an operator's retry reconciles first."""
    _fenced_update(
        db,
        message,
        "UPDATE outbox SET status = 'dead', last_error = %s, lease_until = NULL,"
        " needs_reconcile = needs_reconcile OR %s, updated_at = %s",
        (error, ambiguous, now),
    )


def revive_txn(cur: psycopg.Cursor[Any], key: str, now: datetime) -> bool:
    """dead → pending (an operator's retry); False if the message is not dead. It will reconcile first if it
    ever might have reached the receiver."""
    cur.execute(
        "UPDATE outbox SET status = 'pending', next_attempt_at = %s, attempts = 0, updated_at = %s"
        " WHERE key = %s AND status = 'dead'",
        (now, now, key),
    )
    return cur.rowcount == 1


def message_row(db: Database, key: str) -> dict[str, Any] | None:
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT * FROM outbox WHERE key = %s", (key,))
        row = cur.fetchone()
        conn.rollback()
    return row


def list_messages(db: Database, status: str | None, limit: int) -> list[dict[str, Any]]:
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT key, channel, destination, status, attempts, next_attempt_at, last_error, external_id, created_at"
            " FROM outbox WHERE (%s::text IS NULL OR status = %s) ORDER BY seq DESC LIMIT %s",
            (status, status, limit),
        )
        rows = cur.fetchall()
        conn.rollback()
    return rows


def stats(db: Database) -> dict[str, Any]:
    """The outbox KPIs: deliveries per key (must be 1), reconciled and dead counts, messages by status."""
    with db.connection() as conn, conn.cursor() as cur:
        cur.execute("SELECT status, count(*) FROM outbox GROUP BY status")
        by_status = {status: n for status, n in cur.fetchall()}
        cur.execute(
            "SELECT count(*), coalesce(max(n), 0), count(*) FILTER (WHERE n > 1)"
            " FROM (SELECT key, count(*) AS n FROM delivery_log GROUP BY key) per_key"
        )
        delivered, max_per_key, duplicated = cur.fetchone() or (0, 0, 0)
        cur.execute("SELECT count(*) FROM delivery_log WHERE how = 'reconciled'")
        reconciled = (cur.fetchone() or (0,))[0]
        conn.rollback()
    return {
        "by_status": by_status,
        "delivered_keys": delivered,
        "max_deliveries_per_key": max_per_key,
        "keys_delivered_more_than_once": duplicated,
        "duplicate_rate": (duplicated / delivered) if delivered else 0.0,
        "reconciled": reconciled,
        "dead": by_status.get("dead", 0),
    }

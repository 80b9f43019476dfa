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

from models.db import Database, end_read
from models.kpi_sql import counters_txn


@dataclass(frozen=True, slots=True)
class NewMessage:
    key: str
    agent_id: UUID | None  # None: one of Keel's own messages (an alert, the KPI report), whose request id says so
    request_id: str
    channel: str
    destination: str
    payload: dict[str, Any]
    #: The W3C trace context of the work that emitted it (None when traces are off): its sends continue that trace.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimedMessage:
    """The head of a destination's line, now this relay's until ``lease_until``."""

    key: str
    channel: str
    destination: str
    payload: dict[str, Any]
    attempts: int  # this one included; rate-limited attempts are not counted here
    rate_limited_attempts: int
    claim_token: int
    needs_reconcile: bool
    created_at: datetime
    agent_id: UUID | None  # None: one of Keel's own messages
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    message: ClaimedMessage
    external_id: str
    external_url: str | None
    how: str  # sent | reconciled


# Every time below is the database's (``now()``, ``clock_timestamp()``): relay and emitter hosts' clocks may be off
# by minutes, and a lease or backoff decided on a host's clock would let a fast relay take over a live lease.


def insert_messages_txn(cur: psycopg.Cursor[Any], messages: Sequence[NewMessage]) -> tuple[list[str], list[str]]:
    """Insert ``messages`` in order, due at once; an existing key is left alone. Returns (inserted, suppressed
    duplicate) keys."""
    inserted: list[str] = []
    suppressed: list[str] = []
    # No lock on the destination's line: the order it keeps is causal
    # (docs/explanation/storage-and-jobs.md#the-outboxs-order-per-destination). A key pruned by retention is refused as
    # an existing one: a suppressed duplicate.
    for m in messages:
        cur.execute(
            "INSERT INTO outbox (key, agent_id, request_id, channel, destination, payload, traceparent,"
            " next_attempt_at, created_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, now(), now(), now())"
            " ON CONFLICT (key) DO NOTHING",
            (m.key, m.agent_id, m.request_id, m.channel, m.destination, json.dumps(m.payload), m.traceparent),
        )
        (inserted if cur.rowcount == 1 else suppressed).append(m.key)
    return inserted, suppressed


_DUE = (
    "((o.status = 'pending' AND o.next_attempt_at <= clock_timestamp())"
    " OR (o.status = 'sending' AND o.lease_until < clock_timestamp()))"
)


#: A pass looks at most this many lines' heads (one index probe each) before it stops; the next pass goes on from
#: there, so each pass costs O(this), not O(lines) or O(backlog).
HEAD_PROBES = 256

# A skip scan of ix_outbox_line: one index probe per destination that has a live message, taking its head (lowest
# seq), from the first destination after ``after`` on (up to ``upto``), until ``limit`` due heads are found or
# ``probes`` heads were looked at (``found`` counts the due heads so far, ``n`` the probes); then the due heads are
# locked, skipping those another relay is claiming, and the walk says where it stopped. One statement, one round trip.
_HEADS = """
WITH RECURSIVE head AS (
    (SELECT o.destination, o.key, {due}::int AS due, {due}::int AS found, 1 AS n FROM outbox o
     WHERE o.status IN ('pending', 'sending') AND o.destination > %(after)s{upto}
     ORDER BY o.destination, o.seq LIMIT 1)
  UNION ALL
    SELECT h.destination, h.key, h.due, l.found + h.due, l.n + 1 FROM head l CROSS JOIN LATERAL (
        SELECT o.destination, o.key, {due}::int AS due FROM outbox o
        WHERE o.status IN ('pending', 'sending') AND o.destination > l.destination{upto}
        ORDER BY o.destination, o.seq LIMIT 1) h
    WHERE l.found < %(limit)s AND l.n < %(probes)s
), locked AS (
    SELECT o.destination, o.seq FROM outbox o WHERE o.key IN (SELECT key FROM head WHERE due = 1) AND {due}
    ORDER BY o.seq LIMIT %(limit)s FOR UPDATE OF o SKIP LOCKED
)
SELECT (SELECT array_agg(destination ORDER BY seq) FROM locked) AS due,
       last.destination AS last, last.found, last.n
FROM (SELECT 1) one LEFT JOIN (SELECT destination, found, n FROM head ORDER BY n DESC LIMIT 1) last ON true
"""


def due_destinations(db: Database, limit: int, *, after: str = "", probes: int = HEAD_PROBES) -> tuple[list[str], str]:
    """Destinations whose line's head is due (pending and its time come, or sending with an expired lease: a relay
    died mid-send), oldest head first, at most ``limit``: the heads of the lines after ``after`` in destination
    order, wrapping around once, no more than ``probes`` of them looked at. Heads another relay is claiming right
    now are skipped (``SKIP LOCKED``). Returns them and where the next pass goes on from (``""``: the first line)."""
    found, cursor = _walk(db, limit, after, None, probes)
    if cursor == "" and after != "" and len(found) < limit:
        more, cursor = _walk(db, limit - len(found), "", after, probes)  # the lines before ``after``
        found += [d for d in more if d not in found]
    return found, cursor


def _walk(db: Database, limit: int, after: str, upto: str | None, probes: int) -> tuple[list[str], str]:
    params = {"after": after, "upto": upto, "limit": limit, "probes": probes}
    # The upper bound is an index condition or nothing ("IS NULL OR" would make it a filter, scanned past).
    sql = _HEADS.format(due=_DUE, upto="" if upto is None else " AND o.destination <= %(upto)s")
    with db.transaction() as cur:
        cur.row_factory = dict_row
        cur.execute(sql, params)
        walk = cur.fetchone()
    assert walk is not None
    # Stopped early (enough due heads, or out of probes): the next pass goes on after the last line looked at.
    # Otherwise the walk reached the last line: the next starts again from the first.
    stopped = walk["n"] is not None and (walk["n"] >= probes or walk["found"] >= limit)
    return list(walk["due"] or []), (walk["last"] if stopped else "")


def claim_run(db: Database, destination: str, lease: timedelta, limit: int) -> list[ClaimedMessage]:
    """Claim the due messages at the front of ``destination``'s line, in order, up to ``limit``.

    Only a prefix of the line is ever claimed: the run stops at the first message that is not due (waiting out a
    backoff, or held by another relay's live lease), so a later message never overtakes an earlier one. The rows
    are locked in line order (no SKIP LOCKED here: skipping a locked head would let its followers overtake it).
    A message that was ``sending`` with an expired lease is claimed to be reconciled before anything is re-sent.
    """
    with db.transaction() as cur:
        cur.row_factory = dict_row
        cur.execute(
            f"SELECT o.key, {_DUE} AS due FROM outbox o WHERE o.destination = %(destination)s"
            " AND o.status IN ('pending', 'sending') ORDER BY o.seq LIMIT %(limit)s FOR UPDATE",
            {"destination": destination, "limit": limit},
        )
        keys = []
        for head in cur.fetchall():
            if not head["due"]:
                break
            keys.append(head["key"])
        if not keys:
            return []
        cur.execute(
            "UPDATE outbox o SET needs_reconcile = o.needs_reconcile OR o.status = 'sending', status = 'sending',"
            " lease_until = clock_timestamp() + %(lease)s, attempts = o.attempts + 1, claim_token = o.claim_token + 1,"
            " updated_at = clock_timestamp() WHERE o.key = ANY(%(keys)s)"
            " RETURNING o.seq, o.key, o.channel, o.destination, o.payload, o.attempts, o.rate_limited_attempts,"
            " o.claim_token, o.needs_reconcile, o.created_at, o.agent_id, o.traceparent",
            {"lease": lease, "keys": keys},
        )
        rows: list[dict[str, Any]] = cur.fetchall()
    return [ClaimedMessage(**{k: v for k, v in row.items() if k != "seq"}) for row in sorted(rows, key=_by_seq)]


def _by_seq(row: dict[str, Any]) -> int:
    seq: int = row["seq"]
    return seq


def renew(db: Database, messages: Sequence[ClaimedMessage], lease: timedelta) -> bool:
    """Right before a reconciliation or a send: extend this relay's lease on ``messages`` (its claimed run) to a
    full lease from now. False if any of them was lost (its lease ran out, or another relay took it over): then
    this relay must not send."""
    with db.autocommit() as cur:
        cur.execute(
            "UPDATE outbox o SET lease_until = clock_timestamp() + %s"
            " FROM unnest(%s::text[], %s::bigint[]) AS m(key, claim_token)"
            " WHERE o.key = m.key AND o.claim_token = m.claim_token AND o.status = 'sending'"
            " AND o.lease_until > clock_timestamp()",
            (lease, [m.key for m in messages], [m.claim_token for m in messages]),
        )
        return cur.rowcount == len(messages)


def release(db: Database, messages: Sequence[ClaimedMessage]) -> None:
    """Give claimed messages that were never attempted back to the line, as they were."""
    if not messages:
        return
    with db.transaction() as cur:
        cur.executemany(
            "UPDATE outbox SET status = 'pending', lease_until = NULL, attempts = attempts - 1,"
            " updated_at = clock_timestamp() WHERE key = %s AND claim_token = %s AND status = 'sending'",
            [(m.key, m.claim_token) for m in messages],
        )


def record_delivered(db: Database, deliveries: Sequence[Delivery]) -> list[Delivery]:
    """Mark messages sent and append their confirmations to the delivery log, in one transaction; only those still
    held under the claim they were sent with (the fence). Returns the deliveries that were not: another relay took
    them over, and their outcome is its to record."""
    if not deliveries:
        return []
    with db.transaction() as cur:
        cur.execute(
            "WITH confirmed AS (UPDATE outbox o SET status = 'sent', external_id = d.external_id,"
            "  external_url = d.external_url, sent_at = clock_timestamp(), lease_until = NULL, needs_reconcile = false,"
            "  last_error = NULL, updated_at = clock_timestamp()"
            "  FROM unnest(%(keys)s::text[], %(tokens)s::bigint[], %(ids)s::text[], %(urls)s::text[],"
            "   %(attempts)s::int[], %(hows)s::text[]) AS d(key, claim_token, external_id, external_url, attempt, how)"
            "  WHERE o.key = d.key AND o.claim_token = d.claim_token AND o.status = 'sending'"
            "  RETURNING o.key, d.external_id, d.attempt, d.how)"
            " INSERT INTO delivery_log (key, external_id, attempt, how, confirmed_at)"
            " SELECT key, external_id, attempt, how, clock_timestamp() FROM confirmed RETURNING key",
            {
                "keys": [d.message.key for d in deliveries],
                "tokens": [d.message.claim_token for d in deliveries],
                "ids": [d.external_id for d in deliveries],
                "urls": [d.external_url for d in deliveries],
                "attempts": [d.message.attempts for d in deliveries],
                "hows": [d.how for d in deliveries],
            },
        )
        recorded = {row[0] for row in cur.fetchall()}
    return [d for d in deliveries if d.message.key not in recorded]


def _fenced_update(db: Database, message: ClaimedMessage, sql: str, params: tuple[Any, ...]) -> bool:
    """``sql`` on ``message`` if this relay still holds it; False if another relay took it over."""
    with db.transaction() as cur:
        cur.execute(
            sql + " WHERE key = %s AND claim_token = %s AND status = 'sending'",
            (*params, message.key, message.claim_token),
        )
        return cur.rowcount == 1


# A rate-limited attempt moves from ``attempts`` to ``rate_limited_attempts``: it has a cap of its own.
_COUNT_AS_RATE_LIMITED = (
    "attempts = attempts - CASE WHEN %s THEN 1 ELSE 0 END,"
    " rate_limited_attempts = rate_limited_attempts + CASE WHEN %s THEN 1 ELSE 0 END"
)


def record_retry(
    db: Database, message: ClaimedMessage, *, error: str, delay: timedelta, ambiguous: bool, rate_limited: bool
) -> bool:
    """Back to pending for ``delay``; ``ambiguous`` means the receiver may have it: reconcile before resending.
    False if another relay took the message over."""
    return _fenced_update(
        db,
        message,
        "UPDATE outbox SET status = 'pending', next_attempt_at = clock_timestamp() + %s, last_error = %s,"
        f" lease_until = NULL, needs_reconcile = needs_reconcile OR %s, {_COUNT_AS_RATE_LIMITED},"
        " updated_at = clock_timestamp()",
        (delay, error, ambiguous, rate_limited, rate_limited),
    )


def record_dead(db: Database, message: ClaimedMessage, *, error: str, ambiguous: bool, rate_limited: bool) -> bool:
    """Give up; an ``ambiguous`` last attempt is remembered (``needs_reconcile``), so an operator's retry
    reconciles first. False if another relay took the message over."""
    return _fenced_update(
        db,
        message,
        "UPDATE outbox SET status = 'dead', last_error = %s, lease_until = NULL,"
        f" needs_reconcile = needs_reconcile OR %s, {_COUNT_AS_RATE_LIMITED}, updated_at = clock_timestamp()",
        (error, ambiguous, rate_limited, rate_limited),
    )


def revive_txn(cur: psycopg.Cursor[Any], key: str) -> bool:
    """dead → pending (an operator's retry), due at once with fresh attempt counts; False if the message is not
    dead. It will reconcile first if it ever might have reached the receiver (``needs_reconcile`` is kept)."""
    cur.execute(
        "UPDATE outbox SET status = 'pending', next_attempt_at = clock_timestamp(), attempts = 0,"
        " rate_limited_attempts = 0, updated_at = clock_timestamp() WHERE key = %s AND status = 'dead'",
        (key,),
    )
    return cur.rowcount == 1


def destinations_txn(cur: psycopg.Cursor[Any], keys: Sequence[str]) -> dict[str, str]:
    """Where each of the messages ``keys`` that is in the outbox goes, by key (primary-key reads)."""
    with cur.connection.cursor(row_factory=dict_row) as named:
        named.execute("SELECT key, destination FROM outbox WHERE key = ANY(%s)", (list(keys),))
        return {row["key"]: row["destination"] for row in named.fetchall()}


def message_row(db: Database, key: str) -> dict[str, Any] | None:
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT * FROM outbox WHERE key = %s", (key,))
        row = cur.fetchone()
        end_read(conn)
    return row


#: What the API shows of a message (its claim bookkeeping stays inside).
_PUBLIC = (
    "o.seq, o.key, o.agent_id, o.request_id, o.channel, o.destination, o.status, o.attempts,"
    " o.rate_limited_attempts, o.next_attempt_at, o.last_error, o.external_id, o.external_url, o.created_at,"
    " o.sent_at, o.payload"
)

# A token limited to a name prefix sees the messages of its agents, deleted ones included.
_PAGE = f"""
SELECT {_PUBLIC} FROM outbox o
WHERE (%(status)s::text IS NULL OR o.status = %(status)s)
  AND (%(channel)s::text IS NULL OR o.channel = %(channel)s)
  AND (%(before)s::bigint IS NULL OR o.seq < %(before)s)
  AND (%(agent)s::uuid IS NULL OR o.agent_id = %(agent)s)
  AND (%(prefix)s::text IS NULL OR o.agent_id IN (
        SELECT id FROM agents WHERE starts_with(name, %(prefix)s)
        UNION ALL SELECT agent_id FROM audit.deleted_agents WHERE starts_with(name, %(prefix)s)))
ORDER BY o.seq DESC LIMIT %(limit)s
"""


def page_messages(
    db: Database,
    *,
    status: str | None,
    channel: str | None,
    before_seq: int | None,
    limit: int,
    name_prefix: str | None,
    agent_id: UUID | None = None,
) -> list[dict[str, Any]]:
    """Messages newest first (by creation), before ``before_seq`` if given, of agents named ``name_prefix…`` if
    given, of agent ``agent_id`` only if given."""
    params = {
        "status": status,
        "channel": channel,
        "before": before_seq,
        "limit": limit,
        "prefix": name_prefix,
        "agent": agent_id,
    }
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_PAGE, params)
        rows = cur.fetchall()
        end_read(conn)
    return rows


#: What the console's Outbox page lists: every message not sent (yet).
UNSENT = ("pending", "sending", "dead")
# Its pages, newest first: the WHERE clause names ix_outbox_unsent's predicate word for word, and the keyset
# condition is added only when there is one (an "IS NULL OR" would keep it out of the index condition), so a page is a
# bounded backward scan of that index.
_UNSENT = f"SELECT {_PUBLIC} FROM outbox o WHERE o.status IN ('pending', 'sending', 'dead')"
_UNSENT_STATUS = " AND o.status = %(status)s"
_UNSENT_BEFORE = " AND o.seq < %(before)s::bigint"
_UNSENT_PREFIX = """ AND o.agent_id IN (
        SELECT id FROM agents WHERE starts_with(name, %(prefix)s)
        UNION ALL SELECT agent_id FROM audit.deleted_agents WHERE starts_with(name, %(prefix)s))"""
_UNSENT_ORDER = " ORDER BY o.seq DESC LIMIT %(limit)s"


def unsent_page(
    db: Database, *, status: str | None, before_seq: int | None, limit: int, name_prefix: str | None
) -> list[dict[str, Any]]:
    """Messages pending, sending or dead (only ``status`` if given), newest first, created before ``before_seq`` if
    given, of agents named ``name_prefix…`` if given; at most ``limit``."""
    if status is not None and status not in UNSENT:
        raise ValueError(f"status {status!r} is not one of {UNSENT}")
    sql = _UNSENT
    if status is not None:
        sql += _UNSENT_STATUS
    if before_seq is not None:
        sql += _UNSENT_BEFORE
    if name_prefix is not None:
        sql += _UNSENT_PREFIX
    params = {"status": status, "before": before_seq, "limit": limit, "prefix": name_prefix}
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql + _UNSENT_ORDER, params)
        rows = cur.fetchall()
        end_read(conn)
    return rows


def request_messages(db: Database, agent_id: UUID, request_id: str) -> list[dict[str, Any]]:
    """Agent ``agent_id``'s request's outbox messages in the order they were emitted."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            f"SELECT {_PUBLIC} FROM outbox o WHERE o.request_id = %s AND o.agent_id = %s ORDER BY o.seq",
            (request_id, agent_id),
        )
        rows = cur.fetchall()
        end_read(conn)
    return rows


def list_messages(db: Database, status: str | None, limit: int) -> list[dict[str, Any]]:
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT key, channel, destination, status, attempts, rate_limited_attempts, next_attempt_at, last_error,"
            " external_id, created_at"
            " FROM outbox WHERE (%s::text IS NULL OR status = %s) ORDER BY seq DESC LIMIT %s",
            (status, status, limit),
        )
        rows = cur.fetchall()
        end_read(conn)
    return rows


# What is not sent yet, through the partial index the console's Outbox page reads (ix_outbox_unsent): sent messages
# are most of the table and are counted by the KPI counters instead.
_UNSENT_BY_STATUS = (
    "SELECT status, count(*) AS n FROM outbox WHERE status IN ('pending', 'sending', 'dead') GROUP BY status"
)
# Only when the counters say a key was confirmed more than once: which keys, and how often the worst one.
_DUPLICATED_KEYS = (
    "SELECT count(*) AS keys, coalesce(max(n), 0) AS worst"
    " FROM (SELECT count(*) AS n FROM delivery_log GROUP BY key HAVING count(*) > 1) per_key"
)


def stats(db: Database) -> dict[str, Any]:
    """The outbox KPIs: deliveries per key (must be 1; docs/reference/kpis.md), reconciled and dead counts, messages by
    status. Read from the KPI counters and partial indexes, never every message or delivery
    (docs/explanation/storage-and-jobs.md#kpi-counters); the delivery log is grouped by key only when the counters show
    a duplicate, to name the keys retention has not removed yet."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        counters = counters_txn(conn)
        cur.execute(_UNSENT_BY_STATUS)
        unsent = {r["status"]: r["n"] for r in cur.fetchall()}
        totals: dict[str, int] = {}
        for (name, _), value in counters.items():  # summed over their labels (channels)
            totals[name] = totals.get(name, 0) + int(value)
        reconciled = totals.get("side_effect_reconciled", 0)
        confirmations = totals.get("side_effect_confirmations", 0)
        extra = totals.get("side_effect_duplicates", 0)
        duplicated, worst = 0, 1 if confirmations else 0
        if extra:
            cur.execute(_DUPLICATED_KEYS)
            row = cur.fetchone() or {"keys": 0, "worst": 0}
            duplicated, worst = int(row["keys"]), max(worst, int(row["worst"]))
        end_read(conn)
    delivered = confirmations - extra
    by_status = {**({"sent": delivered} if delivered else {}), **unsent}
    return {
        "by_status": by_status,
        "delivered_keys": delivered,
        "max_deliveries_per_key": worst,
        "keys_delivered_more_than_once": duplicated,
        "duplicate_deliveries": extra,
        "duplicate_rate": (extra / delivered) if delivered else 0.0,
        "reconciled": reconciled,
        "dead": unsent.get("dead", 0),
    }

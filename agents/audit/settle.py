"""Which journal ids are safe to ship: the highest id below which every id is committed or never will be, and the
check that each agent's events in a new segment follow those already shipped. Why the wait on ``pg_locks`` is
enough: docs/explanation/ingress-and-audit.md#which-ids-are-safe-to-ship."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg

_IN_FLIGHT = (
    "SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{}') FROM pg_locks"
    " WHERE locktype = 'relation' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND relation = 'audit.journal'::regclass AND mode = 'RowExclusiveLock'"
    # A prepared transaction's locks have no pid: IS DISTINCT FROM keeps them (<> would drop a NULL).
    " AND pid IS DISTINCT FROM pg_backend_pid()"
)
_STILL_IN_FLIGHT = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' AND relation = 'audit.journal'::regclass"
    " AND mode = 'RowExclusiveLock' AND virtualtransaction = ANY(%s)"
)


def settled_id(conn: psycopg.Connection[Any], *, timeout: timedelta) -> int | None:
    """The highest journal id below which every id is final (committed, or never to be), once every transaction that
    held the journal's insert lock has ended. None when one is still open after ``timeout``."""
    row = conn.execute("SELECT coalesce(max(id), 0) FROM audit.journal").fetchone()
    highest = int(row[0]) if row else 0
    row = conn.execute(_IN_FLIGHT).fetchone()
    in_flight = list(row[0]) if row else []
    give_up = time.monotonic() + timeout.total_seconds()
    while in_flight:
        row = conn.execute(_STILL_IN_FLIGHT, (in_flight,)).fetchone()
        if not row or not row[0]:
            break
        if time.monotonic() > give_up:
            return None
        time.sleep(0.05)
    return highest


def unfollowed(conn: psycopg.Connection[Any], lines: Sequence[dict[str, Any]], after_id: int) -> str | None:
    """The first agent chain whose events in ``lines`` do not follow its events shipped before (at or below
    ``after_id``), described; None when every chain follows on."""
    firsts: dict[str, int] = {}
    for line in lines:
        firsts.setdefault(str(line["agent_id"]), int(line["seq"]))
    later = {agent: seq for agent, seq in firsts.items() if seq > 1}
    if not later:
        return None
    with conn.cursor() as cur:
        cur.execute(
            "SELECT x.agent_id::text FROM unnest(%s::uuid[], %s::bigint[]) AS x(agent_id, seq)"
            " WHERE EXISTS (SELECT 1 FROM audit.journal j WHERE j.agent_id = x.agent_id AND j.seq = x.seq - 1"
            " AND j.id <= %s)"
            # An archived event was shipped (keel audit archive proved it) and is no longer in the journal.
            " OR EXISTS (SELECT 1 FROM audit.archived_partitions a"
            " WHERE (a.heads -> x.agent_id::text ->> 'last_seq')::bigint >= x.seq - 1)",
            (list(later), list(later.values()), after_id),
        )
        found = {str(r[0]) for r in cur.fetchall()}
    for agent, seq in later.items():
        if agent not in found:
            return f"agent {agent}'s event {seq} would be shipped, but its event {seq - 1} is not among those shipped"
    return None

"""Leadership leases (the beat leader's: tasks/leadership.py), on the database's clock: a holder renews only its own
term, so one paused past its lease steps down. Single autocommit statements, so a transaction pooler carries them
(docs/explanation/storage-and-jobs.md#leadership-leases)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import class_row


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease as its holder got it: ``term`` (the fencing number), since when this term runs, and how many seconds
    of it were left when the database granted it (a duration: no host's clock is compared with the database's)."""

    term: int
    acquired_at: datetime
    remaining_seconds: float


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a leadership now (for the refusal's log line and ``keel``'s readers)."""

    holder: str
    term: int
    acquired_at: datetime
    lease_until: datetime
    expired: bool


_TAKE = (
    "INSERT INTO beat_leadership AS l (name, holder, term, acquired_at, lease_until)"
    " VALUES (%(name)s, %(holder)s, 1, clock_timestamp(), clock_timestamp() + %(lease)s)"
    " ON CONFLICT (name) DO UPDATE SET"
    "  holder = EXCLUDED.holder,"
    # Still ours (whether or not it lapsed meanwhile: nobody else took it, so nobody else led): the same term.
    "  term = CASE WHEN l.holder = EXCLUDED.holder AND l.term = %(term)s THEN l.term ELSE l.term + 1 END,"
    "  acquired_at = CASE WHEN l.holder = EXCLUDED.holder AND l.term = %(term)s THEN l.acquired_at"
    "   ELSE clock_timestamp() END,"
    "  lease_until = clock_timestamp() + %(lease)s"
    " WHERE (l.holder = EXCLUDED.holder AND l.term = %(term)s) OR l.lease_until <= clock_timestamp()"
    " RETURNING l.term, l.acquired_at, extract(epoch FROM l.lease_until - clock_timestamp())::float8"
    "  AS remaining_seconds"
)


def take(conn: psycopg.Connection[Any], name: str, holder: str, *, term: int | None, lease: timedelta) -> Lease | None:
    """Renew ``holder``'s ``term`` of leadership ``name`` (``term`` None: this holder has none), or take the
    leadership in a new term if its lease has run out; None if another holds it. One autocommit statement."""
    with conn.cursor(row_factory=class_row(Lease)) as cur:
        cur.execute(_TAKE, {"name": name, "holder": holder, "term": term, "lease": lease})
        return cur.fetchone()


def give_up(conn: psycopg.Connection[Any], name: str, holder: str, *, term: int) -> bool:
    """End ``holder``'s ``term`` now, so that another may take over at once (a beat stopping cleanly); False if it
    was no longer this holder's."""
    cur = conn.execute(
        "UPDATE beat_leadership SET lease_until = clock_timestamp()"
        " WHERE name = %s AND holder = %s AND term = %s AND lease_until > clock_timestamp()",
        (name, holder, term),
    )
    return cur.rowcount == 1


def current(conn: psycopg.Connection[Any], name: str) -> Holder | None:
    """Who holds leadership ``name`` (or held it last: ``expired``); None if nobody ever did."""
    with conn.cursor(row_factory=class_row(Holder)) as cur:
        cur.execute(
            "SELECT holder, term, acquired_at, lease_until, lease_until <= clock_timestamp() AS expired"
            " FROM beat_leadership WHERE name = %s",
            (name,),
        )
        return cur.fetchone()

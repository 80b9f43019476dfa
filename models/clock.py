"""The one clock: the database's. Every time that decides something (due, deadline, lease) or orders events is
read here, never from a host, so a process whose clock is minutes off still acts on time."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg


def database_now(cur: psycopg.Cursor[Any]) -> datetime:
    """The database server's current time (``clock_timestamp()``, not the transaction's start), in UTC whatever
    the session's TimeZone: psycopg hands timestamptz values back in the session's zone."""
    cur.execute("SELECT clock_timestamp()")
    row = cur.fetchone()
    assert row is not None
    value = row[0]
    assert isinstance(value, datetime)
    return value.astimezone(UTC)


def utc(value: datetime) -> datetime:
    """``value`` (timezone-aware) as UTC: the zone every stored time is computed and named in."""
    if value.tzinfo is None:
        raise ValueError("a naive datetime has no place on Keel's clock; give it a time zone")
    return value.astimezone(UTC)


def rfc3339(at: datetime) -> str:
    """``at`` in the one format Keel writes times in — journal details, error texts, log lines and command output:
    RFC 3339 in UTC with microseconds and ``Z``, e.g. ``2026-11-30T18:22:01.123456Z``."""
    if at.tzinfo is None:  # every stored time is timestamptz; a naive one would be a bug upstream
        raise ValueError(f"naive datetime {at!r} has no time zone")
    return at.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def parse_time(text: str) -> datetime | None:
    """The instant ``text`` names, if it is a time with a zone in any ISO 8601 / RFC 3339 spelling Keel has
    written (``…Z``, ``…+00:00``, a space for the ``T``); None for anything else."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        return None
    return None if at.tzinfo is None else at.astimezone(UTC)

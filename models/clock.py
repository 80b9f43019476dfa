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

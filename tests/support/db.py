"""Small database helpers shared by the tests."""

from __future__ import annotations

import psycopg

from models.db import Database


def expire_lease(db: Database, key: str) -> None:
    """Make job ``key``'s lease run out now (on the database's clock), as if its worker had died."""
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:
        conn.execute("UPDATE jobs SET lease_until = clock_timestamp() - interval '1 second' WHERE key = %s", (key,))

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from models import migrations
from models.urls import libpq_url

pytestmark = pytest.mark.integration


def _tables(url: str) -> set[str]:
    with psycopg.connect(libpq_url(url)) as conn:
        rows: list[Any] = conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_tables WHERE schemaname IN ('public', 'audit')"
        ).fetchall()
    return {r[0] for r in rows}


def test_upgrade_check_downgrade_upgrade(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url)
    assert {"public.agents", "public.requests", "audit.journal"} <= _tables(empty_db_url)
    migrations.check(empty_db_url)  # raises if models/tables.py and the migrated schema differ
    migrations.downgrade(empty_db_url, "base")
    assert _tables(empty_db_url) <= {"public.alembic_version"}
    migrations.upgrade(empty_db_url)
    migrations.check(empty_db_url)

"""The audit key ring the tests link journal events with, and tampering as a database superuser would."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from models.audit_keys import AuditKeys

#: The test suite's key: conftest puts it in KEEL_AUDIT_KEYS / KEEL_AUDIT_KEY_ID, so every process a test starts
#: (worker, beat, API, CLI) links with it, and the ``db`` fixture's Database carries it.
TEST_KEY_ID = "test-1"
TEST_SECRET = "keel-test-suite-audit-key-0123456789abcdefghijklmnop"
TEST_KEYS = AuditKeys.of({TEST_KEY_ID: TEST_SECRET}, TEST_KEY_ID)
TEST_ENV = {"KEEL_AUDIT_KEYS": json.dumps({TEST_KEY_ID: TEST_SECRET}), "KEEL_AUDIT_KEY_ID": TEST_KEY_ID}


def as_superuser(raw: psycopg.Connection[Any], *statements: tuple[str, tuple[Any, ...]]) -> None:
    """Run ``statements`` in one transaction with every user trigger off (``session_replication_role = replica``),
    as someone holding the database's superuser would to get past the journal's append-only triggers."""
    with raw.transaction():
        raw.execute("SET LOCAL session_replication_role = replica")
        # With its triggers off, the partitioned journal (0017) numbers no row: its guard draws each id. The
        # superuser numbers them from the same sequence, by a default of its own for this transaction.
        partitioned = raw.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass('audit.journal')")
        row = partitioned.fetchone()
        if row is not None and row[0]:
            raw.execute("ALTER TABLE audit.journal ALTER COLUMN id SET DEFAULT nextval('audit.journal_id_seq')")
        for sql, params in statements:
            raw.execute(sql, params)
        if row is not None and row[0]:
            raw.execute("ALTER TABLE audit.journal ALTER COLUMN id DROP DEFAULT")


def clean_env() -> dict[str, str]:
    """``os.environ`` without any ``KEEL_*`` setting, but with the test suite's audit key: for a process a test
    starts and configures itself, whose journal events the test's own verify must be able to check."""
    import os

    return {**{k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}, **TEST_ENV}

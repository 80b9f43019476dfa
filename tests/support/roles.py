"""Database roles for tests. Roles are cluster-wide and the cluster is shared with other test runs, so every role a
test session creates has a name of its own (``keel_t<8 hex>_…``) and is dropped, with what it holds in the databases
the session created, at the end; nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from agents.client import Client
from models.db import Database
from models.roles import RoleNames
from models.urls import libpq_url, with_database
from tests.support.audit import TEST_ENV, TEST_KEYS
from tests.support.cli import run_keel

#: The passwords the tests give the application and auditor roles (the local server trusts 127.0.0.1 anyway).
APP_PASSWORD = "app-role-test-password"
AUDITOR_PASSWORD = "auditor-role-test-password"


def unique_names(kind: str = "s") -> RoleNames:
    """Three role names nobody else uses: ``keel_t<kind><8 hex>_owner`` / ``_app`` / ``_auditor``."""
    prefix = f"keel_t{kind}{uuid.uuid4().hex[:8]}"
    return RoleNames(owner=f"{prefix}_owner", app=f"{prefix}_app", auditor=f"{prefix}_auditor")


def as_role(url: str, role: str, password: str | None = None) -> str:
    """``url`` logging in as ``role`` instead."""
    return make_url(url).set(username=role, password=password).render_as_string(hide_password=False)


@dataclass(frozen=True)
class RoledDatabase:
    """A test database migrated as the session's owner role, with the URLs of a superuser and of each role."""

    names: RoleNames
    url: str  # a superuser's (the test's own poking, and migrations)

    @property
    def app_url(self) -> str:
        return as_role(self.url, self.names.app, APP_PASSWORD)

    @property
    def auditor_url(self) -> str:
        return as_role(self.url, self.names.auditor, AUDITOR_PASSWORD)


def drop_roles(server_url: str, roles: Iterable[str], databases: Iterable[str] = ()) -> None:
    """Drop ``roles`` (those that exist), first dropping what they own or were granted in ``databases`` — the test's
    own databases that still exist. Raises if a role is still held elsewhere: it would be another run's."""
    roles = list(roles)
    with psycopg.connect(libpq_url(with_database(server_url, "postgres")), autocommit=True) as admin:
        existing = {r[0] for r in admin.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (roles,))}
        present = {
            r[0] for r in admin.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)", (list(databases),))
        }
        if not existing:
            return
        held = sql.SQL(", ").join(sql.Identifier(r) for r in roles if r in existing)
        for database in sorted(present):
            with psycopg.connect(libpq_url(with_database(server_url, database)), autocommit=True) as conn:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(held))
        for role in roles:
            if role in existing:
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


KEEL = str(Path(sys.executable).parent / "keel")


def keel(url: str, *args: str, names: RoleNames | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``keel`` on ``url`` (KEEL_DATABASE_URL) with the roles ``names``, in a directory of its own."""
    child = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    child["KEEL_DATABASE_URL"] = url
    child |= TEST_ENV  # the journal's key ring (production refuses to start without one)
    if names is not None:
        child |= {
            "KEEL_DB_OWNER_ROLE": names.owner,
            "KEEL_DB_APP_ROLE": names.app,
            "KEEL_DB_AUDITOR_ROLE": names.auditor,
        }
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "keel-roles-tests"
    scratch.mkdir(exist_ok=True)
    return run_keel(args, child | env, scratch)


def connect(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(url), autocommit=True)


def journal_digest(url: str) -> tuple[Any, ...]:
    """The journal as it is: its rows, their order and contents (and whether the table is there at all)."""
    with connect(url) as conn:
        row = conn.execute("SELECT count(*), md5(string_agg(j::text, '|' ORDER BY id)) FROM audit.journal j").fetchone()
        assert row is not None
        return tuple(row)


def with_a_journal(roles_db: RoledDatabase) -> RoledDatabase:
    """``roles_db`` with events in its journal, written through the client as the application role (what the
    ``journaled`` fixtures of the roles tests return)."""
    db = Database(roles_db.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        client = Client(db)
        agent = client.create_agent("ledger", actor="alice")
        client.submit(agent.id, "r-1", {"prompt": "Summarise open incidents"}, actor="alice")
        client.cancel(agent.id, actor="alice", reason="changed my mind")
    finally:
        db.dispose()
    assert journal_digest(roles_db.url)[0] == 3
    return roles_db

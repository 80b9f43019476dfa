"""Database roles for tests. Roles are cluster-wide and the cluster is shared with other test runs, so every role a
test session creates has a name of its own (``keel_t<8 hex>_…``) and is dropped, with what it holds in the databases
the session created, at the end; nothing else is touched."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from models.roles import RoleNames
from models.urls import libpq_url, with_database

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

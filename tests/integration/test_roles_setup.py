"""`keel db roles` (models/roles.py, models/role_steps.py) and migrations as the owner: an existing deployment is
set up once, what the roles should not hold is taken back, and migrations refuse a login or a database the roles do
not fit."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from models import migrations, roles
from models.roles import APP_PRIVILEGES, RoleNames
from models.tables import metadata
from tests.support.roles import (
    RoledDatabase,
    as_role,
    connect,
    drop_roles,
    journal_digest,
    keel,
    unique_names,
    with_a_journal,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def journaled(roles_db: RoledDatabase) -> RoledDatabase:
    """A journal with events in it, written through the client as the application role."""
    return with_a_journal(roles_db)


@pytest.fixture
def fresh_roles(pg_server_url: str, db_url: str) -> Iterator[RoleNames]:
    """Role names nobody created yet; dropped afterwards with what they hold in this test's database."""
    names = unique_names("f")
    yield names
    drop_roles(pg_server_url, [names.app, names.auditor, names.owner], [str(make_url(db_url).database)])


def test_keel_db_roles_sets_up_an_existing_deployment_once(db_url: str, fresh_roles: RoleNames) -> None:
    """A database migrated before roles (everything belongs to the superuser who migrated it): `keel db roles` creates
    the roles, hands the schema to the owner and sets the grants, saying each; run again, it changes nothing."""
    names = fresh_roles
    first = keel(db_url, "db", "roles", names=names, KEEL_DB_APP_PASSWORD="first-app-password")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[:4] == [
        f"created role {names.owner} (NOLOGIN): it owns Keel's schema; migrations act as it",
        f"created role {names.app} (LOGIN)",
        f"set the password of {names.app} (KEEL_DB_APP_PASSWORD)",
        f"created role {names.auditor} (LOGIN), without a password: set KEEL_DB_AUDITOR_PASSWORD and run again,"
        " or ALTER ROLE … PASSWORD",
    ]
    assert "schema audit: owner postgres → " + names.owner in lines
    with connect(db_url) as conn:
        functions = conn.execute(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname IN ('public', 'audit')"
        ).fetchone()
        partitions = conn.execute("SELECT count(*) FROM pg_class WHERE relispartition AND relkind = 'r'").fetchone()
    assert functions is not None and partitions is not None
    tables = len(metadata.tables) + 1 + partitions[0]  # and alembic_version, and the journal's partitions
    assert f"handed {tables} tables, 1 sequence, {functions[0]} functions from postgres to {names.owner}" in lines
    assert (
        f"granted {names.app} its privileges on {len(APP_PRIVILEGES)} tables, sequences and functions"
        " (models/roles.py)" in lines
    )
    assert f"role {names.app}: idle_in_transaction_session_timeout = 5min" in lines
    again = keel(db_url, "db", "roles", names=names, KEEL_DB_APP_PASSWORD="first-app-password")
    assert again.returncode == 0, again.stderr
    assert again.stdout == (
        f"nothing to change: {names.owner} owns Keel's schema; {names.app} and {names.auditor} hold their grants\n"
    )
    # The application role can log in with its password and do its work; the tamper routes are closed to it.
    app_url = as_role(db_url, names.app, "first-app-password")
    with connect(app_url) as app:
        app.execute(
            "INSERT INTO audit_verifications (source, ok, agents, events, breaks, details, key_id, seal)"
            " VALUES ('cli', true, 0, 0, 0, '{}', 'test-1', 'not-a-seal')"
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            app.execute("ALTER TABLE audit.journal DISABLE TRIGGER ALL")
    # Migrations now run as the owner (a superuser connects; what they create is the owner's).
    previous = migrations.revisions()[-2]
    downgraded = keel(db_url, "db", "downgrade", previous, names=names)
    upgraded = keel(db_url, "db", "upgrade", names=names)
    assert (downgraded.returncode, upgraded.returncode) == (0, 0), downgraded.stderr + upgraded.stderr
    with connect(db_url) as conn:
        owners = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('public', 'audit') AND relkind IN ('r', 'i', 'S')"
        ).fetchall()
    assert owners == [(names.owner,)]
    assert keel(db_url, "db", "roles", names=names).stdout.startswith("nothing to change")


def test_keel_db_roles_takes_back_what_the_roles_should_not_hold(journaled: RoledDatabase) -> None:
    names = journaled.names
    app, owner = sql.Identifier(names.app), sql.Identifier(names.owner)
    with connect(journaled.url) as conn:
        conn.execute(sql.SQL("GRANT UPDATE, TRUNCATE ON audit.journal TO {}").format(app))
        conn.execute(sql.SQL("GRANT {} TO {}").format(owner, app))
        conn.execute(sql.SQL("ALTER ROLE {} CREATEROLE").format(app))
        conn.execute(sql.SQL("GRANT INSERT ON audit.journal TO {}").format(sql.Identifier(names.auditor)))
        conn.execute("GRANT DELETE ON audit.journal TO PUBLIC")
    result = keel(journaled.url, "db", "roles", names=names)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"role {names.app}: NOCREATEROLE",
        f"revoked membership of {names.owner} from {names.app}",
        f"revoked from {names.app}: TRUNCATE, UPDATE on audit.journal",
        f"revoked from {names.auditor}: INSERT on audit.journal",
        "revoked from PUBLIC: DELETE on audit.journal",
    ]
    before = journal_digest(journaled.url)
    with connect(journaled.app_url) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("UPDATE audit.journal SET actor = 'mallory'")
    assert journal_digest(journaled.url) == before


def test_keel_db_roles_needs_a_role_that_may_create_roles(roles_db: RoledDatabase) -> None:
    names = unique_names("n")
    result = keel(roles_db.app_url, "db", "roles", names=names)
    assert result.returncode == 1
    assert result.stderr == (
        f"keel: error: database role {roles_db.names.app!r} cannot create roles (missing: {names.owner},"
        f" {names.app}, {names.auditor}): run 'keel db roles' as a superuser (KEEL_MIGRATION_DATABASE_URL)\n"
    )


def test_migrations_refuse_a_role_that_may_not_act_as_the_owner(roles_db: RoledDatabase) -> None:
    result = keel(roles_db.app_url, "db", "downgrade", "0010", names=roles_db.names)
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"keel: error: database role {roles_db.names.app!r} may not act as {roles_db.names.owner!r}, which owns"
        " Keel's schema: migrate as a superuser or a member of it (KEEL_MIGRATION_DATABASE_URL)"
    )
    assert migrations.revision_at(roles_db.url) == migrations.head()


def test_the_migration_cycle_runs_as_the_owner(empty_db_url: str, session_roles: RoleNames) -> None:
    """upgrade → alembic check → downgrade → upgrade, as the owner role: every object it creates is the owner's
    and the grants follow each upgrade."""
    roles.set_up(empty_db_url, session_roles)
    migrations.upgrade(empty_db_url, roles=session_roles)
    migrations.check(empty_db_url)
    migrations.downgrade(empty_db_url, "base", roles=session_roles)
    migrations.upgrade(empty_db_url, roles=session_roles)
    migrations.check(empty_db_url)
    with connect(empty_db_url) as conn:
        owners = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('public', 'audit')"
        ).fetchall()
        journal = conn.execute(
            "SELECT has_table_privilege(%s, 'audit.journal', 'INSERT'),"
            " has_table_privilege(%s, 'audit.journal', 'UPDATE')",
            (session_roles.app, session_roles.app),
        ).fetchone()
    assert owners == [(session_roles.owner,)]
    assert journal == (True, False)


def test_migrations_refuse_a_database_the_roles_were_not_set_up_in(empty_db_url: str, session_roles: RoleNames) -> None:
    """The roles are the cluster's; what the owner may do in a database is that database's: `keel db roles` there."""
    with pytest.raises(roles.RolesError, match=r"may not create Keel's schema in database .*: run 'keel db roles'"):
        migrations.upgrade(empty_db_url, roles=session_roles)
    assert migrations.revision_at(empty_db_url) is None


def test_production_migrations_need_the_roles(roles_db: RoledDatabase) -> None:
    names = unique_names("m")
    result = keel(
        roles_db.url, "db", "upgrade", names=names, KEEL_ENVIRONMENT="production", KEEL_BROKER_URL="redis://x"
    )
    assert result.returncode == 1
    assert result.stderr == (
        f"keel: error: the database roles {names.owner}, {names.app}, {names.auditor} do not exist: run 'keel db"
        " roles' first (as a superuser, KEEL_MIGRATION_DATABASE_URL); in production migrations run as the owner role\n"
    )
    ok = keel(
        roles_db.app_url,
        "db",
        "upgrade",
        names=roles_db.names,
        KEEL_ENVIRONMENT="production",
        KEEL_BROKER_URL="redis://x",
        KEEL_MIGRATION_DATABASE_URL=roles_db.url,
    )
    assert (ok.returncode, ok.stdout) == (0, f"database at {migrations.head()} (head)\n"), ok.stderr

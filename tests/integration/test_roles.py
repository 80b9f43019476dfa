"""The database roles (models/roles.py, `keel db roles`): migrations run as the owner; the application role may
read the journal and append to it and nothing more, whatever route it tries; the auditor reads only; in production
Keel refuses to run as a role that could rewrite the journal. The roles have names of this session's own
(tests/support/roles.py) and are dropped at its end."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from agents.audit.verify import verify_and_record
from agents.client import Client
from agents.observability import alerts
from models import alerts_sql, migrations, roles
from models.db import Database
from models.roles import APP_PRIVILEGES, RoleNames
from models.tables import metadata
from models.urls import libpq_url
from tests.support.audit import TEST_ENV, TEST_KEYS
from tests.support.broker import Broker
from tests.support.proxy import database_behind
from tests.support.roles import RoledDatabase, as_role, drop_roles, unique_names

pytestmark = pytest.mark.integration

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
    return subprocess.run(
        [KEEL, *args], env=child | env, capture_output=True, text=True, timeout=120, cwd=scratch, check=False
    )


def connect(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(url), autocommit=True)


def journal_digest(url: str) -> tuple[Any, ...]:
    """The journal as it is: its rows, their order and contents (and whether the table is there at all)."""
    with connect(url) as conn:
        row = conn.execute("SELECT count(*), md5(string_agg(j::text, '|' ORDER BY id)) FROM audit.journal j").fetchone()
        assert row is not None
        return tuple(row)


@pytest.fixture
def journaled(roles_db: RoledDatabase) -> RoledDatabase:
    """A journal with events in it, written through the client as the application role."""
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


#: Every route the issue names (and a few more) by which a role could rewrite, remove or stop guarding the journal.
TAMPER_ROUTES = {
    "update": "UPDATE audit.journal SET actor = 'mallory'",
    "delete": "DELETE FROM audit.journal",
    "truncate": "TRUNCATE audit.journal",
    "disable the trigger": "ALTER TABLE audit.journal DISABLE TRIGGER journal_no_update_delete",
    "disable every trigger": "ALTER TABLE audit.journal DISABLE TRIGGER ALL",
    "drop the trigger": "DROP TRIGGER journal_no_update_delete ON audit.journal",
    "drop the table": "DROP TABLE audit.journal CASCADE",
    "take the table": "ALTER TABLE audit.journal OWNER TO {app}",
    "session_replication_role": "SET session_replication_role = replica",
    "replace the trigger function": (
        "CREATE OR REPLACE FUNCTION audit.refuse_change() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN RETURN COALESCE(NEW, OLD); END $$"
    ),
    "take the trigger function": "ALTER FUNCTION audit.refuse_change() OWNER TO {app}",
    "add a trigger": (
        "CREATE TRIGGER sneak BEFORE INSERT ON audit.journal FOR EACH ROW EXECUTE FUNCTION audit.refuse_change()"
    ),
    "join the owner role": "GRANT {owner} TO {app}",
    "become the owner": "SET ROLE {owner}",
    "shadow a table in its triggers": "CREATE TEMP TABLE agents (id uuid)",
    "create a function": "CREATE FUNCTION public.keel_sneak() RETURNS int LANGUAGE sql AS 'SELECT 1'",
}


def _statement(route: str, names: RoleNames) -> sql.Composed:
    return sql.SQL(TAMPER_ROUTES[route]).format(app=sql.Identifier(names.app), owner=sql.Identifier(names.owner))


@pytest.mark.parametrize("route", list(TAMPER_ROUTES))
def test_every_tamper_route_is_refused_for_the_application_role(journaled: RoledDatabase, route: str) -> None:
    statement = _statement(route, journaled.names)
    before = journal_digest(journaled.url)
    # The route is real: a superuser takes it (with the triggers switched off, as the outside review did), in a
    # transaction rolled back here.
    with psycopg.connect(libpq_url(journaled.url)) as superuser:
        superuser.execute("SET LOCAL session_replication_role = replica")
        superuser.execute(statement)
        superuser.rollback()
    with connect(journaled.app_url) as app:
        assert app.execute("SELECT current_user").fetchone() == (journaled.names.app,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
            app.execute(statement)
    # Refused by what the role may do, not by the journal's own triggers (which a superuser can switch off).
    assert "append-only" not in str(refused.value)
    assert journal_digest(journaled.url) == before


def test_granting_itself_more_grants_nothing(journaled: RoledDatabase) -> None:
    app_role = journaled.names.app
    with connect(journaled.app_url) as app:
        notices: list[str] = []
        app.add_notice_handler(lambda diag: notices.append(str(diag.message_primary)))
        app.execute(sql.SQL("GRANT ALL ON audit.journal TO {}").format(sql.Identifier(app_role)))
        assert notices == ['no privileges were granted for "journal"']
        held = app.execute(
            "SELECT p FROM unnest(ARRAY['UPDATE', 'DELETE', 'TRUNCATE', 'TRIGGER', 'REFERENCES']) p"
            " WHERE has_table_privilege('audit.journal', p)"
        ).fetchall()
        assert held == []
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for table journal"):
            app.execute("UPDATE audit.journal SET actor = 'mallory'")


def test_the_application_role_is_no_superuser_owns_nothing_and_holds_exactly_its_grants(
    roles_db: RoledDatabase,
) -> None:
    names = roles_db.names
    with connect(roles_db.url) as conn:
        role = conn.execute(
            "SELECT rolsuper, rolcreaterole, rolcreatedb, rolbypassrls, rolreplication, rolcanlogin"
            " FROM pg_roles WHERE rolname = %s",
            (names.app,),
        ).fetchone()
        assert role == (False, False, False, False, False, True)
        owners = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('public', 'audit') AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'i')"
            " UNION SELECT DISTINCT pg_get_userbyid(p.proowner) FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname IN ('public', 'audit')"
            " UNION SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'audit'"
        ).fetchall()
        assert owners == [(names.owner,)], "migrations run as the owner: it owns every object of Keel's schemas"
        granted = conn.execute(
            "SELECT n.nspname || '.' || c.relname, array_agg(a.privilege_type::text ORDER BY a.privilege_type)"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace, aclexplode(c.relacl) a"
            " WHERE n.nspname IN ('public', 'audit') AND a.grantee = %s::regrole GROUP BY 1",
            (names.app,),
        ).fetchall()
        functions = conn.execute(
            "SELECT n.nspname || '.' || p.proname || '(' || oidvectortypes(p.proargtypes) || ')',"
            " array_agg(a.privilege_type::text ORDER BY a.privilege_type)"
            " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace, aclexplode(p.proacl) a"
            " WHERE n.nspname IN ('public', 'audit') AND a.grantee = %s::regrole GROUP BY 1",
            (names.app,),
        ).fetchall()
        assert dict(granted) | dict(functions) == {
            name: sorted(privileges) for name, privileges in APP_PRIVILEGES.items()
        }
        # A function that acts as the owner (SECURITY DEFINER) is for nobody else but the application's entries.
        public = conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname IN ('public', 'audit') AND p.prosecdef"
            " AND has_function_privilege('public', p.oid, 'EXECUTE')"
        ).fetchall()
        assert public == []
        assert conn.execute(
            "SELECT has_parameter_privilege(%s, 'session_replication_role', 'SET')", (names.app,)
        ).fetchone() == (False,)


def test_every_table_has_an_entry_in_the_grants(roles_db: RoledDatabase) -> None:
    """A table added by a migration without an entry in models/roles.APP_PRIVILEGES would be out of the
    application's reach (every privilege not listed is revoked): name it there, with what the code does to it."""
    with connect(roles_db.url) as conn:
        tables = {
            row[0]
            for row in conn.execute(
                "SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname IN ('public', 'audit') AND c.relkind IN ('r', 'p') AND NOT c.relispartition"
            ).fetchall()
        }
        sequences = {
            row[0]
            for row in conn.execute(
                "SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE c.relkind = 'S'"
            ).fetchall()
        }
    modelled = {f"{t.schema or 'public'}.{t.name}" for t in metadata.tables.values()} | {"public.alembic_version"}
    assert tables == modelled
    functions = {name for name in APP_PRIVILEGES if name.endswith(")")}
    assert tables == set(APP_PRIVILEGES) - sequences - functions, "tables without an entry, or entries without a table"


def test_the_auditor_reads_every_table_and_writes_none(journaled: RoledDatabase) -> None:
    with connect(journaled.url) as conn:
        tables = conn.execute(
            "SELECT n.nspname, c.relname, (SELECT attname FROM pg_attribute WHERE attrelid = c.oid AND attnum > 0"
            "  AND attidentity = '' AND NOT attisdropped ORDER BY attnum LIMIT 1)"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('public', 'audit') AND c.relkind IN ('r', 'p') AND NOT c.relispartition"
            " ORDER BY 1, 2"
        ).fetchall()
    assert len(tables) == len(metadata.tables) + 1
    with connect(journaled.auditor_url) as auditor:
        for schema, name, column in tables:
            table, first = sql.Identifier(schema, name), sql.Identifier(column)
            auditor.execute(sql.SQL("SELECT * FROM {} LIMIT 1").format(table))
            for write in (
                sql.SQL("INSERT INTO {} DEFAULT VALUES").format(table),
                sql.SQL("UPDATE {} SET {} = {}").format(table, first, first),
                sql.SQL("DELETE FROM {}").format(table),
                sql.SQL("TRUNCATE {}").format(table),
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    auditor.execute(write)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            auditor.execute("SET session_replication_role = replica")
    assert journal_digest(journaled.url)[0] == 3


def test_the_auditor_verifies_the_journal_without_recording(journaled: RoledDatabase) -> None:
    result = keel(journaled.auditor_url, "audit", "verify", names=journaled.names)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout
        == "ok: 3 events in 1 agent chains verified in this run (full: every chain walked from its start)\n"
    )
    assert "not recorded: this database role may only read" in result.stderr
    listed = keel(journaled.auditor_url, "journal", "--agent", "ledger", names=journaled.names)
    assert listed.returncode == 0 and "changed my mind" not in listed.stderr


# --- keel db roles -------------------------------------------------------------------------------------------------


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


# --- Keel's own audit records hold against the application's credentials ------------------------------------------


def test_a_verification_forged_with_the_applications_credentials_does_not_silence_the_alert(
    journaled: RoledDatabase,
) -> None:
    """Whoever holds keel_app's database credentials (but not the audit key ring) may insert into
    audit_verifications: an "ok" row they make, or a copy of a genuine one, must not stand for a passing verify."""
    db = Database(journaled.app_url, pool_size=2, audit_keys=TEST_KEYS)
    window = timedelta(minutes=15)

    def verdict() -> alerts.Verdict:
        return alerts.audit_verify(alerts.measure(db, window), alerts.Thresholds())

    try:
        alerts_sql.record_verification(db, source="beat", ok=True, agents=1, events=3, breaks=0, details={})
        assert not verdict().firing
        alerts_sql.record_verification(db, source="beat", ok=False, agents=1, events=3, breaks=1, details={})
        assert verdict().firing
        with connect(journaled.app_url) as app:
            app.execute(
                "INSERT INTO audit_verifications (source, ok, agents, events, breaks, details, key_id, seal)"
                " VALUES ('beat', true, 1, 3, 0, '{}', %s, %s)",
                (TEST_KEYS.current, "0" * 64),
            )
            forged = verdict()
            assert forged.firing
            assert forged.summary.startswith("the latest recorded keel audit verify cannot be believed: its seal does")
            # A genuine "ok" copied in front of the failure: the copy's seal is the original's, which is unique.
            with pytest.raises(psycopg.errors.UniqueViolation):
                app.execute(
                    "INSERT INTO audit_verifications (at, source, ok, agents, events, breaks, details, key_id, seal)"
                    " SELECT at, source, ok, agents, events, breaks, details, key_id, seal FROM audit_verifications"
                    " WHERE ok AND seal <> %s ORDER BY id LIMIT 1",
                    ("0" * 64,),
                )
        assert verdict().firing
        # A real verify run afterwards is believed again.
        alerts_sql.record_verification(db, source="cli", ok=True, agents=1, events=3, breaks=0, details={})
        assert not verdict().firing
    finally:
        db.dispose()


def test_the_application_role_may_not_clear_a_chain_found_broken(journaled: RoledDatabase) -> None:
    """Once a verify has found a chain broken (here a full pass, below the checkpoint an earlier pass sealed), the
    application's credentials can neither delete its marked checkpoint nor put an older, unmarked one back; the beat's
    own passes keep failing on it. The owner clears the mark."""
    db = Database(journaled.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        assert verify_and_record(db, "beat").ok
        with connect(journaled.app_url) as app:
            sealed = app.execute("SELECT * FROM audit_verified_chains").fetchone()
        assert sealed is not None
        with connect(journaled.url) as su:
            su.execute("ALTER TABLE audit.journal DISABLE TRIGGER USER")
            su.execute("UPDATE audit.journal SET actor = 'mallory' WHERE seq = 1")
            su.execute("ALTER TABLE audit.journal ENABLE TRIGGER USER")
        assert not verify_and_record(db, "beat", full=True).ok
        with connect(journaled.app_url) as app:
            (agent_id, broken) = app.execute("SELECT agent_id, broken_seq FROM audit_verified_chains").fetchone() or ()
            assert broken == 1
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
                app.execute("DELETE FROM audit_verified_chains")
            for replay in (
                "UPDATE audit_verified_chains SET broken_seq = NULL",
                "UPDATE audit_verified_chains SET seal = %s, broken_seq = NULL",  # the genuine unmarked row's seal
                "INSERT INTO audit_verified_chains SELECT (%s::audit_verified_chains).*"
                " ON CONFLICT (agent_id) DO UPDATE SET broken_seq = NULL, seal = excluded.seal",
            ):
                params = () if "%s" not in replay else ((sealed[-2],) if "seal = %s" in replay else (sealed,))
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="found broken at event 1"):
                    app.execute(replay, params)
        later = verify_and_record(db, "beat")
        assert not later.ok and [(b.agent_id, b.seq) for b in later.breaks] == [(agent_id, 1)]
        with connect(journaled.url) as su:
            su.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(journaled.names.owner)))
            assert su.execute("DELETE FROM audit_verified_chains").rowcount == 1
    finally:
        db.dispose()


def test_the_application_role_may_not_make_a_key_look_pruned(journaled: RoledDatabase) -> None:
    """A tombstone in pruned_keys silently swallows whatever is inserted under its key later (a job, a message): only
    the prune guard writes one, as the owner, for a row actually pruned."""
    with connect(journaled.app_url) as app:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for table pruned_keys"):
            app.execute("INSERT INTO pruned_keys (kind, key, pruned_at) VALUES ('job', 'r-2:plan:agent', now())")
        done = app.execute("SELECT key FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled')").fetchone()
        assert done is not None
        app.execute("DELETE FROM jobs WHERE key = %s", done)  # retention's own route: the guard writes the tombstone
        assert app.execute("SELECT kind FROM pruned_keys WHERE key = %s", done).fetchone() == ("job",)


def test_the_application_role_may_not_put_a_chore_off(journaled: RoledDatabase) -> None:
    """beat_chores is the beat's to write (claiming a chore is an upsert), but not into the future: a chore stamped
    next year (the audit verify) would not be due until then."""
    db = Database(journaled.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        assert alerts_sql.claim_chore(db, "audit_verify", timedelta(hours=1)) is not None
    finally:
        db.dispose()
    with connect(journaled.app_url) as app:
        for statement in (
            "UPDATE beat_chores SET last_run_at = now() + interval '1 year'",
            "INSERT INTO beat_chores (name, last_run_at) VALUES ('audit_verify_full', now() + interval '1 year')",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="after the database's clock"):
                app.execute(statement)


# --- production refuses privileged roles ----------------------------------------------------------------------------


@pytest.fixture
def member_of_owner(pg_server_url: str, roles_db: RoledDatabase) -> Iterator[str]:
    """A login role that is a member of the owner role (a migration account), dropped afterwards."""
    name = f"keel_tm{uuid.uuid4().hex[:8]}_migrator"
    with connect(roles_db.url) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(roles_db.names.owner), sql.Identifier(name)))
    yield as_role(roles_db.url, name)
    drop_roles(pg_server_url, [name])


WRITERS = [
    ("worker",),
    ("beat",),
    ("serve",),
    ("agent", "create", "x"),
    ("token", "create", "t", "--scope", "producer"),
]


@pytest.mark.parametrize("command", WRITERS, ids=" ".join)
def test_production_refuses_to_start_as_a_superuser(
    roles_db: RoledDatabase, broker: Broker, command: tuple[str, ...]
) -> None:
    result = keel(roles_db.url, *command, names=roles_db.names, KEEL_ENVIRONMENT="production", **broker.env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith(
        "keel: error: refusing to run in production as database role 'postgres': it is a superuser. Keel's API,"
        f" workers, beat and the commands that write connect as the application role ({roles_db.names.app}), which"
        " may only read the journal and append to it: create it with 'keel db roles'"
    ), result.stderr
    assert result.stderr.count("\n") == 1, "one line, no traceback"


def test_production_checks_the_role_of_a_database_that_was_unreachable_at_start(
    roles_db: RoledDatabase, broker: Broker
) -> None:
    """A worker started while the database is away must not slip past the check: in production it waits for the
    database, then refuses the superuser as if it had been there all along (review finding: it used to start)."""
    proxy, url = database_behind(roles_db.url)
    proxy.down()
    child = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    child |= TEST_ENV | broker.env | {"KEEL_DATABASE_URL": url, "KEEL_ENVIRONMENT": "production"}
    child |= {"KEEL_DB_OWNER_ROLE": roles_db.names.owner, "KEEL_DB_APP_ROLE": roles_db.names.app}
    child |= {"KEEL_DB_AUDITOR_ROLE": roles_db.names.auditor}
    worker = subprocess.Popen(
        [KEEL, "worker", "-c", "1"], env=child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert worker.stderr is not None
        first = worker.stderr.readline()
        assert first.startswith("keel: database unreachable ("), first
        assert first.rstrip().endswith(
            "waiting for it: in production the database role is checked before anything starts"
        )
        assert worker.poll() is None, "still waiting, not started and not gone"
        proxy.up()
        rest = worker.communicate(timeout=90)[1]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        proxy.down()
    assert worker.returncode == 1, rest
    assert rest.startswith("keel: error: refusing to run in production as database role 'postgres': it is a superuser")


def test_production_refuses_a_bare_asgi_server_as_a_superuser(roles_db: RoledDatabase, broker: Broker) -> None:
    """The API's own startup checks the role, whoever runs it: a plain `uvicorn tasks.api:create --factory` too."""
    child = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    child |= TEST_ENV | broker.env | {"KEEL_DATABASE_URL": roles_db.url, "KEEL_ENVIRONMENT": "production"}
    child |= {"KEEL_DB_OWNER_ROLE": roles_db.names.owner, "KEEL_DB_APP_ROLE": roles_db.names.app}
    uvicorn = [sys.executable, "-m", "uvicorn", "tasks.api:create", "--factory", "--port", "0"]
    result = subprocess.run(uvicorn, env=child, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "refusing to run in production as database role 'postgres': it is a superuser" in result.stderr
    assert "Application startup failed" in result.stderr


def test_production_refuses_the_owner_and_a_role_that_may_rewrite_the_journal(
    roles_db: RoledDatabase, broker: Broker, member_of_owner: str
) -> None:
    def refusal(url: str, *command: str) -> str:
        result = keel(url, *command, names=roles_db.names, KEEL_ENVIRONMENT="production", **broker.env)
        assert result.returncode == 1, result.stdout + result.stderr
        return result.stderr.split(": it ", 1)[1].split(". Keel's", 1)[0]

    owner = roles_db.names.owner
    assert refusal(member_of_owner, "worker") == f"owns audit.journal (as a member of {owner!r})"
    with connect(roles_db.url) as conn:
        conn.execute(sql.SQL("GRANT UPDATE ON audit.journal TO {}").format(sql.Identifier(roles_db.names.app)))
    assert refusal(roles_db.app_url, "beat") == "may UPDATE audit.journal"
    assert refusal(roles_db.app_url, "agent", "create", "x") == "may UPDATE audit.journal"


def test_production_refuses_the_owner_of_the_audit_schema_or_of_the_database(
    roles_db: RoledDatabase, broker: Broker, pg_server_url: str
) -> None:
    """The schema's owner may drop or rename the journal whatever the table's grants say, and the database's owner
    may drop the schema: neither is the application role, and production says which it is and what it owns."""
    name = f"keel_tm{uuid.uuid4().hex[:8]}_schemer"
    database = str(make_url(roles_db.url).database)
    with connect(roles_db.url) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(roles_db.names.app), sql.Identifier(name)))
        row = conn.execute("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()")
        was = row.fetchone()
    assert was is not None
    try:

        def refusal() -> str:
            result = keel(
                as_role(roles_db.url, name), "worker", names=roles_db.names, KEEL_ENVIRONMENT="production", **broker.env
            )
            assert result.returncode == 1, result.stdout + result.stderr
            assert result.stderr.count("\n") == 1, "one line, no traceback"
            assert result.stderr.startswith(f"keel: error: refusing to run in production as database role {name!r}")
            return result.stderr.split(": it ", 1)[1].split(". Keel's", 1)[0]

        with connect(roles_db.url) as conn:
            conn.execute(sql.SQL("ALTER SCHEMA audit OWNER TO {}").format(sql.Identifier(name)))
        assert refusal() == "owns the schema audit (and so may drop or rename audit.journal)"
        with connect(roles_db.url) as conn:
            conn.execute(sql.SQL("ALTER SCHEMA audit OWNER TO {}").format(sql.Identifier(roles_db.names.owner)))
            conn.execute(
                sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(database), sql.Identifier(name))
            )
        assert refusal() == f"owns the database {database!r} (and so may drop the schema audit)"
    finally:
        with connect(roles_db.url) as conn:
            conn.execute(sql.SQL("ALTER SCHEMA audit OWNER TO {}").format(sql.Identifier(roles_db.names.owner)))
            conn.execute(
                sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(database), sql.Identifier(was[0]))
            )
        drop_roles(pg_server_url, [name])


def test_production_reads_and_development_run_as_anyone(roles_db: RoledDatabase, broker: Broker) -> None:
    production = {"KEEL_ENVIRONMENT": "production", **broker.env}
    listed = keel(roles_db.url, "agent", "list", names=roles_db.names, **production)
    assert (listed.returncode, listed.stdout) == (0, "no agents\n"), listed.stderr
    created = keel(roles_db.app_url, "agent", "create", "ops-bot", names=roles_db.names, **production)
    assert created.returncode == 0, created.stderr
    developing = keel(roles_db.url, "agent", "create", "dev-bot", names=roles_db.names, **broker.env)
    assert developing.returncode == 0, developing.stderr

"""What each database role may do (models/roles.py): the application role may read the journal and append to it and
nothing more, whatever route it tries, and Keel's own audit records hold against its credentials; the auditor reads
only. `keel db roles` and migrations are test_roles_setup.py; production's refusals, test_roles_production.py. The
roles have names of this session's own (tests/support/roles.py) and are dropped at its end."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from psycopg import sql

from agents.audit.verify import verify_and_record
from agents.observability import alerts
from models import alerts_sql
from models.db import Database
from models.roles import APP_PRIVILEGES, RoleNames
from models.tables import metadata
from models.urls import libpq_url
from tests.support.audit import TEST_KEYS
from tests.support.roles import (
    RoledDatabase,
    connect,
    journal_digest,
    keel,
    with_a_journal,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def journaled(roles_db: RoledDatabase) -> RoledDatabase:
    """A journal with events in it, written through the client as the application role."""
    return with_a_journal(roles_db)


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

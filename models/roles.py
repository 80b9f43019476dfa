"""The database roles Keel runs under, so that the journal holds against someone with the application's credentials:
the owner of Keel's schema (migrations act as it), the application role (reads the journal and appends to it, and
on the other tables does exactly :data:`APP_PRIVILEGES`), and a read-only auditor. Why the grants are one table
here: docs/explanation/storage-and-jobs.md#database-roles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy
from psycopg import sql

from models.errors import KeelError
from models.keepalives import tcp_options
from models.role_steps import (
    RELATION_KINDS,
    SCHEMAS,
    Conn,
    database_privileges,
    fetch_row,
    fetch_rows,
    grantee_sql,
    idle_timeout,
    listed,
    memberships,
    ownership,
    password_is,
    plain_login,
    privileges_sql,
    role_oid,
    run,
)
from models.settings import Settings
from models.urls import libpq_url

#: What the application role may do, table by table: exactly what the code in agents/, tasks/ and models/ does.
#: ``SELECT … FOR UPDATE/SHARE`` needs UPDATE; ``RETURNING`` and ``ON CONFLICT DO UPDATE`` need SELECT; the KPI
#: triggers run as the role whose statement fires them (hence INSERT on kpi_deltas). Identity columns need no
#: privilege on their sequence; ``job_fencing_token_seq`` is called with nextval().
APP_PRIVILEGES: dict[str, tuple[str, ...]] = {
    "audit.journal": ("SELECT", "INSERT"),  # append-only: no UPDATE, DELETE, TRUNCATE, TRIGGER or REFERENCES
    "audit.deleted_agents": ("SELECT", "INSERT"),  # tombstones, insert-only like the journal
    "audit.legacy_chains": ("SELECT",),  # the seals migration 0015 wrote: verify reads them, nobody writes them again
    "audit.archived_partitions": ("SELECT",),  # `keel audit archive` (the owner) writes them; verify reads them
    "public.agents": ("SELECT", "INSERT", "UPDATE", "DELETE"),  # DELETE: `keel agent delete`, with its tombstone
    # UPDATE: retention's prune of a request (a trigger allows setting pruned_at, nothing else).
    "public.requests": ("SELECT", "INSERT", "UPDATE"),
    "public.jobs": ("SELECT", "INSERT", "UPDATE", "DELETE"),  # DELETE: retention (a trigger: final jobs only)
    "public.schedules": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "public.outbox": ("SELECT", "INSERT", "UPDATE", "DELETE"),  # DELETE: retention (a trigger: sent messages only)
    # No DELETE: a confirmation goes with its pruned message by the foreign key's cascade, run as the owner.
    "public.delivery_log": ("SELECT", "INSERT"),
    # Retention's tombstones: the DELETE's guard writes them as the owner (SECURITY DEFINER, migration 0024). An INSERT
    # of the application's own would make a key look pruned, and the job or message inserted under it later vanish.
    "public.pruned_keys": ("SELECT",),
    "public.api_tokens": ("SELECT", "INSERT", "UPDATE"),  # UPDATE: last use, revocation (a trigger allows no more)
    "public.kpi_deltas": ("SELECT", "INSERT", "UPDATE", "DELETE"),  # the fold locks a batch FOR UPDATE, deletes it
    "public.kpi_rollups": ("SELECT", "INSERT", "UPDATE", "DELETE"),  # DELETE: rollups past the retention
    "public.alert_episodes": ("SELECT", "INSERT", "UPDATE"),
    "public.beat_terms": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    # UPDATE: claim_chore's ON CONFLICT DO UPDATE, the beat's only way to take a chore; a guard (migration 0024) refuses
    # a time after the database's clock, which would put a chore (the audit verify) off. Stamping one now, over and
    # over, still can: the stale-verify alerts (keel_audit_verify_last_success_age_seconds) see that.
    "public.beat_chores": ("SELECT", "INSERT", "UPDATE"),
    "public.beat_leadership": ("SELECT", "INSERT", "UPDATE"),
    "public.audit_verifications": ("SELECT", "INSERT"),
    "public.audit_shipments": ("SELECT", "INSERT"),  # the shipper's progress, insert-only
    # verify's checkpoints, replaced as a chain advances (INSERT ... ON CONFLICT DO UPDATE): the beat's verify runs as
    # this role. Sealed, so a row it writes without the audit key is reported, not believed (models/audit_records.py);
    # no DELETE, and a guard refuses to change a row marked broken (migration 0024): only the owner clears a mark.
    "public.audit_verified_chains": ("SELECT", "INSERT", "UPDATE"),
    "public.console_signouts": ("SELECT", "INSERT", "DELETE"),  # DELETE: sign-outs past their session's expiry
    "public.alembic_version": ("SELECT",),  # the schema check every process makes
    "public.job_fencing_token_seq": ("USAGE",),  # a sequence: nextval() for each claim's fencing token
    # A function (named with its argument types): the beat creates the journal's future months, of a fixed shape, as
    # the owner (SECURITY DEFINER). Partitions themselves get no grant: access goes through audit.journal.
    "audit.keel_ensure_partitions(integer)": ("EXECUTE",),
}

#: How long a session of the application role may sit idle inside a transaction before the server ends it (``keel db
#: roles``): an idle transaction would otherwise hold its locks on the journal, and on the agents it touched, for ever.
APP_IDLE_IN_TRANSACTION_TIMEOUT = "5min"

#: Privileges on audit.journal that would let a role rewrite or remove what it holds.
JOURNAL_TAMPER_PRIVILEGES = ("UPDATE", "DELETE", "TRUNCATE", "TRIGGER", "REFERENCES")

_TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
_SEQUENCE_PRIVILEGES = ("SELECT", "UPDATE", "USAGE")


class RolesError(KeelError):
    """The database roles could not be set up as Keel needs them."""


class PrivilegedRole(KeelError):
    """In production Keel does not run as a database role that could rewrite the journal."""


@dataclass(frozen=True)
class RoleNames:
    owner: str
    app: str
    auditor: str

    @classmethod
    def of(cls, settings: Settings) -> RoleNames:
        return cls(settings.db_owner_role, settings.db_app_role, settings.db_auditor_role)


# --- the owner, for migrations -----------------------------------------------------------------------------------


def become_owner(conn: Conn, names: RoleNames) -> bool:
    """``SET ROLE`` this session to the owner, so that what the migrations create is the owner's. False, and nothing
    done, when the owner role does not exist (a database set up before roles, or the embedded development server);
    :class:`RolesError` when it exists but this login may not act as it, or Keel's tables belong to another role
    (``keel db roles`` hands them over)."""
    owner = role_oid(conn, names.owner)
    if owner is None:
        return False
    me = fetch_row(
        conn,
        "SELECT session_user AS name, pg_has_role(session_user, %(owner)s::oid, 'MEMBER') AS member,"
        " (SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = to_regclass('audit.journal')) AS journal_owner,"
        " current_database() AS database, has_database_privilege(%(owner)s::oid, current_database(), 'CREATE')"
        " AND has_schema_privilege(%(owner)s::oid, 'public', 'CREATE') AS may_create",
        {"owner": owner},
    )
    if not me["member"]:
        raise RolesError(
            f"database role {me['name']!r} may not act as {names.owner!r}, which owns Keel's schema: migrate as a"
            f" superuser or a member of it (KEEL_MIGRATION_DATABASE_URL), or GRANT {names.owner} TO {me['name']}"
        )
    if me["journal_owner"] is not None and me["journal_owner"] != names.owner:
        raise RolesError(
            f"Keel's tables belong to {me['journal_owner']!r}, not to {names.owner!r}: run 'keel db roles' as a"
            " superuser first (it hands them over), then migrate"
        )
    if not me["may_create"]:
        raise RolesError(
            f"role {names.owner!r} may not create Keel's schema in database {me['database']!r}: run 'keel db roles'"
            " on it first (as a superuser)"
        )
    run(conn, sql.SQL("SET ROLE {}").format(sql.Identifier(names.owner)))
    return True


# --- grants --------------------------------------------------------------------------------------------------------


def _relations(conn: Conn) -> list[dict[str, Any]]:
    """Every table, view and sequence of Keel's schemas that no extension owns, with its kind."""
    return fetch_rows(
        conn,
        "SELECT n.nspname AS schema, c.relname AS name, c.relkind AS kind, c.oid, c.relispartition AS partition"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = ANY(%(schemas)s) AND c.relkind = ANY(%(kinds)s)"
        " AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid"
        "                 AND d.deptype = 'e')"
        " ORDER BY 1, 2",
        {"schemas": list(SCHEMAS), "kinds": list(RELATION_KINDS)},
    )


def _held(conn: Conn, grantee: int) -> dict[int, set[str]]:
    """The table-level privileges granted to ``grantee`` (0: PUBLIC) on Keel's relations, by relation oid."""
    held: dict[int, set[str]] = {}
    for row in fetch_rows(
        conn,
        "SELECT c.oid, a.privilege_type AS privilege FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,"
        " aclexplode(c.relacl) a WHERE n.nspname = ANY(%(schemas)s) AND a.grantee = %(grantee)s::oid",
        {"schemas": list(SCHEMAS), "grantee": grantee},
    ):
        held.setdefault(int(row["oid"]), set()).add(str(row["privilege"]))
    return held


def _column_grants(conn: Conn, grantee: int) -> list[dict[str, Any]]:
    """Column-level privileges granted to ``grantee`` (0: PUBLIC) on Keel's tables: Keel grants none."""
    return fetch_rows(
        conn,
        "SELECT n.nspname AS schema, c.relname AS name, att.attname AS column, a.privilege_type AS privilege"
        " FROM pg_attribute att JOIN pg_class c ON c.oid = att.attrelid"
        " JOIN pg_namespace n ON n.oid = c.relnamespace, aclexplode(att.attacl) a"
        " WHERE n.nspname = ANY(%(schemas)s) AND a.grantee = %(grantee)s::oid ORDER BY 1, 2, 3, 4",
        {"schemas": list(SCHEMAS), "grantee": grantee},
    )


def apply_grants(conn: Conn, names: RoleNames) -> list[str]:
    """Make the application's and the auditor's privileges on Keel's relations exactly :data:`APP_PRIVILEGES` and
    SELECT on every table, revoking anything else they (or PUBLIC) hold there. Run as the owner or a superuser,
    inside the caller's transaction. Returns one line per role that changed."""
    relations = _relations(conn)
    targets: list[tuple[str | None, dict[int, tuple[str, ...]]]] = []
    app, auditor = role_oid(conn, names.app), role_oid(conn, names.auditor)
    if app is not None:
        by_name = {f"{r['schema']}.{r['name']}": int(r["oid"]) for r in relations}
        targets.append((names.app, {by_name[n]: p for n, p in APP_PRIVILEGES.items() if n in by_name}))
    if auditor is not None:
        targets.append(
            (names.auditor, {int(r["oid"]): ("SELECT",) for r in relations if r["kind"] != "S" and not r["partition"]})
        )
    targets.append((None, {}))  # PUBLIC: nothing on Keel's relations
    oids = {None: 0, names.app: app or 0, names.auditor: auditor or 0}
    lines = []
    for reader in [r for r, oid in ((names.app, app), (names.auditor, auditor)) if oid is not None]:
        for schema in fetch_rows(
            conn,
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s) AND NOT has_schema_privilege(%s, oid, 'USAGE')"
            " ORDER BY 1",
            (list(SCHEMAS), reader),
        ):
            name = schema["nspname"]
            run(conn, sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(name), sql.Identifier(reader)))
            lines.append(f"granted USAGE on schema {name} to {reader}")
    for role, wanted in targets:
        held = _held(conn, oids[role])
        granted, revoked = 0, []
        for relation in relations:
            oid, kind = int(relation["oid"]), relation["kind"]
            target = sql.Identifier(relation["schema"], relation["name"])
            on = sql.SQL("SEQUENCE ") if kind == "S" else sql.SQL("TABLE ")
            want = set(wanted.get(oid, ()))
            has = held.get(oid, set())
            if want - has:
                order = _SEQUENCE_PRIVILEGES if kind == "S" else _TABLE_PRIVILEGES
                run(
                    conn,
                    sql.SQL("GRANT {} ON {}{} TO {}").format(
                        privileges_sql(p for p in order if p in want - has), on, target, grantee_sql(role)
                    ),
                )
                granted += 1
            if has - want:
                extra = sorted(has - want)
                run(
                    conn,
                    sql.SQL("REVOKE {} ON {}{} FROM {}").format(privileges_sql(extra), on, target, grantee_sql(role)),
                )
                revoked.append(f"{listed(extra)} on {relation['schema']}.{relation['name']}")
        for column in _column_grants(conn, oids[role]):
            run(
                conn,
                sql.SQL("REVOKE {} ({}) ON TABLE {} FROM {}").format(
                    privileges_sql([column["privilege"]]),
                    sql.Identifier(column["column"]),
                    sql.Identifier(column["schema"], column["name"]),
                    grantee_sql(role),
                ),
            )
            revoked.append(f"{column['privilege']} ({column['column']}) on {column['schema']}.{column['name']}")
        who = role or "PUBLIC"
        granted_functions, revoked_functions = _function_grants(conn, role, oids[role], names)
        granted += granted_functions
        revoked += revoked_functions
        if granted:
            lines.append(f"granted {who} its privileges on {granted} tables, sequences and functions (models/roles.py)")
        if revoked:
            lines.append(f"revoked from {who}: {'; '.join(revoked)}")
    return lines


def _function_grants(conn: Conn, role: str | None, grantee: int, names: RoleNames) -> tuple[int, list[str]]:
    """EXECUTE on Keel's SECURITY DEFINER functions (which act as their owner): exactly the application's entries
    in :data:`APP_PRIVILEGES`, nothing for the auditor or PUBLIC (which PostgreSQL gives EXECUTE by default).
    Returns how many it granted and what it revoked."""
    functions = fetch_rows(
        conn,
        "SELECT n.nspname || '.' || p.proname || '(' || oidvectortypes(p.proargtypes) || ')' AS name,"
        " p.oid::regprocedure::text AS signature,"
        " EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a"
        "         WHERE a.grantee = %(grantee)s::oid AND a.privilege_type = 'EXECUTE') AS held"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = ANY(%(schemas)s) AND p.prosecdef"
        " AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid"
        "                 AND d.deptype = 'e')"
        " ORDER BY 1",
        {"schemas": list(SCHEMAS), "grantee": grantee},
    )
    granted, revoked = 0, []
    for function in functions:
        want = role is not None and role == names.app and "EXECUTE" in APP_PRIVILEGES.get(function["name"], ())
        target = sql.SQL(function["signature"])  # regprocedure's text: the catalog's own, quoted where needed
        if want and not function["held"]:
            run(conn, sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(target, grantee_sql(role)))
            granted += 1
        elif function["held"] and not want:
            run(conn, sql.SQL("REVOKE EXECUTE ON FUNCTION {} FROM {}").format(target, grantee_sql(role)))
            revoked.append(f"EXECUTE on {function['name']}")
    return granted, revoked


# --- keel db roles -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Passwords:
    app: str | None = None
    auditor: str | None = None

    @classmethod
    def of(cls, settings: Settings) -> Passwords:
        def plain(value: Any) -> str | None:
            return None if value is None else str(value.get_secret_value())

        return cls(plain(settings.db_app_password), plain(settings.db_auditor_password))


def set_up(url: str, names: RoleNames, passwords: Passwords = Passwords()) -> list[str]:
    """``keel db roles`` on the database at ``url`` (a superuser's, or a role that may create roles and act as the
    tables' owners), in one transaction: all of it or, on an error, nothing. Idempotent: returns one line per thing
    it changed, and none when everything was as it should be."""

    with psycopg.connect(libpq_url(url), **tcp_options(url)) as conn:
        try:
            lines = _set_up(conn, names, passwords)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise RolesError(
                f"cannot set up the roles: {exc.diag.message_primary or exc}: run 'keel db roles' as a superuser"
                " (KEEL_MIGRATION_DATABASE_URL)"
            ) from None
    return lines


def _set_up(conn: Conn, names: RoleNames, passwords: Passwords) -> list[str]:
    me = fetch_row(
        conn,
        "SELECT session_user AS name, rolsuper AS superuser, rolcreaterole AS createrole,"
        " current_database() AS database FROM pg_roles WHERE rolname = session_user",
    )
    lines: list[str] = []
    missing = [n for n in (names.owner, names.app, names.auditor) if role_oid(conn, n) is None]
    if missing and not (me["superuser"] or me["createrole"]):
        raise RolesError(
            f"database role {me['name']!r} cannot create roles (missing: {listed(missing)}): run 'keel db roles'"
            " as a superuser (KEEL_MIGRATION_DATABASE_URL)"
        )
    lines += _roles(conn, names, passwords, missing)
    lines += memberships(conn, names.owner, names.app, names.auditor, me)
    lines += database_privileges(conn, names.owner, names.app, names.auditor, str(me["database"]))
    lines += ownership(conn, names.owner)
    lines += apply_grants(conn, names)
    lines += idle_timeout(conn, names.app, APP_IDLE_IN_TRANSACTION_TIMEOUT)
    for role in (names.app, names.auditor):
        problems = role_problems(conn, role, names.owner)
        if problems:
            raise RolesError(f"role {role!r} still {'; '.join(problems)}: fix it by hand, then run 'keel db roles'")
    return lines


def _roles(conn: Conn, names: RoleNames, passwords: Passwords, missing: list[str]) -> list[str]:
    lines = []
    if names.owner in missing:
        run(conn, sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(names.owner)))
        lines.append(f"created role {names.owner} (NOLOGIN): it owns Keel's schema; migrations act as it")
    for role, password, variable in (
        (names.app, passwords.app, "KEEL_DB_APP_PASSWORD"),
        (names.auditor, passwords.auditor, "KEEL_DB_AUDITOR_PASSWORD"),
    ):
        if role in missing:
            run(conn, sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            lines.append(
                f"created role {role} (LOGIN)"
                + ("" if password else f", without a password: set {variable} and run again, or ALTER ROLE … PASSWORD")
            )
        else:
            lines += plain_login(conn, role)
        if password and not password_is(conn, role, password):
            encrypted = conn.pgconn.encrypt_password(password.encode(), role.encode())
            run(
                conn,
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(role), sql.Literal(encrypted.decode())),
            )
            lines.append(f"set the password of {role} ({variable})")
    return lines


# --- who may run Keel in production -------------------------------------------------------------------------------


def role_problems(conn: Conn, role: str, owner: str) -> list[str]:
    """What ``role`` could do to the journal beyond reading and appending to it, as phrases (``is a superuser``);
    empty when it can do no more."""
    row = fetch_row(
        conn,
        "SELECT r.rolsuper AS superuser, r.rolcreaterole AS createrole,"
        " j.oid IS NOT NULL AS journal, pg_get_userbyid(j.relowner) AS journal_owner,"
        " j.oid IS NOT NULL AND pg_has_role(r.oid, j.relowner, 'MEMBER') AS owns_journal,"
        " o.oid IS NOT NULL AND pg_has_role(r.oid, o.oid, 'MEMBER') AS in_owner,"
        " current_setting('server_version_num')::int >= 150000 AS has_parameter_acl"
        " FROM pg_roles r LEFT JOIN pg_class j ON j.oid = to_regclass('audit.journal')"
        " LEFT JOIN pg_roles o ON o.rolname = %(owner)s WHERE r.rolname = %(role)s",
        {"role": role, "owner": owner},
    )
    if row["superuser"]:
        return ["is a superuser"]
    problems = []
    if row["owns_journal"]:
        via = "" if row["journal_owner"] == role else f" (as a member of {row['journal_owner']!r})"
        problems.append(f"owns audit.journal{via}")
    elif row["in_owner"]:
        problems.append(f"is a member of {owner!r}, the owner of Keel's schema")
    # Whoever owns the schema may drop or rename anything in it, and whoever owns the database may drop the schema,
    # whatever the journal's own grants say. (Through the owner role: said above already.)
    said = {row["journal_owner"], owner} if row["owns_journal"] or row["in_owner"] else set()
    for held in fetch_rows(
        conn,
        "SELECT n.nspname AS name, pg_get_userbyid(n.nspowner) AS owner FROM pg_namespace n"
        " WHERE n.nspname = 'audit' AND pg_has_role(%(role)s, n.nspowner, 'MEMBER')",
        {"role": role},
    ):
        if held["owner"] in said:
            continue
        via = "" if held["owner"] == role else f" (as a member of {held['owner']!r})"
        problems.append(f"owns the schema audit{via} (and so may drop or rename audit.journal)")
    for held in fetch_rows(
        conn,
        "SELECT d.datname AS name, pg_get_userbyid(d.datdba) AS owner FROM pg_database d"
        " WHERE d.datname = current_database() AND pg_has_role(%(role)s, d.datdba, 'MEMBER')",
        {"role": role},
    ):
        if held["owner"] in said:
            continue
        via = "" if held["owner"] == role else f" (as a member of {held['owner']!r})"
        problems.append(f"owns the database {held['name']!r}{via} (and so may drop the schema audit)")
    if row["createrole"]:
        problems.append("can create roles (and so grant itself the owner's)")
    if row["journal"] and not row["owns_journal"]:  # an owner may do anything to it: said already
        extra = [
            p
            for p in JOURNAL_TAMPER_PRIVILEGES
            if fetch_row(
                conn,
                "SELECT has_table_privilege(%(role)s, 'audit.journal', %(p)s)"
                " OR has_any_column_privilege(%(role)s, 'audit.journal', %(p)s) AS yes"
                if p in ("UPDATE", "REFERENCES")
                else "SELECT has_table_privilege(%(role)s, 'audit.journal', %(p)s) AS yes",
                {"role": role, "p": p},
            )["yes"]
        ]
        if extra:
            problems.append(f"may {listed(extra)} audit.journal")
    replication = "SELECT has_parameter_privilege(%s, 'session_replication_role', 'SET') AS yes"
    if row["has_parameter_acl"] and fetch_row(conn, replication, (role,))["yes"]:
        problems.append("may set session_replication_role (which turns the journal's triggers off)")
    return problems


def refuse_privileged(engine: sqlalchemy.Engine, settings: Settings) -> None:
    """In production, raise :class:`PrivilegedRole` (one line: the role, what it could do, what to do instead) unless
    the role ``engine`` logs in as can do no more to the journal than read it and append to it. Elsewhere, nothing:
    development runs as the embedded server's superuser."""
    if settings.environment != "production":
        return
    with engine.connect() as connection:
        conn = connection.connection.driver_connection
        assert isinstance(conn, psycopg.Connection)
        role = str(fetch_row(conn, "SELECT session_user AS name")["name"])
        problems = role_problems(conn, role, settings.db_owner_role)
        connection.rollback()
    if problems:
        raise PrivilegedRole(
            f"refusing to run in production as database role {role!r}: it {'; it '.join(problems)}. Keel's API,"
            f" workers, beat and the commands that write connect as the application role ({settings.db_app_role}),"
            " which may only read the journal and append to it: create it with 'keel db roles' (which also takes"
            " back what it should not hold) and put its credentials in KEEL_DATABASE_URL; migrations connect with"
            " KEEL_MIGRATION_DATABASE_URL"
        )


def missing(url: str, names: RoleNames) -> list[str]:
    """Which of the three roles do not exist in the cluster at ``url``."""

    wanted = [names.owner, names.app, names.auditor]
    with psycopg.connect(libpq_url(url), **tcp_options(url)) as conn:
        rows = fetch_rows(conn, "SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (wanted,))
    found = {r["rolname"] for r in rows}
    return [name for name in wanted if name not in found]

"""The steps `keel db roles` takes (:func:`models.roles.set_up` runs them in one transaction), and the catalog reads
they share with models/roles.py. Each step works on the role names it is given, is idempotent, and returns one line
per thing it changed."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

#: The schemas whose objects are Keel's (docs/how-to/deploy.md#database-roles).
SCHEMAS = ("public", "audit")
RELATION_KINDS = ("r", "p", "v", "m", "f", "S")  # tables, partitioned tables, views, materialized, foreign, sequences
_ALTER = {"r": "TABLE", "p": "TABLE", "f": "FOREIGN TABLE", "v": "VIEW", "m": "MATERIALIZED VIEW", "S": "SEQUENCE"}

Conn = psycopg.Connection[Any]


# --- catalog reads and statements ----------------------------------------------------------------------------------


def fetch_rows(
    conn: Conn, query: str | sql.SQL | sql.Composed, params: dict[str, Any] | Sequence[Any] = ()
) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall() if cur.description else []


def fetch_row(
    conn: Conn, query: str | sql.SQL | sql.Composed, params: dict[str, Any] | Sequence[Any] = ()
) -> dict[str, Any]:
    rows = fetch_rows(conn, query, params)
    assert len(rows) == 1, rows
    return rows[0]


def run(conn: Conn, statement: sql.Composed) -> None:
    conn.execute(statement)


def role_oid(conn: Conn, name: str) -> int | None:
    rows = fetch_rows(conn, "SELECT oid FROM pg_roles WHERE rolname = %s", (name,))
    return int(rows[0]["oid"]) if rows else None


def listed(words: Iterable[str]) -> str:
    return ", ".join(words)


def grantee_sql(role: str | None) -> sql.Composable:
    return sql.SQL("PUBLIC") if role is None else sql.Identifier(role)


def privileges_sql(words: Iterable[str]) -> sql.Composable:
    return sql.SQL(", ").join(sql.SQL(word) for word in words)  # from fixed tables, never from input


# --- the steps -----------------------------------------------------------------------------------------------------


def idle_timeout(conn: Conn, role: str, timeout: str) -> list[str]:
    """``idle_in_transaction_session_timeout`` for every session of ``role``: one left idle inside a transaction
    cannot hold a lock on the journal (or an agent row) for ever."""
    wanted = f"idle_in_transaction_session_timeout={timeout}"
    rows = fetch_rows(
        conn,
        "SELECT s.setconfig FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole"
        " WHERE r.rolname = %s AND s.setdatabase = 0",
        (role,),
    )
    if rows and wanted in (rows[0]["setconfig"] or []):
        return []
    run(
        conn,
        sql.SQL("ALTER ROLE {} SET idle_in_transaction_session_timeout = {}").format(
            sql.Identifier(role), sql.Literal(timeout)
        ),
    )
    return [f"role {role}: idle_in_transaction_session_timeout = {timeout}"]


def password_is(conn: Conn, role: str, password: str) -> bool:
    """Whether ``role``'s stored password is ``password`` (a SCRAM-SHA-256 or MD5 verifier recomputed with its own
    salt); False when it differs, is unset, or cannot be read (only superusers read pg_authid)."""
    try:
        with conn.transaction():
            rows = fetch_rows(conn, "SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,))
    except psycopg.errors.InsufficientPrivilege:
        return False
    stored = rows[0]["rolpassword"] if rows else None
    if not stored:
        return False
    if stored.startswith("md5"):
        return hmac.compare_digest(stored, "md5" + hashlib.md5((password + role).encode()).hexdigest())
    scram = re.fullmatch(r"SCRAM-SHA-256\$(\d+):([^$]+)\$([^:]+):(.+)", stored)
    if scram is None:
        return False
    iterations, salt, stored_key, server_key = scram.groups()
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(salt), int(iterations))
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    mine = base64.b64encode(hashlib.sha256(client_key).digest()).decode()
    server = base64.b64encode(hmac.new(salted, b"Server Key", "sha256").digest()).decode()
    return hmac.compare_digest(mine, stored_key) and hmac.compare_digest(server, server_key)


_POWERS = {
    "rolsuper": "SUPERUSER",
    "rolcreaterole": "CREATEROLE",
    "rolcreatedb": "CREATEDB",
    "rolreplication": "REPLICATION",
    "rolbypassrls": "BYPASSRLS",
}


def plain_login(conn: Conn, role: str) -> list[str]:
    """An existing application or auditor role: LOGIN, and none of the powers that would reach past its grants."""
    row = fetch_row(conn, f"SELECT rolcanlogin, {listed(_POWERS)} FROM pg_roles WHERE rolname = %s", (role,))
    drop = [word for column, word in _POWERS.items() if row[column]]
    options = [f"NO{word}" for word in drop] + ([] if row["rolcanlogin"] else ["LOGIN"])
    if not options:
        return []
    run(conn, sql.SQL("ALTER ROLE {} {}").format(sql.Identifier(role), privileges_sql(options)))
    return [f"role {role}: {listed(options)}"]


def memberships(conn: Conn, owner: str, app: str, auditor: str, me: dict[str, Any]) -> list[str]:
    """Neither the application nor the auditor role is a member of any of the three; this login (``me``), unless a
    superuser, is a member of the owner, to run migrations as it."""
    lines = []
    for role in (app, auditor):
        for granted in fetch_rows(
            conn,
            "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
            " JOIN pg_roles r ON r.oid = m.member WHERE r.rolname = %s AND g.rolname = ANY(%s)",
            (role, [owner, app, auditor]),
        ):
            run(conn, sql.SQL("REVOKE {} FROM {}").format(sql.Identifier(granted["rolname"]), sql.Identifier(role)))
            lines.append(f"revoked membership of {granted['rolname']} from {role}")
    if not me["superuser"]:
        member = fetch_row(conn, "SELECT pg_has_role(session_user, %s, 'MEMBER') AS yes", (owner,))
        if not member["yes"]:
            run(conn, sql.SQL("GRANT {} TO {}").format(sql.Identifier(owner), sql.Identifier(me["name"])))
            lines.append(f"granted {owner} to {me['name']} (to run migrations as it)")
    return lines


def database_privileges(conn: Conn, owner: str, app: str, auditor: str, database: str) -> list[str]:
    """The database and schema privileges: the owner may create in the database (the audit schema) and in public;
    nobody else creates anything there, nor temporary tables (which would shadow Keel's tables inside its triggers:
    a trigger function finds ``pg_temp`` first)."""
    lines = []
    db = sql.Identifier(database)
    to_owner = sql.Identifier(owner)

    def has(role: str, privilege: str, on: str = "database", name: str = database) -> bool:
        check = "has_database_privilege" if on == "database" else "has_schema_privilege"
        return bool(fetch_row(conn, f"SELECT {check}(%s, %s, %s) AS yes", (role, name, privilege))["yes"])

    if not has(owner, "CREATE"):
        run(conn, sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(db, to_owner))
        lines.append(f"granted CREATE on database {database} to {owner}")
    for role in (app, auditor):
        if not has(role, "CONNECT"):
            run(conn, sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(db, sql.Identifier(role)))
            lines.append(f"granted CONNECT on database {database} to {role}")
    public = "public"
    if not (has(owner, "USAGE", "schema", public) and has(owner, "CREATE", "schema", public)):
        run(conn, sql.SQL("GRANT USAGE, CREATE ON SCHEMA public TO {}").format(to_owner))
        lines.append(f"granted USAGE, CREATE on schema public to {owner}")
    audit = fetch_rows(conn, "SELECT pg_get_userbyid(nspowner) AS owner FROM pg_namespace WHERE nspname = 'audit'")
    if audit and audit[0]["owner"] != owner:
        run(conn, sql.SQL("ALTER SCHEMA audit OWNER TO {}").format(to_owner))
        lines.append(f"schema audit: owner {audit[0]['owner']} → {owner}")
    schemas = ["public"] + (["audit"] if audit else [])
    # What PUBLIC, the application and the auditor hold directly: CREATE and TEMPORARY on the database, CREATE on
    # Keel's schemas (PostgreSQL before 15 gave PUBLIC CREATE on public).
    grantees = [0] + [oid for oid in (role_oid(conn, app), role_oid(conn, auditor)) if oid is not None]
    excess = fetch_rows(
        conn,
        "SELECT 'DATABASE' AS kind, d.datname AS name, a.grantee, a.privilege_type AS privilege"
        " FROM pg_database d, aclexplode(coalesce(d.datacl, acldefault('d', d.datdba))) a"
        " WHERE d.datname = current_database() AND a.privilege_type IN ('CREATE', 'TEMPORARY')"
        " AND a.grantee = ANY(%(grantees)s::oid[])"
        " UNION ALL SELECT 'SCHEMA', n.nspname, a.grantee, a.privilege_type"
        " FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a"
        " WHERE n.nspname = ANY(%(schemas)s) AND a.privilege_type = 'CREATE' AND a.grantee = ANY(%(grantees)s::oid[])"
        " ORDER BY 1, 2, 4",
        {"grantees": grantees, "schemas": schemas},
    )
    for row in excess:
        who = (
            None
            if int(row["grantee"]) == 0
            else fetch_row(conn, "SELECT %s::oid::regrole::text AS n", (row["grantee"],))["n"]
        )
        run(
            conn,
            sql.SQL("REVOKE {} ON {} {} FROM {}").format(
                sql.SQL(row["privilege"]), sql.SQL(row["kind"]), sql.Identifier(row["name"]), grantee_sql(who)
            ),
        )
        lines.append(f"revoked {row['privilege']} on {row['kind'].lower()} {row['name']} from {who or 'PUBLIC'}")
    return lines


def ownership(conn: Conn, owner: str) -> list[str]:
    """Hand every relation and function of Keel's schemas to the owner (a database migrated before roles: they
    belong to whoever ran the migrations). Indexes and the sequences of identity columns follow their tables."""
    relations = fetch_rows(
        conn,
        "SELECT n.nspname AS schema, c.relname AS name, c.relkind AS kind, pg_get_userbyid(c.relowner) AS owner"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = ANY(%(schemas)s) AND c.relkind = ANY(%(kinds)s)"
        " AND pg_get_userbyid(c.relowner) <> %(owner)s"
        " AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid"
        "                 AND (d.deptype = 'e' OR (c.relkind = 'S' AND d.refclassid = 'pg_class'::regclass"
        "                                          AND d.deptype IN ('a', 'i'))))"
        " ORDER BY 1, 2",
        {"schemas": list(SCHEMAS), "kinds": list(RELATION_KINDS), "owner": owner},
    )
    functions = fetch_rows(
        conn,
        "SELECT p.oid::regprocedure::text AS signature, pg_get_userbyid(p.proowner) AS owner"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = ANY(%(schemas)s) AND pg_get_userbyid(p.proowner) <> %(owner)s"
        " AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid"
        "                 AND d.deptype = 'e')"
        " ORDER BY 1",
        {"schemas": list(SCHEMAS), "owner": owner},
    )
    to_owner = sql.Identifier(owner)
    moved: dict[str, list[int]] = {}
    for relation in relations:
        run(
            conn,
            sql.SQL("ALTER {} {} OWNER TO {}").format(
                sql.SQL(_ALTER[relation["kind"]]), sql.Identifier(relation["schema"], relation["name"]), to_owner
            ),
        )
        counts = moved.setdefault(relation["owner"], [0, 0, 0])
        counts[1 if relation["kind"] == "S" else 0] += 1
    for function in functions:
        # regprocedure's text is the catalog's own, quoted and qualified where needed.
        run(conn, sql.SQL("ALTER ROUTINE {} OWNER TO {}").format(sql.SQL(function["signature"]), to_owner))
        moved.setdefault(function["owner"], [0, 0, 0])[2] += 1
    lines = []
    for previous, (tables, sequences, routines) in sorted(moved.items()):
        what = [
            f"{n} {word}{'' if n == 1 else 's'}"
            for n, word in ((tables, "table"), (sequences, "sequence"), (routines, "function"))
            if n
        ]
        lines.append(f"handed {listed(what)} from {previous} to {owner}")
    return lines

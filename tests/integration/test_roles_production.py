"""In production Keel refuses to run as a database role that could rewrite the journal (a superuser, the owner or a
member of it, the owner of the audit schema or of the database), at start and once an unreachable database is back;
reads, and development, run as anyone."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from tests.support.audit import TEST_ENV
from tests.support.broker import Broker
from tests.support.proxy import database_behind
from tests.support.roles import (
    KEEL,
    RoledDatabase,
    as_role,
    connect,
    drop_roles,
    keel,
)

pytestmark = pytest.mark.integration


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

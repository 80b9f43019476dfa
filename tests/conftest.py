"""Shared fixtures: real PostgreSQL, one database per test cloned from a migrated template.

Where the servers come from: ``KEEL_TEST_DATABASE_URL`` if set, else the local server on 127.0.0.1:5432. If that is
unreachable, CI (``CI=true``) fails loudly; anywhere else the embedded PostgreSQL under ./.keel/test is started (and
stopped at the end of the last session using it: tests/support/suite_servers.py). Tests never skip for a missing
service.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

# Tests decide their own configuration: nothing from the developer's shell leaks in.
for _name in [n for n in os.environ if n.startswith("KEEL_") and not n.startswith("KEEL_TEST_")]:
    del os.environ[_name]

from tests.support.audit import TEST_ENV, TEST_KEYS  # noqa: E402

# ... except the journal's audit key, which the tests set explicitly: every process they start links with it.
os.environ.update(TEST_ENV)

from agents.client import Client  # noqa: E402
from models import migrations, roles  # noqa: E402
from models.db import Database  # noqa: E402
from models.embedded import redis_executable  # noqa: E402
from models.roles import RoleNames  # noqa: E402
from models.urls import libpq_url, with_database  # noqa: E402
from tests.support.broker import Broker, own_prefix  # noqa: E402
from tests.support.cli import remember_built_ins  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.roles import APP_PASSWORD, AUDITOR_PASSWORD, RoledDatabase, drop_roles, unique_names  # noqa: E402

# Before any test module registers its own tools and handlers: what a forked `keel` starts from.
remember_built_ins()

ROOT = Path(__file__).resolve().parent.parent
LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _reachable(url: str) -> str | None:
    try:
        with psycopg.connect(libpq_url(url), connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc).strip().splitlines()[0]
    return None


@pytest.fixture(scope="session")
def pg_server_url(request: pytest.FixtureRequest) -> str:
    """URL of a PostgreSQL server where the tests may create and drop databases (as a superuser)."""
    explicit = os.environ.get("KEEL_TEST_DATABASE_URL")
    url = explicit or LOCAL_POSTGRES
    problem = _reachable(url)
    if problem is None:
        return url
    if explicit or IN_CI:
        pytest.exit(f"PostgreSQL at {url} is unreachable ({problem}); CI=true or an explicit URL: failing", 3)
    from tests.support.suite_servers import start_for_session

    return start_for_session(ROOT / ".keel" / "test", "postgres", request.addfinalizer)


def _admin(server_url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(libpq_url(with_database(server_url, "postgres")), autocommit=True)


@contextmanager
def _scratch_database(server_url: str, prefix: str, template: str | None = None) -> Iterator[str]:
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    with _admin(server_url) as admin:
        admin.execute(f'CREATE DATABASE "{name}"{clause}')
    try:
        yield with_database(server_url, name)
    finally:
        with _admin(server_url) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def template_db(pg_server_url: str) -> Iterator[str]:
    """A database migrated to head, used as the template of every test database."""
    with _scratch_database(pg_server_url, "keel_tpl") as url:
        migrations.upgrade(url)
        name = make_url(url).database
        assert name is not None
        yield name


@pytest.fixture
def db_url(pg_server_url: str, template_db: str) -> Iterator[str]:
    """A fresh migrated database of this test's own."""
    with _scratch_database(pg_server_url, "keel_t", template_db) as url:
        yield url


@pytest.fixture(scope="session")
def pgbouncer(pg_server_url: str) -> Iterator[Any]:
    """A PgBouncer of this session's own in transaction mode in front of the test server (tests/support/pgbouncer.py):
    ``pgbouncer.url(db_url)`` routes a test's database through it."""
    from tests.support.pgbouncer import running_pgbouncer

    with running_pgbouncer(pg_server_url) as bouncer:
        yield bouncer


@pytest.fixture(scope="session")
def session_roles(pg_server_url: str) -> Iterator[RoleNames]:
    """The owner, application and auditor roles of this test session: names nobody else uses, dropped at the end
    (roles are cluster-wide; the cluster is shared). Created by :func:`roles_template_db`."""
    names = unique_names()
    try:
        yield names
    finally:  # after the databases that use them: their fixtures drop them first
        drop_roles(pg_server_url, [names.app, names.auditor, names.owner])


@pytest.fixture(scope="session")
def roles_template_db(pg_server_url: str, session_roles: RoleNames) -> Iterator[str]:
    """A database set up by `keel db roles` and migrated as the session's owner role: the template of
    :func:`roles_db`."""
    with _scratch_database(pg_server_url, "keel_rtpl") as url:
        roles.set_up(url, session_roles, roles.Passwords(app=APP_PASSWORD, auditor=AUDITOR_PASSWORD))
        migrations.upgrade(url, roles=session_roles)
        name = make_url(url).database
        assert name is not None
        yield name


@pytest.fixture
def roles_db(pg_server_url: str, roles_template_db: str, session_roles: RoleNames) -> Iterator[RoledDatabase]:
    """A fresh database of this test's own whose tables the session's owner role owns, with the application's and
    the auditor's grants: ``url`` (a superuser's), ``app_url``, ``auditor_url``, ``names``."""
    with _scratch_database(pg_server_url, "keel_r", roles_template_db) as url:
        # A clone copies the tables and their grants, not the database's own privileges (who may create there).
        roles.set_up(url, session_roles)
        yield RoledDatabase(session_roles, url)


@pytest.fixture
def empty_db_url(pg_server_url: str) -> Iterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    with _scratch_database(pg_server_url, "keel_e") as url:
        yield url


@pytest.fixture(autouse=True)
def _siblings_disposed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A Runner opens a pool of its own for its lease keeper (``Database.sibling``): closed when its test ends, not
    left to the garbage collector (which warned about a connection deleted while open, in whichever test it ran)."""
    made: list[Database] = []
    real = Database.sibling

    def sibling(self: Database, pool_size: int) -> Database:
        made.append(real(self, pool_size))
        return made[-1]

    monkeypatch.setattr(Database, "sibling", sibling)
    yield
    for database in made:
        database.dispose()


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url, pool_size=12, audit_keys=TEST_KEYS)
    yield database
    database.dispose()


@pytest.fixture
def client(db: Database) -> Client:
    return Client(db)


@pytest.fixture
def raw(db_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A superuser psycopg connection to the test database, autocommit, for poking at tables directly."""
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        yield conn


# --- Redis ------------------------------------------------------------------------------------------------------

LOCAL_REDIS = "redis://127.0.0.1:6379"
#: The database the tests use on that server. They share it with each other and with whoever else uses it: each
#: test owns only the keys under its own prefix (KEEL_BROKER_PREFIX), and deletes only those afterwards.
TEST_REDIS_DB = 0


def _redis_problem(url: str) -> str | None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        return str(exc)
    finally:
        client.close()
    return None


@pytest.fixture(scope="session")
def redis_server_url(request: pytest.FixtureRequest) -> str:
    """URL (without a db number) of the Redis server the tests use: ``KEEL_TEST_REDIS_URL`` if set, else the local
    one on 127.0.0.1:6379. If that is unreachable, CI (``CI=true``) fails loudly; anywhere else the embedded Redis
    under ./.keel/test is started."""
    explicit = os.environ.get("KEEL_TEST_REDIS_URL")
    url = (explicit or LOCAL_REDIS).rstrip("/")
    problem = _redis_problem(url)
    if problem is None:
        return url
    if explicit or IN_CI:
        pytest.exit(f"Redis at {url} is unreachable ({problem}); CI=true or an explicit URL: failing", 3)
    from tests.support.suite_servers import start_for_session

    return start_for_session(ROOT / ".keel" / "test", "redis", request.addfinalizer).rsplit("/", 1)[0]


@pytest.fixture
def broker(redis_server_url: str) -> Iterator[Broker]:
    """This test's own part of the Redis database: a key prefix nobody else uses. Afterwards the keys under it
    are deleted (SCAN MATCH prefix* + DEL) and nothing else is touched."""
    with own_prefix(f"{redis_server_url}/{TEST_REDIS_DB}") as owned:
        yield owned


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A Redis server of this test's own (no persistence), which the test may stop, restart or inspect whole:
    ``url``, ``start()``, ``stop()``. For what must see every key of a server, or runs code that ignores prefixes."""
    import shutil
    import subprocess
    import time

    binary = shutil.which("redis-server") or redis_executable()
    port = free_port()  # from this xdist worker's own range
    server: dict[str, Any] = {"url": f"redis://127.0.0.1:{port}/0", "proc": None}

    def start() -> None:
        server["proc"] = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while _redis_problem(server["url"]) is not None:
            assert time.monotonic() < deadline, f"the test's own Redis on port {port} did not answer in 10s"
            time.sleep(0.05)

    def stop() -> None:
        proc = server["proc"]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    server["start"], server["stop"] = start, stop
    start()
    try:
        yield server
    finally:
        stop()


@pytest.fixture
def api(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> Iterator[Any]:
    """A real ``keel serve`` (uvicorn) process on this test's database and Redis prefix (tests/support/api.py)."""
    from tests.support.api import running_api

    with running_api(db, db_url, broker, tmp_path) as server:
        yield server

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

import psycopg
import pytest
from sqlalchemy.engine import make_url

# Tests decide their own configuration: nothing from the developer's shell leaks in.
for _name in [n for n in os.environ if n.startswith("KEEL_") and not n.startswith("KEEL_TEST_")]:
    del os.environ[_name]

from agents.client import Client  # noqa: E402
from models import migrations  # noqa: E402
from models.db import Database  # noqa: E402
from models.urls import libpq_url, with_database  # noqa: E402

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


@pytest.fixture
def empty_db_url(pg_server_url: str) -> Iterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    with _scratch_database(pg_server_url, "keel_e") as url:
        yield url


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url, pool_size=12)
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
_REDIS_LOCKS = Path(os.environ.get("TMPDIR", "/tmp")) / "keel-test-redis-dbs"


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
    """URL (without a db number) of a Redis server the tests may use databases 1-15 of."""
    explicit = os.environ.get("KEEL_TEST_REDIS_URL")
    url = (explicit or LOCAL_REDIS).rstrip("/")
    problem = _redis_problem(url)
    if problem is None:
        return url
    if explicit or IN_CI:
        pytest.exit(f"Redis at {url} is unreachable ({problem}); CI=true or an explicit URL: failing", 3)
    from tests.support.suite_servers import start_for_session

    return start_for_session(ROOT / ".keel" / "test", "redis", request.addfinalizer).rsplit("/", 1)[0]


@contextmanager
def _own_redis_db(server_url: str) -> Iterator[str]:
    """A Redis database number nobody else uses: held by an exclusive lock file (so parallel test runs on one machine
    never share one) and empty when taken (a database with keys in it is someone else's and is left alone)."""
    import fcntl

    import redis

    _REDIS_LOCKS.mkdir(parents=True, exist_ok=True)
    for number in range(1, 16):  # db 0 is left to whoever else uses this server
        handle = open(_REDIS_LOCKS / f"{number}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        url = f"{server_url}/{number}"
        client = redis.Redis.from_url(url)
        try:
            if client.dbsize() != 0:
                continue
            try:
                yield url
            finally:
                client.flushdb()  # only keys this test created: the database was empty and locked for it
            return
        finally:
            client.close()
            handle.close()
    raise RuntimeError(f"no free, empty Redis database on {server_url} (all of 1-15 are in use or hold data)")


@pytest.fixture
def broker_url(redis_server_url: str) -> Iterator[str]:
    """A Redis database of this test's own: empty when taken, emptied afterwards, never shared."""
    with _own_redis_db(redis_server_url) as url:
        yield url

"""Which revision a migration error is about, and who may migrate a database: `keel db`, `keel up` and `keel demo`
on a database that is behind this code, or ahead of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from models import migrations
from models.urls import libpq_url
from tests.support.audit import clean_env
from tests.support.broker import Broker
from tests.support.cli import run_keel

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")


def keel(db_url: str, *args: str, cwd: Path, broker: Broker | None = None) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url
    env["KEEL_HOME"] = str(cwd / ".keel")
    env.update(broker.env if broker else {"KEEL_BROKER_URL": "redis://127.0.0.1:1/0"})
    return run_keel(args, env, cwd)


def _set_revision(db_url: str, revision: str) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = %s", (revision,))


def _revision(db_url: str) -> str:
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize(
    "args", [("db", "upgrade"), ("db", "upgrade", "--revision", "0004"), ("db", "downgrade", "0004"), ("up",)]
)
def test_a_database_migrated_by_a_newer_keel_is_named_as_the_unknown_revision(
    db_url: str, tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Before: `cannot upgrade to 'head': no migration has this revision`, as if 'head' or '0004' were unknown."""
    _set_revision(db_url, "0099")
    result = keel(db_url, *args, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == (
        f"keel: error: database at 0099, which this code does not know (code at {migrations.head()}): it was "
        "migrated by a newer Keel; run that version, or downgrade the database with it\n"
    )
    assert _revision(db_url) == "0099", "nothing changed"


def test_an_unknown_target_is_still_named_as_the_target(db_url: str, tmp_path: Path) -> None:
    result = keel(db_url, "db", "downgrade", "nosuch", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("keel: error: cannot downgrade to 'nosuch': no migration has this revision")


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_the_demo_refuse_a_configured_database_behind_the_code(
    db_url: str, broker: Broker, tmp_path: Path, command: str
) -> None:
    """Before: they ran `alembic upgrade head` silently on whatever database they were given, shared ones included,
    while `keel worker` and `keel beat` refuse it. Now they refuse it too, unless given --migrate."""
    previous = migrations.revisions()[-2]
    migrations.downgrade(db_url, previous)
    args = ["--no-api"] if command == "up" else []  # (port 8000 may be taken here: that refusal comes first)
    result = keel(db_url, command, *args, cwd=tmp_path, broker=broker)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == (
        f"keel: error: database at {previous}, code at {migrations.head()}: run 'keel db upgrade' first, "
        "or pass --migrate\n"
    )
    assert _revision(db_url) == previous, "nothing changed"
    assert not (tmp_path / ".keel" / "demo").exists(), "nothing started"

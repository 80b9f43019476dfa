"""Two `keel demo` runs on one database would relay each other's messages to their own sinks, and both fail: the
second refuses, naming the first (pid and host) and advice that works — wherever each runs, whatever its KEEL_HOME.
On one Redis they do not meet: each demo's worker and beat use a key prefix of their own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from agents.cli.supervisor import where
from agents.demo.run import DEMO_LOCK
from models import embedded
from models.urls import libpq_url
from tests.support.audit import clean_env
from tests.support.broker import Broker

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
HOLD = (
    "import sys, time; from pathlib import Path; from agents.demo.run import only_demo_on\n"
    "home = Path(sys.argv[2]) if len(sys.argv) > 2 else None\n"
    "with only_demo_on(sys.argv[1], home):\n    print('held', flush=True); time.sleep(600)"
)
TAKE = "import sys; from agents.demo.run import only_demo_on\nwith only_demo_on(sys.argv[1], None):\n    print('taken')"


def demo_env(home: Path, db_url: str | None, broker: Broker) -> dict[str, str]:
    env = clean_env()
    env.update({**broker.env, "KEEL_HOME": str(home)})
    if db_url is not None:
        env["KEEL_DATABASE_URL"] = db_url
    return env


@contextmanager
def holding(cwd: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A process in ``cwd`` that holds the demo's lock (as a running demo does) until SIGKILLed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, *args], stdout=subprocess.PIPE, text=True, cwd=cwd)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


def _lock_free(db_url: str) -> bool:
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s"
            " AND objsubid = 2",
            DEMO_LOCK,
        ).fetchone()
    return row == (0,)


def test_a_demo_in_another_directory_on_the_same_database_refuses_and_the_lock_dies_with_its_holder(
    db_url: str, broker: Broker, tmp_path: Path
) -> None:
    """Before: the lock was a file under KEEL_HOME, so a demo in another directory (another KEEL_HOME) on the same
    configured servers ran anyway and both failed; the advice was that very setup."""
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    with holding(first_dir, db_url) as first:
        second = subprocess.run(
            [KEEL, "demo"],
            env=demo_env(second_dir / ".keel", db_url, broker),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=second_dir,
        )
        assert second.returncode == 1, second.stdout + second.stderr
        assert second.stderr == (
            f"keel: error: another keel demo (pid {first.pid} on {socket.gethostname()}) is running on this database"
            f" ({where(db_url)}): wait until it ends, or run this one with another database (KEEL_DATABASE_URL)\n"
        )
        assert not (second_dir / ".keel" / "demo").exists(), "the refused demo started nothing"
    deadline = time.monotonic() + 30  # the server ends the SIGKILLed holder's session when it sees the socket close
    while not _lock_free(db_url):
        assert time.monotonic() < deadline, "the lock outlived its holder"
        time.sleep(0.05)
    taken = subprocess.run([sys.executable, "-c", TAKE, db_url], capture_output=True, text=True, timeout=60)
    assert taken.stdout == "taken\n", taken.stderr


def test_on_the_embedded_servers_the_advice_is_another_keel_home(broker: Broker, tmp_path: Path) -> None:
    home = tmp_path / ".keel"
    try:
        url = embedded.database_url_for(broker.settings(home=home))
        with holding(tmp_path, url, str(home)) as first:
            second = subprocess.run(
                [KEEL, "demo"], env=demo_env(home, None, broker), capture_output=True, text=True, timeout=120
            )
        assert second.returncode == 1, second.stdout + second.stderr
        assert second.stderr == (
            f"keel: error: another keel demo (pid {first.pid} on {socket.gethostname()}) is running on the embedded"
            f" servers under {home}: wait until it ends, or run this one with another KEEL_HOME\n"
        )
    finally:
        embedded.stop_postgres(home)


def test_two_demos_on_one_redis_each_on_its_own_database_both_hold_every_invariant(
    db_url: str, template_db: str, pg_server_url: str, broker: Broker, tmp_path: Path
) -> None:
    from models.urls import with_database

    other = f"keel_t_demo_{os.getpid()}"
    with psycopg.connect(libpq_url(with_database(pg_server_url, "postgres")), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{other}" TEMPLATE "{template_db}"')
    try:
        demos = []
        for n, url in enumerate((db_url, with_database(pg_server_url, other))):
            cwd = tmp_path / f"demo{n}"
            cwd.mkdir()
            env = demo_env(cwd / ".keel", url, broker)
            demos.append(
                subprocess.Popen([KEEL, "demo"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd)
            )
        outputs = [demo.communicate(timeout=240)[0].decode() for demo in demos]
        for demo, output in zip(demos, outputs, strict=True):
            assert demo.returncode == 0 and "all invariants held" in output, output
        assert broker.keys() == [], "each demo deleted its keys from the broker"
    finally:
        with psycopg.connect(libpq_url(with_database(pg_server_url, "postgres")), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{other}" WITH (FORCE)')

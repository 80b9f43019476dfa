"""Every connection Keel opens to PostgreSQL over TCP carries keepalives and a TCP user timeout (models/keepalives.py),
so a server that vanishes without a word is given up on in bounded time, not after the kernel's two hours."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from models.db import Database
from models.keepalives import Keepalives
from models.settings import Settings
from models.urls import libpq_url

pytestmark = pytest.mark.integration

QUICK = Keepalives(idle_seconds=7, interval_seconds=3, count=4, user_timeout_ms=9_000)
SENT = {"keepalives": "1", "keepalives_idle": "7", "keepalives_interval": "3", "keepalives_count": "4"}


def _tcp_parameters(conn: psycopg.Connection[object]) -> dict[str, str]:
    parameters = conn.info.get_parameters()
    return {name: parameters[name] for name in [*SENT, "tcp_user_timeout"] if name in parameters}


def test_pooled_connections_and_sessions_carry_the_keepalives(db_url: str) -> None:
    db = Database(db_url, pool_size=1, keepalives=QUICK)
    try:
        with db.connection() as conn:
            assert _tcp_parameters(conn) == {**SENT, "tcp_user_timeout": "9000"}
            conn.rollback()
        with db.session(autocommit=True) as conn:
            assert _tcp_parameters(conn) == {**SENT, "tcp_user_timeout": "9000"}
            assert conn.execute("SHOW statement_timeout").fetchone() == ("30s",), "and still its statement timeout"
    finally:
        db.dispose()


def test_the_settings_reach_libpq(db_url: str, tmp_path: Path) -> None:
    settings = Settings(
        database_url=db_url,
        home=tmp_path,
        db_keepalives_idle_seconds=7,
        db_keepalives_interval_seconds=3,
        db_keepalives_count=4,
        db_tcp_user_timeout_ms=9_000,
    )
    db = Database.from_settings(settings, pool_size=1)
    try:
        with db.connection() as conn:
            assert _tcp_parameters(conn) == {**SENT, "tcp_user_timeout": "9000"}
            conn.rollback()
    finally:
        db.dispose()
    assert Keepalives.from_settings(Settings(home=tmp_path)) == Keepalives(30, 10, 3, 30_000), "the defaults"


def _socket_directory(db_url: str) -> str | None:
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute("SHOW unix_socket_directories").fetchone()
    directories = [d.strip() for d in str(row[0] if row else "").split(",") if d.strip().startswith("/")]
    port = make_url(db_url).port or 5432
    return next((d for d in directories if Path(d, f".s.PGSQL.{port}").exists()), None)


def test_a_unix_socket_connection_gets_no_tcp_options_and_works(db_url: str) -> None:
    directory = _socket_directory(db_url)
    if directory is None:
        pytest.skip("the test server has no Unix socket on this machine")
    parsed = make_url(db_url)
    url = f"postgresql://{parsed.username}@/{parsed.database}?host={directory}&port={parsed.port or 5432}"
    db = Database(url, pool_size=1, keepalives=QUICK)
    try:
        with db.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            assert _tcp_parameters(conn) == {}
            conn.rollback()
        with db.session() as conn:
            assert _tcp_parameters(conn) == {}
    finally:
        db.dispose()


# In a network namespace of its own (unshare -n): Keel's Database connects over TCP to a proxy on that namespace's
# loopback, which forwards to the server's Unix socket. Taking the loopback down then drops every packet between
# the two without a reset, as a partition or a lost host does.
_VANISHING = textwrap.dedent(
    """
    import json, socket, subprocess, sys, threading, time
    from models.db import Database
    from models.keepalives import Keepalives

    server_socket, url = sys.argv[1], sys.argv[2]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)

    def pump(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    listener = socket.create_server(("127.0.0.1", 0))

    def accept():
        while True:
            client, _ = listener.accept()
            server = socket.socket(socket.AF_UNIX)
            server.connect(server_socket)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    url = url.replace("@PROXY", f"@127.0.0.1:{listener.getsockname()[1]}")
    quick = Keepalives(idle_seconds=1, interval_seconds=1, count=2, user_timeout_ms=2_000)
    waiting, writing = Database(url, pool_size=1, keepalives=quick), Database(url, pool_size=1, keepalives=quick)
    for db in (waiting, writing):
        with db.transaction() as cur:
            cur.execute("SELECT 1")
    outcome = {}

    def wait_for_an_answer():  # its query sent and acknowledged: only keepalive probes can tell the server is gone
        began = time.monotonic()
        try:
            with waiting.transaction() as cur:
                cur.execute("SELECT pg_sleep(60)")
            outcome["waiting"] = "answered"
        except Exception as exc:
            outcome["waiting"] = [type(exc).__name__, time.monotonic() - began]

    blocked = threading.Thread(target=wait_for_an_answer, daemon=True)
    blocked.start()
    time.sleep(0.5)
    subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
    began = time.monotonic()
    try:  # its query never acknowledged: the TCP user timeout gives up
        with writing.transaction() as cur:
            cur.execute("SELECT 1")
        outcome["writing"] = "answered"
    except Exception as exc:
        outcome["writing"] = [type(exc).__name__, time.monotonic() - began]
    blocked.join(20)
    print(json.dumps(outcome), flush=True)
    """
)


def test_a_connection_whose_server_vanishes_fails_in_bounded_time(db_url: str) -> None:
    """Without the keepalives both connections would wait about two hours (the subprocess's timeout fails it)."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a network namespace of its own (unshare -n, as root) to drop packets without a reset")
    if shutil.which("ip") is None:
        pytest.skip("needs ip(8) to take the namespace's loopback down")
    directory = _socket_directory(db_url)
    if directory is None:
        pytest.skip("the test server has no Unix socket on this machine to forward to")
    server_socket = str(Path(directory, f".s.PGSQL.{make_url(db_url).port or 5432}"))
    parsed = make_url(db_url)
    url = f"postgresql://{parsed.username}@PROXY/{parsed.database}"
    done = subprocess.run(
        [unshare, "-n", sys.executable, "-c", _VANISHING, server_socket, url],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).resolve().parents[2],
        env={k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "PG"))},
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    for which in ("waiting", "writing"):
        error, seconds = outcome[which]
        assert error == "OperationalError", outcome
        assert seconds < 10, outcome


def test_connections_outside_the_pool_carry_the_keepalives_too(
    empty_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migrations (alembic's engine and the revision check), `keel db roles`, the journal's archiver and the demo's
    lock open connections of their own: each carries the settings' keepalives (a migration waiting on a lock or an
    index build must not hang for two hours on a vanished server)."""
    from agents.audit.archive import ArchiveRefused, archive_partition
    from agents.audit.store import FileStore
    from agents.demo.run import only_demo_on
    from models import migrations, roles
    from models.audit_keys import audit_keys_for

    for name, value in {
        "KEEL_DB_KEEPALIVES_IDLE_SECONDS": "7",
        "KEEL_DB_KEEPALIVES_INTERVAL_SECONDS": "3",
        "KEEL_DB_KEEPALIVES_COUNT": "4",
        "KEEL_DB_TCP_USER_TIMEOUT_MS": "9000",
        "KEEL_HOME": str(tmp_path),
    }.items():
        monkeypatch.setenv(name, value)
    opened: list[tuple[str, dict[str, str]]] = []
    real = psycopg.connect

    def spying(*args: object, **kwargs: object) -> psycopg.Connection[object]:
        conn = real(*args, **kwargs)  # type: ignore[arg-type]
        opened.append((where, _tcp_parameters(conn)))
        return conn

    monkeypatch.setattr(psycopg, "connect", spying)
    where = "migrations"
    migrations.upgrade(empty_db_url)
    assert migrations.revision_at(empty_db_url) == migrations.head()
    where = "roles"
    roles.missing(empty_db_url, roles.RoleNames.of(Settings()))
    where = "archive"
    with pytest.raises(ArchiveRefused):  # nothing shipped: refused, after connecting
        archive_partition(
            empty_db_url,
            FileStore(tmp_path / "store"),
            audit_keys_for(Settings(home=tmp_path)),
            destination="file:///nowhere",
            grace=timedelta(0),
            dry_run=True,
        )
    where = "demo"
    with only_demo_on(empty_db_url, None):
        pass
    assert {w for w, _ in opened} >= {"migrations", "roles", "archive", "demo"}, opened
    for w, parameters in opened:
        assert parameters == {**SENT, "tcp_user_timeout": "9000"}, (w, parameters)

"""A PgBouncer of the test's own (Debian's ``pgbouncer``) in transaction mode, in front of the test's PostgreSQL:
started on a free port with a configuration written in a temporary directory, stopped by its pid."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from tests.support.ports import free_port


@dataclass(frozen=True)
class Bouncer:
    """A running PgBouncer: ``url(database_url)`` is that database's URL through it."""

    host: str
    port: int
    pid: int
    directory: Path

    def url(self, database_url: str) -> str:
        """``database_url`` (any of the test server's databases and users) routed through this PgBouncer."""
        return make_url(database_url).set(host=self.host, port=self.port).render_as_string(hide_password=False)

    def server_pids(self) -> set[int]:
        """The PostgreSQL backend pids of PgBouncer's server connections now (its admin console's SHOW SERVERS)."""
        admin = f"host={self.host} port={self.port} dbname=pgbouncer user=postgres"
        with psycopg.connect(admin, autocommit=True, prepare_threshold=None) as conn:
            cur = conn.execute("SHOW SERVERS")
            columns = [c.name for c in cur.description or ()]
            return {int(dict(zip(columns, row, strict=True))["remote_pid"]) for row in cur.fetchall()}

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _free_port() -> int:
    return free_port()  # from this xdist worker's own range


def binary() -> str:
    found = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None)
    assert found, "pgbouncer is not installed: apt-get install pgbouncer (.ci/run does it)"
    return found


@contextmanager
def running_pgbouncer(
    server_url: str,
    *,
    users: tuple[str, ...] = ("postgres",),
    pool_size: int = 20,
    ignore_startup_parameters: str = "",
) -> Iterator[Bouncer]:
    """PgBouncer (``pool_mode = transaction``) in front of the PostgreSQL server of ``server_url``, every database
    of it (``*``), for ``users`` (trust: the server checks passwords), ``pool_size`` server connections per database
    and user; ``ignore_startup_parameters`` (e.g. ``options``) are accepted from clients and dropped."""
    server = make_url(server_url)
    port = _free_port()
    directory = Path(tempfile.mkdtemp(prefix="keel-pgbouncer-"))
    (directory / "userlist.txt").write_text("".join(f'"{user}" ""\n' for user in users))
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.host or '127.0.0.1'} port={server.port or 5432}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {directory / 'userlist.txt'}\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {pool_size}\n"
        "max_client_conn = 1000\n"
        f"logfile = {directory / 'pgbouncer.log'}\n"
        f"pidfile = {directory / 'pgbouncer.pid'}\n"
        "admin_users = postgres\n"
        f"ignore_startup_parameters = {ignore_startup_parameters}\n"
    )
    command = [binary()]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        shutil.chown(directory, "postgres")
        for child in directory.iterdir():
            shutil.chown(child, "postgres")
        command += ["-u", "postgres"]
    # Not a pipe: PgBouncer writes every log line to stderr as well, and one nobody reads fills up and stops it.
    with open(directory / "stderr.log", "ab") as stderr:
        proc = subprocess.Popen([*command, str(directory / "pgbouncer.ini")], stdout=subprocess.DEVNULL, stderr=stderr)
    bouncer = Bouncer("127.0.0.1", port, proc.pid, directory)
    try:
        deadline = time.monotonic() + 15
        probe = f"host=127.0.0.1 port={port} dbname=postgres user={users[0]} connect_timeout=2"
        while True:
            assert proc.poll() is None, f"pgbouncer exited: {(directory / 'stderr.log').read_text(errors='replace')}"
            try:
                with psycopg.connect(probe, prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, f"pgbouncer on port {port} did not answer: {bouncer.log()}"
                time.sleep(0.05)
        yield bouncer
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)

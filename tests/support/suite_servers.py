"""The test suite's own embedded servers (under ./.keel/test), started only when no local server answers, and stopped
again at the end of the last test session that used them.

Several test sessions may share them (two terminals, or a session started while another runs): each one holds a
shared lock on ``<kind>.users`` for as long as it runs; at its end, a session that can take that lock exclusively is
the last one, and stops the server — by the pid it used, so a server someone restarted since is left alone.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from pathlib import Path

from models import embedded


def start_for_session(home: Path, kind: str, add_finalizer: Callable[[Callable[[], None]], None]) -> str:
    """Start (or reuse) the embedded ``kind`` ("postgres" or "redis") under ``home``; return its URL and register,
    with ``add_finalizer``, its stop at the end of the session when no other session still uses it."""
    start, status, stop = {
        "postgres": (embedded.start_postgres, embedded.postgres_status, embedded.stop_postgres),
        "redis": (embedded.start_redis, embedded.redis_status, embedded.stop_redis),
    }[kind]
    home.mkdir(parents=True, exist_ok=True)
    users = open(home / f"{kind}.users", "a")  # held, locked, for the whole session
    fcntl.flock(users, fcntl.LOCK_SH)
    url = start(home)
    pid = status(home).pid

    def finish() -> None:
        try:
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another session still runs on it: the last one stops it
            stop(home, pid)  # under the exclusive lock: no session can start using it meanwhile
        finally:
            users.close()  # releases whichever lock this session holds

    add_finalizer(finish)
    return url

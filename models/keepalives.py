"""TCP keepalives and the TCP user timeout for Keel's connections to PostgreSQL over TCP: a server that vanished
without a word (a partition, a host powered off) is given up on in about a minute, not after the kernel's two hours
(docs/explanation/storage-and-jobs.md#tcp-keepalives)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError
from sqlalchemy.engine import make_url

from models.settings import Settings


@dataclass(frozen=True)
class Keepalives:
    """libpq's ``keepalives_idle``, ``keepalives_interval``, ``keepalives_count`` and ``tcp_user_timeout``; 0 is
    libpq's own meaning: the operating system's default. A silent server is given up on after about ``idle +
    interval x count`` seconds while the connection waits for an answer, ``user_timeout_ms`` after a write that it
    does not acknowledge."""

    idle_seconds: int = 30
    interval_seconds: int = 10
    count: int = 3
    user_timeout_ms: int = 30_000

    @classmethod
    def from_settings(cls, settings: Settings) -> Keepalives:
        return cls(
            idle_seconds=settings.db_keepalives_idle_seconds,
            interval_seconds=settings.db_keepalives_interval_seconds,
            count=settings.db_keepalives_count,
            user_timeout_ms=settings.db_tcp_user_timeout_ms,
        )

    def options(self, url: str) -> dict[str, Any]:
        """The libpq connection parameters for a connection to ``url`` (none for a Unix socket)."""
        if over_unix_socket(url):
            return {}
        return {
            "keepalives": 1,
            "keepalives_idle": self.idle_seconds,
            "keepalives_interval": self.interval_seconds,
            "keepalives_count": self.count,
            "tcp_user_timeout": self.user_timeout_ms,
        }


#: The settings :func:`tcp_options` reads (as pydantic names them in an error).
_OWN_SETTINGS = ("db_keepalives_", "db_tcp_user_timeout")


def tcp_options(url: str, settings: Settings | None = None) -> dict[str, Any]:
    """The keepalive options ``settings`` ask for (``KEEL_DB_KEEPALIVES_*``, ``KEEL_DB_TCP_USER_TIMEOUT_MS``; default:
    the environment's), for a connection to ``url`` opened outside a :class:`~models.db.Database` (migrations, ``keel
    db roles``, the journal's archiver, the demo's lock); none for a Unix socket."""
    if settings is None:
        try:
            settings = Settings()
        except (ValidationError, SettingsError) as exc:
            if any(name in str(exc).lower() for name in _OWN_SETTINGS):
                raise  # one of these options' own settings is wrong: said here, not replaced by the defaults
            # Another setting is wrong (production without its audit keys, say): the command reports that itself, in
            # its own words (a migration refuses with BadConfiguration); the connection gets the default keepalives.
            return Keepalives().options(url)
    return Keepalives.from_settings(settings).options(url)


def over_unix_socket(url: str) -> bool:
    """Whether libpq reaches ``url``'s server over a Unix socket: every host it names (its ``?host=``, the URL's,
    else ``PGHOST``) is a directory (``/run/postgresql``) or an abstract socket (``@name``), or it names none."""
    parsed = make_url(url)
    query_host = parsed.query.get("host")
    named = (query_host if isinstance(query_host, str) else ",".join(query_host or ())) or parsed.host
    hosts = [host for host in (named or os.environ.get("PGHOST", "")).split(",") if host]
    return all(host.startswith(("/", "@")) for host in hosts)

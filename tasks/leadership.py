"""Which beat leads: a lease row on the database's clock (models/leadership_sql.py), renewed on every tick, which unlike
a session advisory lock works through a transaction pooler; one leader at a time, handed over at once on a clean stop
and within ``KEEL_BEAT_LEASE_SECONDS`` of a death (docs/explanation/runtime-outbox-and-workers.md#beat-leadership).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg

from models import leadership_sql
from models.leadership_sql import Lease
from models.settings import Settings

log = logging.getLogger("keel.dispatcher")

#: The beat leader's row in ``beat_leadership``.
BEAT = "beat"


class Leadership:
    """The beat leader's lease, asked for on a connection of its own (autocommit, no prepared statements: a
    transaction pooler may stand in between). :meth:`held` raises the driver's error when the database cannot be
    reached."""

    def __init__(self, url: str, settings: Settings, *, name: str = BEAT, holder: str | None = None) -> None:
        self.url = url
        # A statement timeout of half the lease, so a blocked renewal gives up within it; a transaction pooler
        # refuses startup options, so there the role's own timeout holds (docs/how-to/deploy.md#behind-pgbouncer).
        self._options: dict[str, Any] = (
            {}
            if settings.database_pooler == "transaction"
            else {"options": f"-c statement_timeout={max(1, int(settings.beat_lease_seconds * 500))}"}
        )
        self.name = name
        self.lease = timedelta(seconds=settings.beat_lease_seconds)
        # Unique per process start: a restarted beat (the same host and pid, in a container) is a new holder.
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.conn: psycopg.Connection[Any] | None = None
        self.term: int | None = None  # the lease's term (fencing number) while this beat leads
        self.terms = 0  # how many times this beat began leading: each is a new leadership term
        self._valid_until = 0.0  # monotonic: how long the last renewal may be trusted
        self._renewed_at = 0.0

    def held(self) -> bool:
        """Whether this beat is the leader (renewing its lease, or taking it if it has run out); raises
        :class:`psycopg.Error` if the database cannot be asked."""
        reused = self.conn is not None and not self.conn.closed
        while True:
            try:
                conn = self._connection()
                asked = time.monotonic()
                lease = leadership_sql.take(conn, self.name, self.holder, term=self.term, lease=self.lease)
                break
            except psycopg.Error as exc:
                dead = self.conn is None or self.conn.broken or self.conn.closed  # not a statement it refused
                self._drop_connection()
                if not (reused and dead and isinstance(exc, psycopg.OperationalError)):
                    raise
                # The connection kept between ticks died meanwhile (a PostgreSQL or PgBouncer restart): ask once
                # more on a new one rather than lose this tick. A database that is really away fails this too.
                reused = False
        answered = time.monotonic()
        if lease is None or lease.remaining_seconds <= 0 or answered >= asked + lease.remaining_seconds:
            self._lost(lease)
            return False
        if self.term is not None and lease.term == self.term and asked - self._renewed_at > self.lease.total_seconds():
            # Nobody took over, but the lease lapsed between two ticks: a tick longer than the lease (or a pause).
            log.warning(
                "this beat's lease lapsed between two ticks (%.1fs apart, lease %gs); nobody took over",
                asked - self._renewed_at,
                self.lease.total_seconds(),
            )
        self._renewed_at = asked
        self._valid_until = asked + lease.remaining_seconds
        if lease.term != self.term:
            self._began(lease)
        return True

    def valid(self) -> bool:
        """Whether the last renewal still holds by this process's monotonic clock (no database round trip)."""
        return self.term is not None and time.monotonic() < self._valid_until

    @property
    def valid_until(self) -> float:
        """Until when (this process's monotonic clock) the last renewal may be trusted; 0 when not leading."""
        return self._valid_until if self.term is not None else 0.0

    def release(self) -> None:
        """End this beat's term now (a clean stop hands over at once), and close the connection."""
        if self.conn is not None and self.term is not None:
            try:
                leadership_sql.give_up(self.conn, self.name, self.holder, term=self.term)
                log.info("this beat gave up leadership (term %d)", self.term)
            except psycopg.Error:
                pass  # the lease runs out by itself
        self.term = None
        self._drop_connection()

    def _began(self, lease: Lease) -> None:
        self.term = lease.term
        self.terms += 1
        log.info("this beat is the leader (term %d)", lease.term)

    def _lost(self, lease: Lease | None) -> None:
        if self.term is None:
            return
        if lease is None:
            holder = None
            try:
                holder = leadership_sql.current(self._connection(), self.name)
            except psycopg.Error:
                pass
            by = f"term {holder.term}, {holder.holder}" if holder is not None else "another beat"
            log.warning("this beat is no longer the leader (term %d): its lease was taken over (%s)", self.term, by)
        else:
            log.warning("this beat is no longer the leader (term %d): the database's answer came too late", self.term)
        self.term = None
        self._valid_until = 0.0

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(
                self.url,
                autocommit=True,
                prepare_threshold=None,
                # A renewal must fail in seconds when the network goes, not hang past the lease: keepalives and a
                # TCP user timeout below the default lease.
                keepalives=1,
                keepalives_idle=2,
                keepalives_interval=1,
                keepalives_count=2,
                tcp_user_timeout=4_000,
                connect_timeout=5,
                **self._options,
            )
        return self.conn

    def _drop_connection(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None

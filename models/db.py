"""Engine and connection helpers. One pool per process; the hot path borrows raw psycopg connections from it.
Nothing here relies on a session, so a transaction pooler carries it; what needs one opens :meth:`Database.session`
on the direct URL (docs/explanation/storage-and-jobs.md#behind-a-transaction-pooler)."""

from __future__ import annotations

import contextlib
import logging
import select
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import pq
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError

from models.audit_keys import AuditKeys, audit_keys_for
from models.embedded import database_url_for
from models.keepalives import Keepalives
from models.settings import BadConfiguration, Settings
from models.urls import libpq_url, sqlalchemy_url

log = logging.getLogger("keel.db")

#: Per connection, the notifications its open transaction will send once it has committed (:func:`notify_after_commit`).
_AFTER_COMMIT: weakref.WeakKeyDictionary[psycopg.Connection[Any], list[tuple[str, str]]] = weakref.WeakKeyDictionary()
# Its own transaction, committed without waiting for the WAL flush: PostgreSQL serializes every committing transaction
# that notifies on one lock held through its commit, so a NOTIFY inside a transition would make every transition wait
# for the others' flushes. A wake-up lost in a crash costs a listener its safety interval, never an event.
_NOTIFY = "SELECT set_config('synchronous_commit', 'off', true), pg_notify(%s, %s)"


def notify_after_commit(conn: psycopg.Connection[Any], channel: str, payload: str) -> None:
    """Send ``NOTIFY channel, payload`` once the transaction open on ``conn`` (one of :meth:`Database.transaction`)
    has committed; never if it rolls back."""
    _AFTER_COMMIT.setdefault(conn, []).append((channel, payload))


def taken_notifications(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    """The notifications the transaction open on ``conn`` asked for (:func:`notify_after_commit`), taken to be sent
    by the caller (:func:`queue_notifications`) instead of after the commit."""
    return _AFTER_COMMIT.pop(conn, None) or []


def queue_notifications(cur: psycopg.Cursor[Any], pending: list[tuple[str, str]]) -> None:
    """Queue ``pending`` (:func:`taken_notifications`) on ``cur``'s pipeline, right after the ``COMMIT`` queued there,
    each in a transaction of its own as :func:`_notify` sends them: they ride in the commit's round trip instead of one
    after it. The server skips them when anything queued before them in the pipeline failed (the commit was refused:
    nothing to announce); if they fail after a commit that happened, :func:`notifications_failed` says so."""
    for channel, payload in pending:
        cur.execute(_NOTIFY, (channel, payload))


def notifications_failed(pending: list[tuple[str, str]], exc: psycopg.Error) -> None:
    """Notifications queued after a commit that did happen could not be sent: logged, not raised (:func:`_notify`)."""
    log.warning("could not announce %d committed journal events: %s", len(pending), exc)


@contextmanager
def pipeline_begun(conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any] | None = None) -> Iterator[None]:
    """A pipeline whose statements open the connection's transaction, with the ``BEGIN`` in their round trip rather
    than one of its own (docs/explanation/storage-and-jobs.md#round-trips); what follows commits or rolls back as
    usual. The ``BEGIN`` runs on ``cur`` if given (a client-side cursor of ``conn``: its current result is discarded),
    else on a cursor of its own. Anywhere else (a transaction already open, an autocommit connection) it is a plain
    pipeline."""
    assert cur is None or (cur.connection is conn and not isinstance(cur, psycopg.ServerCursor)), "a cursor of conn"
    if conn.autocommit or conn.info.transaction_status != pq.TransactionStatus.IDLE or not hasattr(conn, "_autocommit"):
        with conn.pipeline():
            yield
        return
    conn.autocommit = True
    try:
        with conn.pipeline():
            if cur is not None:  # the caller's cursor, whose result is not read
                cur.execute("BEGIN", prepare=False)
            else:
                with conn.cursor() as begin:
                    begin.execute("BEGIN", prepare=False)
            yield
    finally:
        if conn.info.transaction_status == pq.TransactionStatus.IDLE:  # the BEGIN never ran: nothing is open
            conn.autocommit = False
        else:
            # psycopg's own state after its BEGIN (in a transaction, autocommit off), which its setter refuses to
            # enter from inside the transaction: set where psycopg keeps it.
            conn._autocommit = False


def end_read(conn: psycopg.Connection[Any]) -> None:
    """End the read-only transaction open on ``conn`` with a COMMIT, not a rollback, which would make psycopg forget
    the statements it prepared on the connection (docs/explanation/storage-and-jobs.md#round-trips). A transaction
    that failed is rolled back; none open, nothing is sent. Only for transactions that wrote nothing."""
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.INTRANS:
        conn.commit()
    elif status != pq.TransactionStatus.IDLE:
        conn.rollback()


class Database:
    """A PostgreSQL database: a SQLAlchemy engine for reads and migrations, raw psycopg for the hot path, and the
    journal's key ring (``audit_keys``: None, and every journal write is refused and verify checks no keyed link)."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 10,
        statement_timeout_ms: int = 30_000,
        connect_timeout_seconds: int | None = None,
        audit_keys: AuditKeys | None = None,
        pooler: str = "none",
        direct_url: str | None = None,
        keepalives: Keepalives | None = None,
        pool_timeout_seconds: float = 30.0,
        max_overflow: int | None = None,
        prepare_threshold: int = 5,
    ) -> None:
        # As given, for :meth:`sibling`.
        self._given: dict[str, Any] = {
            "statement_timeout_ms": statement_timeout_ms,
            "connect_timeout_seconds": connect_timeout_seconds,
            "audit_keys": audit_keys,
            "pooler": pooler,
            "direct_url": direct_url,
            "prepare_threshold": prepare_threshold,
            "keepalives": keepalives,
            "pool_timeout_seconds": pool_timeout_seconds,
        }
        self.url = sqlalchemy_url(url)
        self.direct_url = sqlalchemy_url(direct_url) if direct_url is not None else self.url
        self.pooler = pooler
        self.audit_keys = audit_keys
        self.pool_size = pool_size
        self.statement_timeout_ms = statement_timeout_ms
        self.keepalives = keepalives or Keepalives()
        connect_args: dict[str, Any] = self.keepalives.options(self.url)
        if pooler == "transaction":
            # The statement timeout is then the role's (ALTER ROLE … SET statement_timeout):
            # docs/how-to/deploy.md#behind-pgbouncer.
            connect_args["prepare_threshold"] = None
        else:
            connect_args["options"] = f"-c statement_timeout={statement_timeout_ms}"
            # After how many runs on a connection a statement is prepared (psycopg's default, 5, unless a caller with
            # a small fixed set of hot statements asks for 0: a worker, whose 20 connections would otherwise each run
            # every statement of a job's path unprepared five times, parsed and planned each time). A rollback inside a
            # transaction still makes psycopg forget them all (a rejected command, a fenced-off outcome: rare paths).
            connect_args["prepare_threshold"] = prepare_threshold
        if connect_timeout_seconds is not None:
            connect_args["connect_timeout"] = connect_timeout_seconds
        self.engine: Engine = create_engine(
            self.url,
            pool_size=pool_size,
            # A burst opens as many again (None), closed once returned; a process that must not churn through
            # connections (a threads worker: hundreds of jobs borrowing in turn) passes 0 and keeps exactly its size.
            max_overflow=pool_size if max_overflow is None else max_overflow,
            # Every connection busy that long (a slow or hung database): the checkout raises, which Keel counts as
            # the database being away (agents.core.outage.is_outage) — a worker hands its message back.
            pool_timeout=pool_timeout_seconds,
            pool_recycle=1800,
            connect_args=connect_args,
        )
        # A connection a restart or failover killed is replaced at checkout, from what the server said on it while it
        # sat idle (no ping round trip): docs/explanation/storage-and-jobs.md#behind-a-transaction-pooler.
        event.listen(self.engine, "checkout", _replace_if_dead)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        pool_size: int | None = None,
        connect_timeout_seconds: int | None = None,
        max_overflow: int | None = None,
        prepare_threshold: int = 5,
    ) -> Database:
        """The configured database, or the embedded one when ``KEEL_DATABASE_URL`` is unset, with the configured
        audit key ring (or the development key: see models/audit_keys.py)."""
        return cls(
            database_url_for(settings),
            pool_size=pool_size or settings.db_pool_size,
            statement_timeout_ms=settings.statement_timeout_ms,
            connect_timeout_seconds=connect_timeout_seconds,
            audit_keys=audit_keys_for(settings),
            pooler=settings.database_pooler,
            direct_url=settings.database_direct_url,
            keepalives=Keepalives.from_settings(settings),
            max_overflow=max_overflow,
            prepare_threshold=prepare_threshold,
        )

    def sibling(self, pool_size: int) -> Database:
        """The same database with a pool of its own of exactly ``pool_size`` connections, for what must never wait
        behind the others for one (a worker's lease keeper, behind its 200 jobs)."""
        return Database(self.url, pool_size=pool_size, max_overflow=0, **self._given)

    @property
    def libpq_url(self) -> str:
        return libpq_url(self.url)

    @property
    def direct_libpq_url(self) -> str:
        """Where a connection that needs a session of its own goes: ``KEEL_DATABASE_DIRECT_URL``, else the URL."""
        return libpq_url(self.direct_url)

    @property
    def session_options(self) -> dict[str, Any]:
        """libpq parameters for a connection of its own on the direct URL (:meth:`session`, the API's asynchronous
        listener): the statement timeout and the keepalives."""
        return {
            "options": f"-c statement_timeout={self.statement_timeout_ms}",
            **self.keepalives.options(self.direct_url),
        }

    @contextmanager
    def session(self, **kwargs: Any) -> Iterator[psycopg.Connection[Any]]:
        """A connection of its own on the direct URL (not pooled, not through a transaction pooler), for session
        state: a session lock, LISTEN. Closed at the end, which frees whatever the session held."""
        with psycopg.connect(self.direct_libpq_url, **{**self.session_options, **kwargs}) as conn:
            yield conn

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled psycopg connection, returned to the pool afterwards."""
        pooled = self.engine.raw_connection()
        conn = pooled.driver_connection
        assert isinstance(conn, psycopg.Connection)
        try:
            yield conn
        finally:
            if conn.broken or conn.closed:
                # Lost (the server went away under it): discarded, not reset. A reset is a rollback, which on a lost
                # connection raises, and the pool would log that as an error with its traceback.
                pooled.invalidate()
            else:
                pooled.close()

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Cursor[Any]]:
        """A cursor inside one transaction: committed when the block ends, rolled back if it raises. What it asked
        to :func:`notify_after_commit` is sent after the commit."""
        with self.connection() as conn:
            _AFTER_COMMIT.pop(conn, None)
            try:
                with conn.cursor() as cur:
                    yield cur
                conn.commit()
            except BaseException:
                _AFTER_COMMIT.pop(conn, None)
                if not conn.broken:  # a lost connection has no transaction left to roll back
                    conn.rollback()
                raise
            pending = _AFTER_COMMIT.pop(conn, None)
            if pending:
                _notify(conn, pending)

    @contextmanager
    def reading(self, *, statement_timeout: timedelta) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for reads, in a transaction whose every statement is cancelled after
        ``statement_timeout`` (``SET LOCAL statement_timeout``: a lock held elsewhere, a slow plan); ended with
        :func:`end_read` (only reads belong in it)."""
        milliseconds = max(1, round(statement_timeout.total_seconds() * 1000))
        with self.connection() as conn:
            try:
                conn.execute("SELECT set_config('statement_timeout', %s, true)", (f"{milliseconds}ms",))
                yield conn
            finally:
                end_read(conn)

    @contextmanager
    def autocommit(self) -> Iterator[psycopg.Cursor[Any]]:
        """A cursor whose every statement commits by itself: one round trip for a one-statement write."""
        with self.connection() as conn:
            conn.autocommit = True
            try:
                with conn.cursor() as cur:
                    yield cur
            finally:
                conn.autocommit = False

    def dispose(self) -> None:
        self.engine.dispose()


def check_route(db: Database, *, production: bool) -> None:
    """At a process's start, raise :class:`BadConfiguration` (one line naming the setting) if the statement timeout
    Keel sent did not reach the server (something in between drops startup options), if ``KEEL_DATABASE_URL``
    reaches a pooler while ``KEEL_DATABASE_POOLER`` does not say so, or if, behind a transaction pooler,
    ``KEEL_DATABASE_DIRECT_URL`` reaches a pooler rather than PostgreSQL. Behind a transaction pooler the
    timeout is the server's: a server with none is refused in production and warned of elsewhere."""
    with db.connection() as conn:
        said_pid = conn.info.backend_pid
        row = conn.execute(_TIMEOUT).fetchone()
        conn.rollback()
    assert row is not None
    server_ms, role, server_pid = int(row[0]), str(row[1]), int(row[2])
    wanted_ms = db.statement_timeout_ms
    if db.pooler != "transaction":
        if server_ms != wanted_ms:
            raise BadConfiguration(
                f"bad configuration: KEEL_STATEMENT_TIMEOUT_MS: sent at connect as {wanted_ms} ms, but the server's"
                f" statement_timeout is {server_ms} ms: something between Keel and PostgreSQL drops startup options"
                " (PgBouncer with ignore_startup_parameters = options); behind a pooler in transaction mode set"
                f" KEEL_DATABASE_POOLER=transaction and the timeout on the role (ALTER ROLE {role} SET"
                " statement_timeout = ...)"
            )
        if said_pid != server_pid:
            # A pooler that passes the timeout on (or a role whose own timeout happens to match) is still a pooler:
            # with prepared statements on, its clients would run each other's statements.
            raise BadConfiguration(
                "bad configuration: KEEL_DATABASE_POOLER: KEEL_DATABASE_URL reaches a connection pooler, not"
                " PostgreSQL itself (the backend pid the connection was given is not its server process's), and"
                " KEEL_DATABASE_POOLER is not 'transaction': set KEEL_DATABASE_POOLER=transaction (with"
                " KEEL_DATABASE_DIRECT_URL pointing at PostgreSQL; it serves a pooler in session mode too), or point"
                " KEEL_DATABASE_URL at PostgreSQL"
            )
        return
    if server_ms != wanted_ms and wanted_ms > 0:
        said = (
            f"KEEL_STATEMENT_TIMEOUT_MS: behind KEEL_DATABASE_POOLER=transaction the statement timeout is the"
            f" server's, and role {role} has {f'{server_ms} ms' if server_ms else 'none'}, not {wanted_ms} ms: set it"
            f" on the role (ALTER ROLE {role} SET statement_timeout = '{wanted_ms}ms'), then RECONNECT in PgBouncer's"
            " admin console (a RELOAD keeps the server connections it has, with the old setting)"
        )
        if server_ms == 0 and production:
            raise BadConfiguration(f"bad configuration: {said}")
        log.warning("%s", said)
    _check_direct(db)


def _check_direct(db: Database) -> None:
    """A pooler answers a client with a backend pid of its own making (the cancel key it hands out), not the one of
    the server process that runs the client's statements: PostgreSQL itself gives the same pid both ways."""
    try:
        with psycopg.connect(
            db.direct_libpq_url, autocommit=True, prepare_threshold=None, **db.keepalives.options(db.direct_url)
        ) as conn:
            said_pid = conn.info.backend_pid
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
    except psycopg.OperationalError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("could not check KEEL_DATABASE_DIRECT_URL: %s", reason)
        return
    if row is None or int(row[0]) != said_pid:
        raise BadConfiguration(
            "bad configuration: KEEL_DATABASE_DIRECT_URL: it reaches a connection pooler, not PostgreSQL itself (the"
            " backend pid the connection was given is not its server process's): point it at PostgreSQL's host and"
            " port; the API's live events (LISTEN) and the audit shipper's lock need a session of their own"
        )


_TIMEOUT = "SELECT setting, current_user, pg_backend_pid() FROM pg_settings WHERE name = 'statement_timeout'"


def _notify(conn: psycopg.Connection[Any], pending: list[tuple[str, str]]) -> None:
    """Send the notifications of a committed transaction. A failure is logged, not raised: what they announce has
    committed, and a listener re-reads what it follows at its safety interval anyway."""
    conn.autocommit = True  # one statement, its own transaction: one round trip, no BEGIN nor COMMIT
    try:
        with conn.cursor() as cur:
            for channel, payload in pending:
                cur.execute(_NOTIFY, (channel, payload))
    except psycopg.Error as exc:
        notifications_failed(pending, exc)
    finally:
        with contextlib.suppress(psycopg.Error):  # a broken connection: the pool's checkout discards it
            conn.autocommit = False


def _replace_if_dead(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """Refuse (so the pool replaces it) a pooled connection the server has closed or spoken on while it was idle.
    An idle connection in the pool has no query running, so anything to read on it is the server's goodbye (a
    terminated backend sends its FATAL error and closes; a restart closes) or something as rare that a fresh
    connection is as good as: no round trip is spent to find out."""
    conn = dbapi_connection
    if not isinstance(conn, psycopg.Connection):  # pragma: no cover - always psycopg here
        return
    if conn.closed or conn.broken or conn.pgconn.status != pq.ConnStatus.OK or _readable(conn.pgconn.socket):
        raise DisconnectionError("the pooled connection was closed by the server")


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))

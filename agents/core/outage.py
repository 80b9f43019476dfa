"""A dependency that went away (the database, the broker): tell the log once when it goes down and once when it is
back, instead of a traceback per failed attempt, and space the attempts in between with exponential backoff."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg
import sqlalchemy.exc

from agents.core.errors import StoreError

#: The first retry after a failure, and the longest wait between two (doubling in between).
FIRST_RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 5.0


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database could not be reached (restart, failover, dropped connection, timeout) —
    worth trying again later — rather than that it refused what was asked."""
    while exc is not None:
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            return True
        if isinstance(exc, sqlalchemy.exc.TimeoutError):
            # The process's pool had no connection free within its timeout (every one busy on a slow or hung
            # database): back-pressure, worth trying again later, not a refusal of what was asked.
            return True
        if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
            return True
        if isinstance(exc, sqlalchemy.exc.DBAPIError | StoreError):
            exc = exc.__cause__ or getattr(exc, "orig", None)  # type: ignore[assignment]
            continue
        return False
    return False


#: SQLSTATEs of a statement that failed on a server that did answer — a statement or lock timeout; a deadlock or a
#: serialization failure (class 40) — which psycopg raises as OperationalError too: the work's own failure (worth
#: trying again, and saying so), not the database being away.
STATEMENT_FAILURES = frozenset({"57014", "55P03"})


def statement_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is a statement the server answered with a timeout, a deadlock or a
    serialization failure (:data:`STATEMENT_FAILURES`)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, psycopg.Error):
            state = current.sqlstate or ""
            return state in STATEMENT_FAILURES or state.startswith("40")
        inner = getattr(current, "orig", None) if isinstance(current, sqlalchemy.exc.DBAPIError) else None
        current = inner if isinstance(inner, BaseException) else current.__cause__
    return False


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database could not be reached (:func:`is_outage`), not that one statement failed on
    it (:func:`statement_failed`): what a "database down" line may say. A pass whose statement timed out failed
    itself, and says so with its own error."""
    return is_outage(exc) and not statement_failed(exc)


def reason(exc: BaseException) -> str:
    """One line saying why: the driver's own message (not SQLAlchemy's or Keel's wrapping of it)."""
    while True:
        inner = getattr(exc, "orig", None) if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc.__cause__
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    text = " ".join(str(exc).split()) or "no message"
    return f"{type(exc).__name__}: {text[:300]}"


class Outage:
    """The state of one dependency as one process sees it: up, or down since when, and when to try again.

    ``failed(exc)`` after an attempt that could not reach it, ``recovered()`` after one that did. Only the changes
    are logged (WARNING, so that both show at any log level); the attempts in between go to DEBUG, with their
    traceback. Thread-safe: a worker's lease keeper and its tasks share one.
    """

    def __init__(
        self,
        what: str,
        log: logging.Logger,
        *,
        first: float = FIRST_RETRY_SECONDS,
        cap: float = MAX_RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.log = log
        self.first = first
        self.cap = max(cap, first)
        self.clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None
        self._failures = 0
        self._next_try = 0.0

    @property
    def down(self) -> bool:
        return self._since is not None

    def wait(self) -> float:
        """Seconds until the next attempt is due: 0 when the dependency is up or the backoff has passed."""
        with self._lock:
            if self._since is None:
                return 0.0
            return max(0.0, self._next_try - self.clock())

    def failed(self, exc: BaseException) -> float:
        """Record an attempt that could not reach the dependency; return how long to wait before the next one."""
        now = self.clock()
        with self._lock:
            self._failures += 1
            failures = self._failures
            delay: float = min(self.cap, self.first * 2.0 ** min(failures - 1, 30))
            self._next_try = now + delay
            went_down = self._since is None
            if went_down:
                self._since = now
        if went_down:
            self.log.warning(
                "%s down: %s; retrying with backoff (%.1fs, doubling up to %.0fs)",
                self.what,
                reason(exc),
                delay,
                self.cap,
            )
            self.log.debug("%s down", self.what, exc_info=exc)
        else:
            self.log.debug("%s still down (attempt %d, next in %.1fs): %s", self.what, failures, delay, reason(exc))
        return delay

    def recovered(self) -> None:
        """Record an attempt that reached the dependency."""
        now = self.clock()
        with self._lock:
            since, failures = self._since, self._failures
            if since is None:
                return
            self._since, self._failures, self._next_try = None, 0, 0.0
        self.log.warning("%s back after %.1fs (%d failed attempts)", self.what, now - since, failures)

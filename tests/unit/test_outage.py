"""One line when a dependency goes away, one when it is back, backoff in between; Celery's housekeeping lines at
DEBUG. (The same through real processes: tests/chaos/test_quiet_logs.py.)"""

from __future__ import annotations

import logging

import psycopg
import pytest
import sqlalchemy.exc

from agents.core.errors import StoreError
from agents.core.outage import Outage, is_outage, reason
from tasks.app import HOUSEKEEPING, RELAY_OUTBOX, RUN_JOB
from tasks.logs import HandedBack, HousekeepingAtDebug


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused() -> StoreError:
    try:
        raise psycopg.OperationalError('connection to server at "db", port 5432 failed: Connection refused')
    except psycopg.OperationalError as exc:
        wrapped = StoreError(f"database error: {exc}")
        wrapped.__cause__ = exc
        return wrapped


def test_an_outage_is_one_line_down_and_one_back_with_backoff_between(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    outage = Outage("database", logging.getLogger("keel.test"), first=0.5, cap=5, clock=clock)
    caplog.set_level(logging.INFO)
    delays = [outage.failed(refused()) for _ in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0], "doubling, capped"
    assert outage.down and outage.wait() == 5.0
    clock.now += 2
    assert outage.wait() == 3.0
    outage.recovered()
    outage.recovered()
    assert not outage.down and outage.wait() == 0
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        (
            "WARNING",
            'database down: OperationalError: connection to server at "db", port 5432 failed: Connection refused;'
            " retrying with backoff (0.5s, doubling up to 5s)",
        ),
        ("WARNING", "database back after 2.0s (6 failed attempts)"),
    ]
    assert outage.failed(refused()) == 0.5, "a new outage starts its backoff afresh"


def test_what_counts_as_the_database_being_away() -> None:
    assert is_outage(refused()) and reason(refused()).startswith("OperationalError: connection to server")
    assert not is_outage(StoreError("database error: duplicate key")) and not is_outage(ValueError("x"))
    exhausted = sqlalchemy.exc.TimeoutError("QueuePool limit of size 2 overflow 2 reached, connection timed out")
    assert is_outage(exhausted), "no pooled connection free in time: try again later, as for an unreachable server"


def _record(task: str | None, level: int = logging.INFO, exc: BaseException | None = None) -> logging.LogRecord:
    args = {"name": task, "id": "1"} if task else ()
    exc_info = (type(exc), exc, None) if exc else None
    return logging.LogRecord("celery.app.trace", level, __file__, 1, "Task %(name)s[%(id)s] ok", args, exc_info)


@pytest.mark.parametrize("debug", [False, True])
def test_housekeeping_lines_go_to_debug_and_jobs_stay_at_info(debug: bool) -> None:
    loggers = [logging.getLogger(name) for name in ("celery.app.trace", "celery.beat")]
    for logger in loggers:
        logger.setLevel(logging.DEBUG if debug else logging.INFO)
    try:
        quiet = HousekeepingAtDebug(HOUSEKEEPING)
        job, relay = _record(RUN_JOB), _record(RELAY_OUTBOX)
        assert quiet.filter(job) and job.levelno == logging.INFO, "a job's line is untouched"
        assert quiet.filter(relay) is debug, "the relay's line is shown only at DEBUG"
        assert relay.levelno == (logging.DEBUG if debug else logging.INFO)
        handed_back = _record(RUN_JOB, logging.WARNING, HandedBack("database down", requeue=True))
        assert quiet.filter(handed_back) is debug, "a message handed back in an outage: no line per message"
        if debug:
            assert handed_back.levelno == logging.DEBUG and handed_back.exc_info is None, "and no traceback"
        beat = logging.LogRecord(
            "celery.beat", logging.INFO, __file__, 1, "Scheduler: Sending due task %s (%s)", ("r", RELAY_OUTBOX), None
        )
        assert quiet.filter(beat) is debug
    finally:
        for logger in loggers:
            logger.setLevel(logging.NOTSET)


def test_a_statement_failure_on_a_live_server_is_not_the_database_being_away() -> None:
    import psycopg
    import sqlalchemy.exc

    from agents.core.errors import StoreError
    from agents.core.outage import is_outage, statement_failed, unreachable

    for error in (
        psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
        psycopg.errors.LockNotAvailable("could not obtain lock"),
        psycopg.errors.DeadlockDetected("deadlock detected"),
        psycopg.errors.SerializationFailure("could not serialize access"),
    ):
        assert is_outage(error), "still worth trying again (a worker hands its message back)"
        assert statement_failed(error) and not unreachable(error)
        wrapped = StoreError("claim failed")
        wrapped.__cause__ = sqlalchemy.exc.OperationalError("SELECT", {}, error)
        assert statement_failed(wrapped) and not unreachable(wrapped)
    for error in (
        psycopg.OperationalError("server closed the connection unexpectedly"),
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.InterfaceError("the connection is closed"),
    ):
        assert unreachable(error) and not statement_failed(error)

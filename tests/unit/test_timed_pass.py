"""A leader's timed pass (tasks/passes.py): run when due, never two at once, and an outage it met reported once —
unless its run started before the database came back from that outage, when saying it would log a second
"database down" after "back"."""

from __future__ import annotations

import logging
import threading
import time

import psycopg
import pytest

from tasks.passes import TimedPass


def failing_once() -> tuple[TimedPass, threading.Event]:
    done = threading.Event()

    def run() -> None:
        try:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        finally:
            done.set()

    return TimedPass("test", 60.0, run), done


def settle(timed: TimedPass, done: threading.Event) -> None:
    assert done.wait(5)
    timed.join(5)
    assert not timed.running()


def test_an_outage_a_pass_met_is_reported_once() -> None:
    timed, done = failing_once()
    assert timed.poke(time.monotonic()) is None  # started
    settle(timed, done)
    outage = timed.poke(time.monotonic(), back_since=0.0)
    assert isinstance(outage, psycopg.OperationalError)
    assert timed.poke(time.monotonic()) is None, "once"


def test_a_pass_failing_while_the_tick_reaches_the_database_is_still_reported() -> None:
    """The tick reaching the database between the pass's failure and the next poke (every tick does) does not make
    the pass's error stale: only a recovery from an outage that began before the run started does."""
    back_since = time.monotonic()  # the database came back (or never went away) before the run started
    timed, done = failing_once()
    timed.poke(time.monotonic(), back_since=back_since)
    settle(timed, done)
    time.sleep(0.01)  # ticks reach the database meanwhile: nothing they do changes back_since
    assert isinstance(timed.poke(time.monotonic(), back_since=back_since), psycopg.OperationalError)


def test_an_outage_a_run_met_before_the_database_came_back_is_said_as_such_not_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    timed, done = failing_once()
    timed.poke(time.monotonic())
    settle(timed, done)
    back_since = time.monotonic()  # the database came back after the run had started: the outage it met is over
    with caplog.at_level(logging.INFO, logger="keel.dispatcher"):
        assert timed.poke(back_since, back_since=back_since) is None
    assert "test pass met the database outage that has ended" in caplog.text
    assert timed.poke(time.monotonic(), back_since=0.0) is None, "dropped, not kept for later"


def test_a_pass_is_not_started_again_before_it_is_due_nor_while_it_runs() -> None:
    release, started = threading.Event(), []

    def run() -> None:
        started.append(1)
        release.wait(5)

    timed = TimedPass("slow", 0.0, run)
    now = time.monotonic()
    timed.poke(now)
    timed.poke(now + 1)  # due again, but still running
    release.set()
    timed.join(5)
    assert started == [1]
    timed.poke(now + 2)
    timed.join(5)
    assert started == [1, 1]

    later = TimedPass("later", 60.0, lambda: started.append(2))
    later.poke(now)
    later.join(5)
    later.poke(now + 1)  # not due for another 59 s
    later.join(5)
    assert started.count(2) == 1


@pytest.mark.parametrize(
    "error",
    [psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected],
)
def test_a_statement_that_failed_on_a_live_database_is_the_passs_own_failure(
    error: type[psycopg.Error], caplog: pytest.LogCaptureFixture
) -> None:
    """A statement timeout (psycopg raises it as OperationalError, as it does a lost connection) is not the database
    being away: the pass logs its failure at ERROR and runs again when due; the tick is told of no outage (it would
    log "database down" and skip dispatching)."""
    done = threading.Event()

    def run() -> None:
        try:
            raise error("canceling statement due to statement timeout")
        finally:
            done.set()

    timed = TimedPass("kpi-fold", 60.0, run)
    with caplog.at_level(logging.INFO, logger="keel.dispatcher"):
        timed.poke(time.monotonic())
        settle(timed, done)
        assert timed.poke(time.monotonic()) is None
    failed = [r for r in caplog.records if r.getMessage() == "kpi-fold pass failed; retrying at its next interval"]
    assert failed and failed[0].levelno == logging.ERROR

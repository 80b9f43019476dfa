"""A leader's timed pass (tasks/passes.py): run when due, never two at once, and an outage it met reported once —
unless the database has been reached since, when saying it would log a second "database down" after "back"."""

from __future__ import annotations

import threading
import time

import psycopg

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
    outage = timed.poke(time.monotonic(), reached=0.0)
    assert isinstance(outage, psycopg.OperationalError)
    assert timed.poke(time.monotonic()) is None, "once"


def test_an_outage_from_before_the_database_was_reached_again_is_stale() -> None:
    timed, done = failing_once()
    timed.poke(time.monotonic())
    settle(timed, done)
    reached = time.monotonic()  # the tick reached the database after the pass failed: that outage is over
    assert timed.poke(reached, reached=reached) is None
    assert timed.poke(time.monotonic(), reached=0.0) is None, "dropped, not kept for later"


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

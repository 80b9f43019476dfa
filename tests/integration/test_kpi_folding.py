"""Folding the KPI counters into rollups: never a delta counted twice, windows of whole minutes, old minutes pruned,
a figure the same before and after a fold, and the fold a pass of the leading beat's own."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.jobs.handlers import registry
from models.db import Database
from models.kpi_sql import fold, totals, window
from models.settings import Settings
from tests.support.broker import Broker
from tests.support.keys import scoped
from tests.support.kpis import deltas, exported

pytestmark = pytest.mark.integration

registry.declare("slow")  # submitted and dispatched here, never run


def test_folds_at_once_never_count_a_delta_twice_and_readers_never_see_one_twice(
    db: Database, raw: psycopg.Connection[Any]
) -> None:
    raw.execute(
        "INSERT INTO kpi_deltas (name, label, value) SELECT 'suppressed_duplicates', 'kind=submit', 1"
        " FROM generate_series(1, 3000)"
    )
    folded: list[int] = []
    seen: list[int] = []
    start = threading.Barrier(3)
    done = threading.Event()

    def folder() -> None:
        start.wait()
        while n := fold(db, limit=100):
            folded.append(n)

    def reader() -> None:
        start.wait()
        while not done.is_set():
            seen.append(totals(db).suppressed_duplicates["submit"])

    threads = [threading.Thread(target=folder), threading.Thread(target=folder)]
    watcher = threading.Thread(target=reader)
    for t in [*threads, watcher]:
        t.start()
    for t in threads:
        t.join(60)
    done.set()
    watcher.join(60)
    assert sum(folded) == 3000 and deltas(raw) == 0
    assert set(seen) == {3000}, "a reader saw a delta twice or not at all while it was being folded"
    assert totals(db).suppressed_duplicates["submit"] == 3000
    rows = raw.execute("SELECT bucket = '-infinity', sum(value) FROM kpi_rollups GROUP BY 1 ORDER BY 1").fetchall()
    assert rows == [(False, 3000.0), (True, 3000.0)]  # the minutes, and the running total


def test_a_window_leaves_out_what_is_older_and_old_minutes_are_pruned(
    db: Database, raw: psycopg.Connection[Any]
) -> None:
    for age, n in (("3 hours", 4), ("2 hours", 2), ("10 minutes", 1)):
        raw.execute(
            "INSERT INTO kpi_deltas (at, name, label, value) VALUES (now() - %s::interval, 'budget_stops', '', %s)",
            (age, n),
        )
    assert (window(db, timedelta(hours=1)).budget_stops, window(db, timedelta(minutes=150)).budget_stops) == (1, 3)
    assert fold(db) == 3
    # The same figures once folded: whole minutes, the first one inside the window included, older ones not.
    assert (window(db, timedelta(hours=1)).budget_stops, window(db, timedelta(minutes=150)).budget_stops) == (1, 3)
    assert window(db, timedelta(hours=4)).budget_stops == totals(db).budget_stops == 7
    raw.execute("INSERT INTO kpi_deltas (name, value) VALUES ('budget_stops', 1)")  # not folded yet: counted too
    assert (window(db, timedelta(minutes=1)).budget_stops, totals(db).budget_stops) == (1, 8)
    # Pruning drops per-minute history beyond the retention; the running totals stay.
    fold(db, retention=timedelta(minutes=150))
    assert window(db, timedelta(hours=4)).budget_stops == 4
    assert totals(db).budget_stops == 8
    # A window is whole minutes: a shorter one would hold nothing most of the time (`keel kpi --since 30s`).
    for short in (timedelta(0), timedelta(seconds=30)):
        with pytest.raises(ValueError, match="at least a minute"):
            window(db, short)


def test_the_leading_beat_folds_the_counters_and_a_failed_fold_stops_no_dispatch(
    db_url: str,
    broker: Broker,
    client: Client,
    raw: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fold is a pass of the leading beat's own, on a thread of its own: at most every KEEL_KPI_FOLD_SECONDS,
    and neither a slow fold nor a failed one holds up dispatching."""
    from celery import Celery

    from tasks import dispatcher
    from tasks.app import celery_config
    from tasks.dispatcher import KeelScheduler

    for name, value in {"KEEL_DATABASE_URL": db_url, **broker.env, "KEEL_KPI_FOLD_SECONDS": "3600"}.items():
        monkeypatch.setenv(name, value)
    app = Celery("kpi-test", set_as_current=False)
    app.conf.update(celery_config(Settings()))
    beat = KeelScheduler(app=app)
    (folding,) = [timed for timed in beat.passes if timed.name == "kpi-fold"]
    entered, release = threading.Event(), threading.Event()
    real_fold = dispatcher.fold
    try:
        raw.execute("INSERT INTO kpi_deltas (name, value) VALUES ('budget_stops', 1)")
        beat.tick()
        folding.join(30)
        assert deltas(raw) == 0 and totals(client.db).budget_stops == 1
        raw.execute("INSERT INTO kpi_deltas (name, value) VALUES ('budget_stops', 1)")
        beat.tick()
        folding.join(30)
        assert deltas(raw) == 1, "folded at most every KEEL_KPI_FOLD_SECONDS"

        def slow(*args: Any, **kw: Any) -> int:
            entered.set()
            release.wait(60)
            return real_fold(*args, **kw)

        # A slow fold: the tick returns while it runs, and dispatches.
        monkeypatch.setattr(dispatcher, "fold", slow)
        folding._next = 0.0
        agent = client.create_agent("a")
        beat.tick()
        assert entered.wait(30) and folding.running()
        client.submit(agent.id, "r-1", None, operation="slow")
        beat.tick()
        (status,) = raw.execute(  # type: ignore[misc]
            "SELECT status FROM jobs WHERE key = %s", (scoped(agent.id, "r-1:slow:1"),)
        ).fetchone()
        assert status == "enqueued", "dispatched while the fold is under way"
        release.set()
        folding.join(30)
        assert deltas(raw) == 0
        # A fold that fails (here: its table is gone) is logged; the jobs are dispatched all the same.
        monkeypatch.setattr(dispatcher, "fold", real_fold)
        raw.execute("ALTER TABLE kpi_rollups RENAME TO kpi_rollups_away")
        raw.execute("INSERT INTO kpi_deltas (name, value) VALUES ('budget_stops', 1)")
        folding._next = 0.0
        other = client.create_agent("b")
        client.submit(other.id, "r-2", None, operation="slow")
        with caplog.at_level(logging.ERROR, logger="keel.dispatcher"):
            beat.tick()
            folding.join(30)
        (status,) = raw.execute(  # type: ignore[misc]
            "SELECT status FROM jobs WHERE key = %s", (scoped(other.id, "r-2:slow:1"),)
        ).fetchone()
        assert status == "enqueued", "dispatched although the fold failed"
        assert "kpi-fold pass failed; retrying at its next interval" in caplog.text
        assert deltas(raw) >= 1, "the deltas wait for a fold that works"
    finally:
        release.set()
        raw.execute("ALTER TABLE IF EXISTS kpi_rollups_away RENAME TO kpi_rollups")
        beat.close()


def test_a_counter_reads_the_same_before_and_after_a_fold(db: Database, raw: psycopg.Connection[Any]) -> None:
    """Exact sums: rollup + 0.2 + 0.3 before the fold and rollup + (0.2 + 0.3) after it are one figure (in floats the
    first is 0.6000000000000001, the second 0.6: a counter going back, which Prometheus takes for a reset)."""
    raw.execute("INSERT INTO kpi_deltas (name, value) VALUES ('spent_cost', 0.1)")
    fold(db)
    raw.execute("INSERT INTO kpi_deltas (name, value) VALUES ('spent_cost', 0.2), ('spent_cost', 0.3)")
    before = exported(db)["keel_spent_cost_total"]
    assert fold(db) == 2
    after = exported(db)["keel_spent_cost_total"]
    assert before == after == 0.6
    assert totals(db).spent_cost == 0.6

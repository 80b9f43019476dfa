"""Exporting the KPIs: gauges read through partial indexes, exactly the contract's names, and a scrape that answers
within its read timeout (kpi_up 0) when the database is away or locked, never queued behind another."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agents.observability.alerts import AlertsCollector
from agents.observability.kpis import DomainCollector
from agents.observability.names import ALERTS, DOMAIN
from models.db import Database
from models.kpi_sql import gauges
from models.urls import libpq_url
from tests.support.metrics import contract_problems

pytestmark = pytest.mark.integration


def test_gauges_read_live_rows_through_partial_indexes(db: Database, raw: psycopg.Connection[Any]) -> None:
    from models import kpi_sql

    raw.execute("SET enable_seqscan = off")  # as on a big table: only an index (or nothing) may be used
    for query in (kpi_sql._JOBS_BY_STATUS, kpi_sql._OLDEST_DUE, kpi_sql._BACKLOG, kpi_sql._DEAD):
        plan = "\n".join(r[0] for r in raw.execute(f"EXPLAIN {query}"))
        assert "Seq Scan" not in plan, plan
        assert re.search(r"ix_jobs_due|ix_outbox_line|ix_outbox_dead", plan), plan
    assert gauges(db).jobs_by_status == {"pending": 0, "enqueued": 0, "running": 0}


def test_an_unreachable_database_exports_kpi_up_zero_and_nothing_else(tmp_path: Path) -> None:
    down = Database("postgresql://postgres@127.0.0.1:1/nowhere", pool_size=1)
    try:
        registry = CollectorRegistry()
        registry.register(DomainCollector(down))
        text = generate_latest(registry).decode()
    finally:
        down.dispose()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert [(s.name, s.value) for s in samples] == [("keel_kpi_up", 0.0)]


def test_the_domain_collector_exports_exactly_the_contract_names(db: Database) -> None:
    """The dashboard and the alert rules are checked against agents/observability/names.py; this holds the collector
    that exports the domain KPIs (and the alerts') to the same list, both ways."""
    domain, alerting = DomainCollector(db, cache_seconds=0), AlertsCollector(db, cache_seconds=0)
    assert contract_problems(domain, DOMAIN) == []
    assert contract_problems(alerting, ALERTS) == []
    exported_families = {f.name for f in domain.collect()}
    assert exported_families == {m.family for m in DOMAIN}


@pytest.fixture
def patient_db(db_url: str) -> Iterator[Database]:
    """The test database with a statement timeout of 10 minutes: a read that waits on a lock waits that long unless
    the reader cuts it short itself."""
    database = Database(db_url, pool_size=4, statement_timeout_ms=600_000)
    yield database
    database.dispose()


@pytest.fixture
def locked(db_url: str) -> Iterator[Any]:
    """``locked(table)``: another connection holds ``table`` in ACCESS EXCLUSIVE mode until the test ends (or it
    calls ``.release()``)."""
    holders: list[psycopg.Connection[Any]] = []

    class Locker:
        def __call__(self, table: str) -> None:
            conn = psycopg.connect(libpq_url(db_url))
            conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            holders.append(conn)

        def release(self) -> None:
            for conn in holders:
                conn.rollback()

    yield Locker()
    for conn in holders:
        conn.close()


def scrape_in_thread(registry: CollectorRegistry) -> tuple[threading.Thread, list[str]]:
    out: list[str] = []
    thread = threading.Thread(target=lambda: out.append(generate_latest(registry).decode()), daemon=True)
    thread.start()
    return thread, out


def samples_of(text: str) -> list[tuple[str, float]]:
    return [(s.name, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def test_a_scrape_answers_within_its_read_timeout_while_a_lock_holds_the_counters(
    patient_db: Database, locked: Any
) -> None:
    locked("kpi_rollups")
    locked("alert_episodes")
    registry = CollectorRegistry()
    registry.register(DomainCollector(patient_db, cache_seconds=0, read_timeout=timedelta(seconds=1)))
    registry.register(AlertsCollector(patient_db, cache_seconds=0, read_timeout=timedelta(seconds=1)))
    thread, out = scrape_in_thread(registry)
    thread.join(120)  # it takes about a second; without its own timeout it would wait the database's 10 minutes
    assert not thread.is_alive(), "the scrape waited on the lock"
    assert samples_of(out[0]) == [("keel_kpi_up", 0.0)]


def test_a_scrape_never_queues_behind_another_scrapes_read(
    patient_db: Database, locked: Any, raw: psycopg.Connection[Any]
) -> None:
    locked("kpi_rollups")
    registry = CollectorRegistry()
    registry.register(DomainCollector(patient_db, cache_seconds=0, read_timeout=timedelta(minutes=10)))
    first, first_out = scrape_in_thread(registry)
    deadline = time.monotonic() + 60
    while not raw.execute(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        " AND query LIKE '%%kpi_rollups%%' AND pid <> pg_backend_pid()"
    ).fetchone():
        assert time.monotonic() < deadline, "the first scrape's read never reached the lock"
        time.sleep(0.05)
    # The first scrape is reading (held up by the lock): a second one answers at once, without a figure.
    second, second_out = scrape_in_thread(registry)
    second.join(60)
    assert not second.is_alive(), "the second scrape queued behind the first"
    assert samples_of(second_out[0]) == [("keel_kpi_up", 0.0)]
    assert first.is_alive()  # still held up: the lock is ours until we let go
    locked.release()
    first.join(60)
    assert ("keel_kpi_up", 1.0) in samples_of(first_out[0])

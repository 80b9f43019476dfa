"""Keel behind a real PgBouncer in transaction mode (Debian's pgbouncer, started by the test session): consecutive
transactions of one client run on whichever server connection is free, so nothing may rely on a session."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from agents.client import Client
from models.db import Database, check_route
from models.embedded import migration_url_for
from models.settings import BadConfiguration, Settings
from models.urls import libpq_url
from tasks.leadership import Leadership
from tests.support.api import script
from tests.support.audit import TEST_KEYS
from tests.support.pgbouncer import Bouncer, running_pgbouncer

pytestmark = pytest.mark.integration


def _interleaved(connections: list[psycopg.Connection[Any]], rounds: int) -> None:
    """Every connection runs the same parameterized queries in turn, one holding a transaction open meanwhile: the
    pooler must hand the others other server connections."""
    for n in range(rounds):
        holder = connections[n % len(connections)]
        with holder.transaction():
            holder.execute("SELECT count(*) FROM agents WHERE name = %s", (f"x{n}",)).fetchone()
            for conn in connections:
                if conn is not holder:
                    conn.execute("SELECT count(*) FROM agents WHERE name = %s", (f"y{n}",)).fetchone()


def test_psycopgs_automatic_prepared_statements_break_behind_pgbouncer(pgbouncer: Bouncer, db_url: str) -> None:
    """What the pooler setting is for: psycopg prepares a query from its fifth run on, on the server connection it
    happens to have; behind a transaction pooler the next run lands on another one."""
    url = libpq_url(pgbouncer.url(db_url))
    connections = [psycopg.connect(url, autocommit=True) for _ in range(3)]
    try:
        with pytest.raises(psycopg.Error, match=r'prepared statement "_pg3_\d+"'):
            _interleaved(connections, 20)
    finally:
        for conn in connections:
            conn.close()


def test_startup_options_are_refused_by_pgbouncer(pgbouncer: Bouncer, db_url: str) -> None:
    """Without KEEL_DATABASE_POOLER=transaction Keel sends the statement timeout in the startup packet, which
    PgBouncer refuses: a clear error at the first connection, not a silently lost timeout."""
    db = Database(pgbouncer.url(db_url), pool_size=1)
    try:
        with pytest.raises(Exception, match="unsupported startup parameter: options"), db.connection():
            pass
    finally:
        db.dispose()


def _behind(pgbouncer: Bouncer, db_url: str) -> Database:
    return Database(pgbouncer.url(db_url), pool_size=4, audit_keys=TEST_KEYS, pooler="transaction", direct_url=db_url)


def test_the_hot_path_from_many_processes_works_behind_pgbouncer(pgbouncer: Bouncer, db_url: str) -> None:
    """Two pools (two processes' worth) and four threads of producers, far more than five runs of every statement:
    with prepared statements off, every command commits and the journal is whole."""
    dbs = [_behind(pgbouncer, db_url), _behind(pgbouncer, db_url)]
    errors: list[BaseException] = []
    try:
        clients = [Client(db) for db in dbs]
        agents = [clients[0].create_agent(f"a{n}") for n in range(8)]

        def produce(client: Client, mine: list[Any]) -> None:
            try:
                for round_ in range(6):
                    for agent in mine:
                        client.submit(agent.id, f"r{round_}-{agent.id}", script({"content": "hi"}), actor="producer")
                        client.cancel(agent.id, actor="producer", reason="next")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=produce, args=(clients[n % 2], agents[n::4])) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        with dbs[0].connection() as conn:
            revisions = conn.execute("SELECT sum(revision) FROM agents").fetchone()
            conn.rollback()
        assert revisions == (8 * 12,), "every submit and cancel committed once"
    finally:
        for db in dbs:
            db.dispose()


def test_a_read_with_a_statement_timeout_works_behind_pgbouncer(pgbouncer: Bouncer, db_url: str) -> None:
    """``Database.reading`` sets its timeout for its own transaction only (``set_config(…, true)``): behind a
    transaction pooler it neither leaks to another client's transactions nor is lost."""
    db = _behind(pgbouncer, db_url)
    try:
        from datetime import timedelta

        with db.reading(statement_timeout=timedelta(milliseconds=200)) as conn:
            with pytest.raises(psycopg.errors.QueryCanceled):
                conn.execute("SELECT pg_sleep(2)")
        for _ in range(5):  # whichever server connection the next transaction gets, it has no such timeout
            with db.connection() as conn:
                assert conn.execute("SELECT current_setting('statement_timeout')").fetchone() != ("200ms",)
                conn.rollback()
    finally:
        db.dispose()


# --- the beat leader's lease ------------------------------------------------------------------------------------


def _lease_settings(lease: float = 0.9, *, pooled: bool = True) -> Settings:
    """A beat's settings; ``pooled``: behind a transaction pooler (no startup options on the lease's connection)."""
    pooler: dict[str, Any] = (
        {"database_pooler": "transaction", "database_direct_url": "postgresql://keel@postgres/keel"} if pooled else {}
    )
    return Settings(beat_lease_seconds=lease, dispatch_interval_seconds=0.2, **pooler)


@pytest.mark.parametrize("route", ["direct", "pgbouncer"])
def test_two_beats_racing_for_the_lease_get_one_leader(route: str, pgbouncer: Bouncer, db_url: str) -> None:
    url = libpq_url(db_url if route == "direct" else pgbouncer.url(db_url))
    beats = [Leadership(url, _lease_settings(5.0, pooled=route != "direct"), holder=f"beat-{n}") for n in range(6)]
    try:
        start = threading.Barrier(len(beats))
        results: dict[str, bool] = {}

        def race(beat: Leadership) -> None:
            start.wait()
            results[beat.holder] = beat.held()

        threads = [threading.Thread(target=race, args=(beat,)) for beat in beats]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(results.values()) == 1, results
        for _ in range(3):  # and it stays so, tick after tick
            assert [beat.held() for beat in beats].count(True) == 1
    finally:
        for beat in beats:
            beat.release()


@pytest.mark.parametrize("route", ["direct", "pgbouncer"])
def test_a_leader_paused_past_its_lease_steps_down_and_the_new_term_is_higher(
    route: str, pgbouncer: Bouncer, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = libpq_url(db_url if route == "direct" else pgbouncer.url(db_url))
    a = Leadership(url, _lease_settings(pooled=route != "direct"), holder="beat-a")
    b = Leadership(url, _lease_settings(pooled=route != "direct"), holder="beat-b")
    try:
        assert a.held() and a.term is not None
        first = a.term
        assert not b.held(), "the lease is a's until it runs out"
        time.sleep(1.2)  # a is paused (SIGSTOP, a long pause) past its lease
        assert b.held(), "b takes the lease over once it ran out"
        assert b.term == first + 1 and b.terms == 1
        with caplog.at_level(logging.WARNING, logger="keel.dispatcher"):
            assert not a.held(), "a resumed leader must step down: its term is over"
        said = f"this beat is no longer the leader (term {first}): its lease was taken over (term {first + 1}, beat-b)"
        assert said in caplog.text
        assert a.term is None and not a.valid()
        a.release()  # a's release must not end b's term
        assert b.held() and b.term == first + 1
        b.release()  # a clean stop hands over at once
        assert a.held() and a.term == first + 2 and a.terms == 2, "a new term for a, counted"
    finally:
        a.release()
        b.release()


@pytest.mark.parametrize("route", ["direct", "pgbouncer"])
def test_a_lease_connection_that_died_between_ticks_costs_no_tick(
    route: str, pgbouncer: Bouncer, db_url: str, pg_server_url: str
) -> None:
    """A PostgreSQL restart (or a PgBouncer one) closes the connection the lease keeps between ticks: the next tick
    asks again on a new one instead of failing and backing off as if the database were down."""
    url = libpq_url(db_url if route == "direct" else pgbouncer.url(db_url))
    a = Leadership(url, _lease_settings(5.0, pooled=route != "direct"), holder="beat-a")
    try:
        assert a.held()
        term = a.term
        with psycopg.connect(libpq_url(db_url), autocommit=True) as admin:  # every server connection of the lease's
            killed = admin.execute(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()) t"
            ).fetchone()
        assert killed is not None and killed[0] >= 1
        time.sleep(0.2)
        assert a.held() and a.term == term, "renewed on a new connection, same term"
    finally:
        a.release()


def test_a_renewal_blocked_on_the_lease_row_gives_up_within_the_lease(db_url: str) -> None:
    """Directly connected, the lease's connection carries a statement timeout of half the lease: a renewal stuck
    behind a lock on the lease row (a stuck session, an operator's open transaction) fails instead of hanging."""
    a = Leadership(libpq_url(db_url), _lease_settings(2.0, pooled=False), holder="beat-a")
    try:
        assert a.held()
        with psycopg.connect(libpq_url(db_url)) as blocker:
            blocker.execute("SELECT * FROM beat_leadership FOR UPDATE")
            began = time.monotonic()
            with pytest.raises(psycopg.errors.QueryCanceled):
                a.held()
            assert time.monotonic() - began < 2.0, "one timeout of half the lease, not asked again"
            blocker.rollback()
        assert a.held() or a.term is None  # it may have run out meanwhile; either way it asks again and answers
    finally:
        a.release()


def test_a_leader_renewing_in_time_keeps_its_term(pgbouncer: Bouncer, db_url: str) -> None:
    a = Leadership(libpq_url(pgbouncer.url(db_url)), _lease_settings(), holder="beat-a")
    b = Leadership(libpq_url(pgbouncer.url(db_url)), _lease_settings(), holder="beat-b")
    try:
        assert a.held()
        term = a.term
        for _ in range(8):  # 1.6 s of ticks: longer than the lease, renewed every 0.2 s
            time.sleep(0.2)
            assert a.held() and a.term == term
            assert not b.held()
        assert a.terms == 1
    finally:
        a.release()
        b.release()


# --- the route checked at start (models/db.py check_route) -------------------------------------------------------


def test_a_statement_timeout_dropped_by_a_pooler_is_refused_at_start(pg_server_url: str, db_url: str) -> None:
    """A PgBouncer told to ignore ``options`` accepts the connection and drops the timeout Keel sent in it, without a
    word: the start-up check asks the server and refuses, naming the setting."""
    with running_pgbouncer(pg_server_url, ignore_startup_parameters="options") as lenient:
        db = Database(lenient.url(db_url), pool_size=1, statement_timeout_ms=30_000)
        try:
            with db.connection() as conn:
                assert conn.execute("SHOW statement_timeout").fetchone() == ("0",), "the timeout was dropped"
                conn.rollback()
            with pytest.raises(BadConfiguration, match="KEEL_STATEMENT_TIMEOUT_MS: sent at connect as 30000 ms"):
                check_route(db, production=False)
        finally:
            db.dispose()


def test_behind_pgbouncer_a_server_without_a_statement_timeout_is_refused_in_production(
    pgbouncer: Bouncer, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    db = _behind(pgbouncer, db_url)
    try:
        with pytest.raises(
            BadConfiguration, match="KEEL_STATEMENT_TIMEOUT_MS: behind KEEL_DATABASE_POOLER=transaction"
        ):
            check_route(db, production=True)
        with caplog.at_level(logging.WARNING, logger="keel.db"):
            check_route(db, production=False)
        assert "ALTER ROLE postgres SET statement_timeout = '30000ms'" in caplog.text
    finally:
        db.dispose()


def test_behind_pgbouncer_the_servers_statement_timeout_is_accepted(
    pgbouncer: Bouncer, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The database's own setting here (the role's is cluster-wide, and the test server is shared): PgBouncer's new
    server connections get it, and statements through the pooler are cancelled after it."""
    name = make_url(db_url).database
    with psycopg.connect(libpq_url(db_url), autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {name} SET statement_timeout = '30s'")
    db = _behind(pgbouncer, db_url)
    try:
        with caplog.at_level(logging.WARNING, logger="keel.db"):
            check_route(db, production=True)
        assert caplog.text == ""
    finally:
        db.dispose()


def test_a_pooler_keel_was_not_told_of_is_refused_at_start_even_when_the_timeout_matches(
    pg_server_url: str, db_url: str
) -> None:
    """PgBouncer passing the right timeout on (the role's own, as docs/how-to/deploy.md advises, equal to Keel's):
    without ``KEEL_DATABASE_POOLER=transaction`` Keel would prepare statements that other clients' server connections
    then run. The backend pid the pooler hands out gives it away."""
    name = make_url(db_url).database
    with psycopg.connect(libpq_url(db_url), autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {name} SET statement_timeout = '30s'")
    with running_pgbouncer(pg_server_url, ignore_startup_parameters="options") as lenient:
        db = Database(lenient.url(db_url), pool_size=1, statement_timeout_ms=30_000)
        try:
            with db.connection() as conn:
                assert conn.execute("SHOW statement_timeout").fetchone() == ("30s",), "the role's timeout arrives"
                conn.rollback()
            with pytest.raises(BadConfiguration, match="KEEL_DATABASE_POOLER: KEEL_DATABASE_URL reaches a connection"):
                check_route(db, production=False)
        finally:
            db.dispose()


def test_behind_a_pooler_migrations_connect_directly(db_url: str) -> None:
    """A migration's SET ROLE (and alembic's prepared statements) are session state: through a transaction pooler
    they would pass on to other clients. Without KEEL_MIGRATION_DATABASE_URL they take the direct URL."""
    pooled = "postgresql://keel_app@pgbouncer:6432/keel"
    direct = "postgresql://keel_app@postgres:5432/keel"
    settings = Settings(database_url=pooled, database_pooler="transaction", database_direct_url=direct)
    assert make_url(migration_url_for(settings)) == make_url(Settings(database_url=direct).database_url)
    assert migration_url_for(Settings(database_url=pooled)) == Settings(database_url=pooled).database_url
    own = "postgresql://owner@postgres:5432/keel"
    chosen = Settings(
        database_url=pooled, database_pooler="transaction", database_direct_url=direct, migration_database_url=own
    )
    assert migration_url_for(chosen) == chosen.migration_database_url


def test_a_direct_url_that_reaches_the_pooler_is_refused_at_start(pgbouncer: Bouncer, db_url: str) -> None:
    """LISTEN and the shipper's session lock through a transaction pooler would silently not work: the backend pid
    PgBouncer hands out is not the server process's."""
    through = pgbouncer.url(db_url)
    db = Database(through, pool_size=1, pooler="transaction", direct_url=through)
    try:
        with pytest.raises(BadConfiguration, match="KEEL_DATABASE_DIRECT_URL: it reaches a connection pooler"):
            check_route(db, production=False)
    finally:
        db.dispose()


def test_a_direct_url_that_reaches_postgresql_is_accepted(pgbouncer: Bouncer, db_url: str) -> None:
    db = Database(db_url, pool_size=1)
    try:
        check_route(db, production=True)  # and without a pooler: the timeout sent at connect holds
    finally:
        db.dispose()
    db = _behind(pgbouncer, db_url)
    try:
        check_route(db, production=False)
    finally:
        db.dispose()

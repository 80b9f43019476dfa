"""Months of journal on a real partitioned table, archived for real: the partition detached and dropped.

The database's clock decides which month an event falls in and when a month is over (invariant 10), so this test
runs a private PostgreSQL whose clock it moves (tests/support/timepg.py): January's events land in the legacy
partition (everything before the month after the migration), February's in ``journal_2027_02``, March's in
``journal_2027_03``. In late March ``keel audit archive`` refuses while anything is unshipped, then archives January
and February — the oldest first, one per run — and refuses March (not over). Every chain still verifies, against
the database and against the store, new events follow on, and removing an archive record is caught."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agents.audit.compare import verify_against
from agents.audit.ship import ship
from agents.audit.store import FileStore
from agents.client import Client
from agents.core import journal
from agents.core.commands import Command
from agents.core.journal import new_event
from agents.core.phases import Event
from agents.core.transition import transition
from models import migrations
from models.db import Database
from models.sql import advance_chain_txn, lock_agent_txn
from tests.support.audit import TEST_ENV, TEST_KEYS, clean_env
from tests.support.cli import run_keel
from tests.support.timepg import TimeTravelServer, time_travel_postgres

KEEL = str(Path(sys.executable).parent / "keel")
ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}
JANUARY = datetime(2027, 1, 12, 9, tzinfo=UTC)
FEBRUARY = datetime(2027, 2, 10, 9, tzinfo=UTC)
LATE_MARCH = datetime(2027, 3, 20, 9, tzinfo=UTC)


@pytest.fixture
def server() -> Iterator[TimeTravelServer]:
    with time_travel_postgres(JANUARY) as running:
        migrations.upgrade(running.url())
        yield running


def _months(server: TimeTravelServer) -> None:
    """What the leading beat does daily: the months ahead get their partitions."""
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute("SELECT audit.keel_ensure_partitions(3)")


def _rows_by_partition(server: TimeTravelServer) -> dict[str, int]:
    with psycopg.connect(server.url(), autocommit=True) as conn:
        return {
            str(r[0]): int(r[1])
            for r in conn.execute("SELECT tableoid::regclass::text, count(*) FROM audit.journal GROUP BY 1")
        }


def _archive(server: TimeTravelServer, store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env.update(TEST_ENV)
    env.update({"KEEL_DATABASE_URL": server.url(), "KEEL_MIGRATION_DATABASE_URL": server.url()})
    return run_keel(["audit", "archive", "--against", store.as_uri(), *args], env)


def _step(client: Client, agent_id: UUID, event: Event) -> None:
    transition(client.db, Command(agent_id, event, "worker", details={"model": "m"} if event is Event.PLAN else {}))


def test_months_are_archived_oldest_first_once_shipped_and_every_chain_still_verifies(
    server: TimeTravelServer, tmp_path: Path
) -> None:
    db = Database(server.url(), audit_keys=TEST_KEYS)
    client = Client(db)
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    store = FileStore(store_dir)
    destination = store_dir.as_uri()
    try:
        # January: two agents, one of which says everything it will ever say.
        quiet = client.create_agent(f"quiet-{uuid.uuid4().hex[:6]}")
        client.submit(quiet.id, f"r-{quiet.id}", ASK)
        busy = client.create_agent(f"busy-{uuid.uuid4().hex[:6]}")
        client.submit(busy.id, f"r-{busy.id}", ASK)
        # February: the busy one goes on, a third is born.
        server.set_clock(FEBRUARY)
        _months(server)
        _step(client, busy.id, Event.PLAN)
        late = client.create_agent(f"late-{uuid.uuid4().hex[:6]}")
        client.submit(late.id, f"r-{late.id}", ASK)
        # Late March: more of both.
        server.set_clock(LATE_MARCH)
        _months(server)
        _step(client, busy.id, Event.FINISH)
        _step(client, late.id, Event.PLAN)
        months = _rows_by_partition(server)
        assert set(months) == {"audit.journal_legacy", "audit.journal_2027_02", "audit.journal_2027_03"}, months

        refused = _archive(server, store_dir)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "journal_legacy" in refused.stderr and "not in any shipped segment" in refused.stderr, refused.stderr
        assert _rows_by_partition(server) == months  # a refusal changes nothing

        ship(db, store, TEST_KEYS, destination=destination, segment_events=3, segment_age=timedelta(0), flush=True)
        first = _archive(server, store_dir, "--json")
        assert first.returncode == 0, first.stdout + first.stderr
        assert json.loads(first.stdout)["partition"] == "journal_legacy"
        second = _archive(server, store_dir)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "archived journal_2027_02" in second.stdout
        third = _archive(server, store_dir)
        assert third.returncode == 1 and "journal_2027_03" in third.stderr, third.stdout + third.stderr

        left = _rows_by_partition(server)
        assert left == {"audit.journal_2027_03": months["audit.journal_2027_03"]}
        with psycopg.connect(server.url(), autocommit=True) as conn:
            gone = conn.execute(
                "SELECT count(*) FROM pg_class WHERE relname IN ('journal_legacy', 'journal_2027_02')"
            ).fetchone()
            records: list[Any] = conn.execute(
                "SELECT partition, events FROM audit.archived_partitions ORDER BY archived_at"
            ).fetchall()
        assert gone == (0,)  # detached and dropped, not merely emptied
        assert [(r[0], r[1]) for r in records] == [
            ("journal_legacy", months["audit.journal_legacy"]),
            ("journal_2027_02", months["audit.journal_2027_02"]),
        ]

        report = journal.verify(db)
        assert report.ok, report
        assert report.agents == 3
        # The chains go on past their archived parts, and the shipped copy still agrees.
        _step(client, late.id, Event.FINISH)
        assert journal.verify(db).ok
        ship(db, store, TEST_KEYS, destination=destination, segment_events=3, segment_age=timedelta(0), flush=True)
        against = verify_against(db, store, TEST_KEYS, destination=destination)
        assert against.ok, against.divergences

        # Removing an archive record (as a superuser, triggers off) leaves chains starting past genesis: caught.
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute("SET session_replication_role = replica")
            conn.execute("DELETE FROM audit.archived_partitions WHERE partition = 'journal_2027_02'")
        broken = journal.verify(db)
        assert not broken.ok
        assert any("no archive covers them" in b.reason for b in broken.breaks), broken
    finally:
        db.dispose()


def test_ids_interleaved_at_a_months_end_are_archived_and_verified(server: TimeTravelServer, tmp_path: Path) -> None:
    """A transaction that read its time on the last second of February inserts after one of March committed: its
    event is February's with a later id than a March event. Both months archive, and everything still verifies."""
    db = Database(server.url(), audit_keys=TEST_KEYS)
    client = Client(db)
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    store = FileStore(store_dir)
    destination = store_dir.as_uri()
    try:
        server.set_clock(datetime(2027, 2, 28, 23, 59, 50, tzinfo=UTC))
        _months(server)
        slow_agent = client.create_agent(f"slow-{uuid.uuid4().hex[:6]}")
        quick_agent = client.create_agent(f"quick-{uuid.uuid4().hex[:6]}")
        with psycopg.connect(server.url()) as slow:
            with slow.cursor() as cur:
                locked = lock_agent_txn(cur, slow_agent.id)  # February's last seconds: the event's time
                assert locked is not None and locked.at.month == 2
                server.set_clock(datetime(2027, 3, 1, 0, 0, 5, tzinfo=UTC))
                client.submit(quick_agent.id, f"r-{quick_agent.id}", ASK)  # March, committed first, lower id
                row = locked.row
                event = new_event(
                    row,
                    keys=TEST_KEYS,
                    kind="operator",
                    event="note",
                    actor="slow",
                    request_id=row.request_id,
                    from_phase=row.phase,
                    to_phase=row.phase,
                    revision=row.revision,
                    decision="allowed",
                    details={},
                    at=locked.at,
                )
                assert advance_chain_txn(cur, event)
        with psycopg.connect(server.url(), autocommit=True) as conn:
            placed = {
                str(r[0]): (int(r[1]), int(r[2]))
                for r in conn.execute(
                    "SELECT tableoid::regclass::text, min(id), max(id) FROM audit.journal"
                    " WHERE tableoid::regclass::text <> 'audit.journal_legacy' GROUP BY 1"
                )
            }
        assert placed["audit.journal_2027_02"][1] > placed["audit.journal_2027_03"][0], placed  # interleaved

        server.set_clock(datetime(2027, 4, 20, tzinfo=UTC))
        _months(server)
        ship(db, store, TEST_KEYS, destination=destination, segment_events=2, segment_age=timedelta(0), flush=True)
        archived = []
        for _ in range(3):  # the legacy partition (empty), February, March
            done = _archive(server, store_dir, "--json")
            assert done.returncode == 0, done.stdout + done.stderr
            archived.append(json.loads(done.stdout)["partition"])
        assert archived == ["journal_legacy", "journal_2027_02", "journal_2027_03"]
        report = journal.verify(db)
        assert report.ok, report
        against = verify_against(db, store, TEST_KEYS, destination=destination)
        assert against.ok, against.divergences
    finally:
        db.dispose()

"""Schedules: fires named and cron evaluated in UTC whatever the session's zone; due on the database's clock."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from uuid import UUID

import psycopg
import pytest

from agents.client import Client
from agents.core import transition as core
from agents.core.commands import Command
from agents.core.phases import Event
from agents.jobs import schedules
from models.db import Database
from tests.support.audit import TEST_KEYS

pytestmark = pytest.mark.integration


@pytest.fixture
def berlin_db(db_url: str, raw: psycopg.Connection[tuple[object, ...]]) -> Iterator[Database]:
    """The test's database with Europe/Berlin as every session's TimeZone (DST: 2026-10-25 03:00 CEST → 02:00 CET)."""
    name = raw.execute("SELECT current_database()").fetchone()
    assert name is not None
    raw.execute(f"ALTER DATABASE \"{name[0]}\" SET timezone = 'Europe/Berlin'")
    database = Database(db_url, pool_size=4, audit_keys=TEST_KEYS)
    with database.connection() as conn:
        assert conn.execute("SHOW timezone").fetchone() == ("Europe/Berlin",)
        conn.rollback()
    yield database
    database.dispose()


def _rest(db: Database, agent_id: UUID) -> None:
    """Stop the fire's request so the next fire finds the agent free."""
    core.transition(db, Command(agent_id, Event.CANCEL, "test"))


def test_hourly_fires_across_the_fall_back_get_distinct_utc_names(berlin_db: Database) -> None:
    db = berlin_db
    client = Client(db)
    agent = client.create_agent("hourly")
    # 00:30 CEST on the fall-back day; 02:30 local then happens twice (00:30Z in CEST, 01:30Z in CET).
    t0 = datetime(2026, 10, 24, 22, 30, tzinfo=UTC)
    schedules.ensure_schedule(db, "hourly", agent.id, every=timedelta(hours=1), operation="count", now=t0)
    fired = []
    for hour in range(1, 5):  # each pass a little late: fires stay on the schedule's grid
        fired += schedules.fire_due(db, t0 + timedelta(hours=hour, seconds=hour))
        _rest(db, agent.id)
    assert fired == [
        "hourly.20261024T233000Z",
        "hourly.20261025T003000Z",
        "hourly.20261025T013000Z",  # the same wall-clock 02:30 in Berlin as the one before: still its own fire
        "hourly.20261025T023000Z",
    ]
    kinds = [e.kind for e in client.journal(agent_id=agent.id)]
    assert "suppressed" not in kinds
    with psycopg.connect(db.libpq_url) as conn:
        row = conn.execute("SELECT next_fire_at, last_fire_at FROM schedules").fetchone()
    assert row is not None
    assert row == (datetime(2026, 10, 25, 3, 30, tzinfo=UTC), datetime(2026, 10, 25, 2, 30, tzinfo=UTC))


def test_a_cron_schedule_fires_at_the_utc_times_it_names(berlin_db: Database) -> None:
    db = berlin_db
    agent = Client(db).create_agent("nightly")
    t0 = datetime(2026, 10, 24, 12, 0, tzinfo=UTC)
    schedule, _ = schedules.ensure_schedule(db, "nightly", agent.id, cron="30 2 * * *", operation="count", now=t0)
    assert schedule.next_fire_at == datetime(2026, 10, 25, 2, 30, tzinfo=UTC)
    assert schedules.fire_due(db, datetime(2026, 10, 25, 2, 29, 59, tzinfo=UTC)) == []
    assert schedules.fire_due(db, datetime(2026, 10, 25, 2, 30, tzinfo=UTC)) == ["nightly.20261025T023000Z"]
    _rest(db, agent.id)
    assert schedules.fire_due(db, datetime(2026, 10, 26, 2, 30, 5, tzinfo=UTC)) == ["nightly.20261026T023000Z"]


@pytest.mark.parametrize("host_offset", [timedelta(minutes=5), timedelta(minutes=-5)])
def test_schedules_are_due_on_the_database_clock_not_the_hosts(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch, host_offset: timedelta
) -> None:
    agent = client.create_agent("clocked")
    real_now = core.now
    monkeypatch.setattr(core, "now", lambda: real_now() + host_offset)
    schedule, _ = schedules.ensure_schedule(db, "soon", agent.id, every=timedelta(seconds=2), operation="count")
    with psycopg.connect(db.libpq_url) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    registered_at: datetime = row[0]
    # The first fire is two seconds after the database's now, not after the host's.
    assert timedelta(seconds=1) < schedule.next_fire_at - registered_at <= timedelta(seconds=2)
    assert schedules.fire_due(db) == [], "not early, however fast the host's clock"
    time.sleep(max(0.0, (schedule.next_fire_at - registered_at).total_seconds()) + 0.2)
    assert schedules.fire_due(db) == [schedules.fire_request_id("soon", schedule.next_fire_at)], "nor late"
    with psycopg.connect(db.libpq_url) as conn:
        stored = conn.execute("SELECT updated_at, next_fire_at, clock_timestamp() FROM schedules").fetchone()
    assert stored is not None
    updated_at, next_fire_at, database_now = stored
    assert abs(database_now - updated_at) < timedelta(seconds=2), "stored times are the database's"
    assert next_fire_at > updated_at and (next_fire_at - schedule.next_fire_at) % timedelta(seconds=2) == timedelta(0)


def test_two_beats_in_different_zones_name_one_fire_once(
    db_url: str, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = client.create_agent("zoned")
    fire_at = datetime(2026, 10, 25, 1, 30, tzinfo=UTC)
    schedules.ensure_schedule(
        client.db, "zoned", agent.id, every=timedelta(hours=1), operation="count", now=fire_at - timedelta(hours=1)
    )
    beats = []
    for zone in ("America/New_York", "Asia/Kolkata"):  # libpq sets each session's TimeZone from PGTZ
        monkeypatch.setenv("PGTZ", zone)
        beat = Database(db_url, pool_size=1, audit_keys=TEST_KEYS)
        with beat.connection() as conn:
            assert conn.execute("SHOW timezone").fetchone() == (zone,)
            conn.rollback()
        beats.append(beat)
    try:
        assert schedules.fire_due(beats[0], fire_at) == ["zoned.20261025T013000Z"]
        # The second beat attempts the same fire (the first one's bookkeeping was lost): the same name, suppressed.
        with psycopg.connect(client.db.libpq_url, autocommit=True) as conn:
            conn.execute("UPDATE schedules SET next_fire_at = %s", (fire_at,))
        assert schedules.fire_due(beats[1], fire_at) == []
        last = client.journal(agent_id=agent.id)[-1]
        assert (last.kind, last.request_id) == ("suppressed", "zoned.20261025T013000Z")
    finally:
        for beat in beats:
            beat.dispose()


def test_a_fire_the_database_could_not_take_stays_due_and_fires_on_the_next_pass(
    client: Client, db_url: str, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The agent's row held by someone else past the statement timeout (or the database away): the fire is not
    recorded as failed and moved on — it stays due, and the next pass makes it under the same request id."""
    agent = client.create_agent("busy")
    impatient = Database(db_url, pool_size=2, audit_keys=TEST_KEYS, statement_timeout_ms=1_000)
    try:
        schedules.ensure_schedule(impatient, "hourly", agent.id, every=timedelta(hours=1), operation="count")
        raw.execute("UPDATE schedules SET next_fire_at = now() - interval '1 minute'")
        due = raw.execute("SELECT next_fire_at, last_outcome FROM schedules").fetchone()
        with psycopg.connect(impatient.libpq_url) as holder:
            holder.execute("SELECT 1 FROM agents WHERE id = %s FOR UPDATE", (agent.id,))
            assert schedules.fire_due(impatient) == []
            holder.rollback()
        assert raw.execute("SELECT next_fire_at, last_outcome FROM schedules").fetchone() == due, "still due"
        assert client.get_state(agent.id).phase == "idle"
        assert due is not None
        fired = schedules.fire_due(impatient)
        assert fired == [schedules.fire_request_id("hourly", due[0])]  # type: ignore[arg-type]
        assert client.get_state(agent.id).request_id == fired[0]
    finally:
        impatient.dispose()


@pytest.mark.timeout(60)
def test_a_batch_whose_fires_all_stay_due_does_not_hold_the_pass_and_the_ones_after_it_fire(
    client: Client, db_url: str, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Batches of one: the first schedule's agent is held past the statement timeout, so its fire stays due. The pass
    goes on after it (it took that same schedule again and again, for ever) and fires the next one."""
    busy, free = client.create_agent("busy"), client.create_agent("free")
    impatient = Database(db_url, pool_size=2, audit_keys=TEST_KEYS, statement_timeout_ms=500)
    try:
        schedules.ensure_schedule(impatient, "a-busy", busy.id, every=timedelta(hours=1), operation="count")
        schedules.ensure_schedule(impatient, "b-free", free.id, every=timedelta(hours=1), operation="count")
        raw.execute("UPDATE schedules SET next_fire_at = now() - interval '1 minute'")
        (due,) = raw.execute("SELECT next_fire_at FROM schedules WHERE name = 'b-free'").fetchone()  # type: ignore[misc]
        with psycopg.connect(impatient.libpq_url) as holder:
            holder.execute("SELECT 1 FROM agents WHERE id = %s FOR UPDATE", (busy.id,))
            fired = schedules.fire_due(impatient, batch=1)
            holder.rollback()
        assert fired == [schedules.fire_request_id("b-free", due)]  # type: ignore[arg-type]
        assert client.get_state(busy.id).phase == "idle", "the held agent's fire stays due for the next pass"
        assert len(schedules.fire_due(impatient, batch=1)) == 1, "and the next pass makes it"
    finally:
        impatient.dispose()


def test_a_schedule_that_breaks_is_recorded_failed_and_the_rest_of_its_batch_fires(
    client: Client, db: Database, raw: psycopg.Connection[tuple[object, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception nobody foresaw (not Keel's, not the database's) in one schedule's fire used to roll its whole
    batch back on every pass, with it first in line: the others never fired. Now it is recorded failed and moved
    on, and the others of the batch fire."""
    poison, fine = client.create_agent("poison"), client.create_agent("fine")
    schedules.ensure_schedule(db, "a-poison", poison.id, every=timedelta(hours=1), operation="count")
    schedules.ensure_schedule(db, "b-fine", fine.id, every=timedelta(hours=1), operation="count")
    raw.execute("UPDATE schedules SET next_fire_at = now() - interval '1 minute'")
    real = schedules._submit

    def submit(db: Database, schedule: schedules.Schedule, request_id: str, actor: str) -> str:
        if schedule.name == "a-poison":
            raise RuntimeError("a bug in this schedule's fire")
        return real(db, schedule, request_id, actor)

    monkeypatch.setattr(schedules, "_submit", submit)
    fired = schedules.fire_due(db, batch=10)
    assert len(fired) == 1 and fired[0].startswith("b-fine.")
    row = raw.execute("SELECT last_outcome, next_fire_at > now() FROM schedules WHERE name = 'a-poison'").fetchone()
    assert row is not None
    assert "failed (internal error: RuntimeError: a bug in this schedule's fire)" in str(row[0]), row
    assert row[1] is True, "moved on to its next fire"
    assert schedules.fire_due(db, batch=10) == [], "nothing left due: neither is tried again this hour"

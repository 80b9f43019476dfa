"""The shipper never ships past an id a prepared transaction (two-phase commit) took and has not committed.

A prepared transaction has left its session: its locks in ``pg_locks`` carry no pid. The shipper's settle wait
must keep waiting for it (``pid IS DISTINCT FROM pg_backend_pid()``: ``<>`` would drop the NULL and ship past the
hole, losing that event from the store for good). The shared server runs with ``max_prepared_transactions = 0``,
so this test has a private one that allows them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from agents.audit.ship import ship
from agents.audit.store import FileStore
from agents.client import Client
from agents.core.journal import new_event
from models import migrations
from models.db import Database
from models.sql import _EVENT_COLUMNS, lock_agent_txn
from tests.support.audit import TEST_KEYS
from tests.support.timepg import TimeTravelServer, time_travel_postgres


@pytest.fixture(scope="module")
def server() -> Iterator[TimeTravelServer]:
    with time_travel_postgres(datetime.now(UTC), "max_prepared_transactions=4") as running:
        migrations.upgrade(running.url())
        yield running


def _shipped_ids(store: FileStore) -> list[int]:
    ids: list[int] = []
    for name in sorted(n for n in store.names() if n.endswith(".jsonl")):
        ids += [json.loads(line)["id"] for line in store.get(name).decode().splitlines()]
    return ids


def test_an_id_taken_by_a_prepared_transaction_is_never_skipped(server: TimeTravelServer, tmp_path: Path) -> None:
    db = Database(server.url(), audit_keys=TEST_KEYS)
    client = Client(db)
    store = FileStore(tmp_path)
    gid = f"keel-test-{uuid.uuid4().hex[:8]}"
    try:
        first = client.create_agent(f"prepared-{uuid.uuid4().hex[:6]}")
        with psycopg.connect(server.url()) as slow:  # takes a lower journal id, prepares, does not commit
            with slow.cursor() as cur:
                locked = lock_agent_txn(cur, first.id)
                assert locked is not None
                row = locked.row
                event = new_event(
                    row,
                    keys=TEST_KEYS,
                    kind="operator",
                    event="note",
                    actor="two-phase",
                    request_id=row.request_id,
                    from_phase=row.phase,
                    to_phase=row.phase,
                    revision=row.revision,
                    decision="allowed",
                    details={},
                    at=locked.at,
                )
                # Keel's own appends NOTIFY (which PREPARE refuses); another program's two-phase commit need not.
                cur.execute(
                    f"INSERT INTO audit.journal ({_EVENT_COLUMNS}) VALUES ({', '.join(['%s'] * 15)})", event.params()
                )
                cur.execute(
                    "UPDATE agents SET journal_seq = %s, journal_head = %s WHERE id = %s",
                    (event.seq, event.hash, row.id),
                )
            slow.execute(f"PREPARE TRANSACTION '{gid}'")
        client.create_agent(f"later-{uuid.uuid4().hex[:6]}")  # a higher id, committed first
        waiting = ship(
            db,
            store,
            TEST_KEYS,
            destination="file:///x",
            segment_events=1000,
            segment_age=timedelta(0),
            flush=True,
            settle_timeout=timedelta(milliseconds=300),
        )
        assert waiting.unsettled and waiting.segments == (), "shipped past an id a prepared transaction holds"
        with psycopg.connect(server.url(), autocommit=True) as admin:
            admin.execute(f"COMMIT PREPARED '{gid}'")
            gid = ""
            shipped = ship(
                db,
                store,
                TEST_KEYS,
                destination="file:///x",
                segment_events=1000,
                segment_age=timedelta(0),
                flush=True,
            )
            assert not shipped.unsettled
            ids = [r[0] for r in admin.execute("SELECT id FROM audit.journal ORDER BY id")]
        assert _shipped_ids(store) == ids  # every event, the prepared one included, once
    finally:
        if gid:
            with psycopg.connect(server.url(), autocommit=True) as admin:
                admin.execute(f"ROLLBACK PREPARED '{gid}'")
        db.dispose()

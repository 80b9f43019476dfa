"""A read on a pooled connection keeps the statements psycopg prepared on it (models.db.end_read): psycopg forgets
them all at a rollback and sends DEALLOCATE ALL, so reads that ended with one cost the next command on the same
connection a round trip and its prepared statements (re-parsed and re-planned until prepared again)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agents.client import Client
from agents.core import journal
from models import approvals_sql, jobs_sql, kpi_sql, outbox_sql
from models.db import Database, end_read
from tests.conftest import TEST_KEYS

ASK = {"prompt": "status?"}


@pytest.fixture
def one(db_url: str) -> Iterator[Database]:
    """A pool of one connection: every call below runs on the same one."""
    database = Database(db_url, pool_size=1, audit_keys=TEST_KEYS)
    database.engine.pool._max_overflow = 0  # type: ignore[attr-defined]  # no second connection beside it
    yield database
    database.dispose()


def prepared(db: Database) -> int:
    """How many statements the server holds prepared on the pool's connection (read without forgetting them)."""
    with db.connection() as conn:
        row = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
        conn.commit()  # not end_read: this count must not depend on what it checks
    assert row is not None
    return int(row[0])


READS: dict[str, Callable[[Client, Any], object]] = {
    "get_state": lambda client, agent: client.get_state(agent.id),
    "pending_jobs": lambda client, agent: jobs_sql.pending_jobs(client.db, agent.id),
    "journal": lambda client, agent: journal.agent_events_after(client.db, agent.id, 0),
    "list_agents": lambda client, agent: client.list_agents(limit=5),
    "kpi counters": lambda client, agent: kpi_sql.counters(client.db),
    "outbox stats": lambda client, agent: outbox_sql.request_messages(client.db, agent.id, "req-0"),
    "approvals": lambda client, agent: approvals_sql.waiting_call(client.db, agent.id),
}


@pytest.mark.parametrize("read", list(READS))
def test_a_read_keeps_the_connections_prepared_statements(one: Database, read: str) -> None:
    client = Client(one)
    agent = client.create_agent("prepared")
    for n in range(8):  # psycopg prepares a statement at its sixth run
        client.submit(agent.id, f"req-{n}", ASK)
        client.cancel(agent.id, actor="alice")
    before = prepared(one)
    assert before > 0, "the commands' statements were prepared"
    READS[read](client, agent)
    assert prepared(one) >= before, f"{read} made the connection forget its prepared statements"


def test_a_failed_read_is_still_rolled_back(one: Database) -> None:
    """end_read commits only a transaction that is open and healthy: a failed one is rolled back."""
    import psycopg

    with one.connection() as conn:
        with pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("SELECT * FROM no_such_table")
        end_read(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn.execute("SELECT 1").fetchone() == (1,)
        end_read(conn)

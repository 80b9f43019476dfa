"""The `keel` command line against a real database, run as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
SCRATCH = tempfile.mkdtemp(prefix="keel-cli-")


def keel(db_url: str, *args: str, check: bool = True, broker: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env["KEEL_DATABASE_URL"] = db_url
    if broker:
        env["KEEL_BROKER_URL"] = broker
    # In a directory of its own: a developer's .env must not leak into the test.
    result = subprocess.run([KEEL, *args], env=env, capture_output=True, text=True, timeout=180, cwd=SCRATCH)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_agent_lifecycle_from_the_command_line(db_url: str) -> None:
    created = json.loads(keel(db_url, "agent", "create", "ops-bot", "--budget-tokens", "500", "--json").stdout)
    assert (created["name"], created["phase"], created["revision"], created["budget_tokens"]) == (
        "ops-bot",
        "idle",
        0,
        500,
    )
    keel(db_url, "submit", "ops-bot", "req-7", "--input", '{"prompt": "hi"}', "--actor", "alice")
    shown = json.loads(keel(db_url, "agent", "show", created["id"], "--json").stdout)
    assert (shown["phase"], shown["revision"], shown["request_id"]) == ("planning", 1, "req-7")
    shown_text = keel(db_url, "agent", "show", "ops-bot").stdout
    assert "phase      planning" in shown_text and "req-7:plan:1" in shown_text
    job = json.loads(keel(db_url, "job", "req-7:plan:1", "--json").stdout)
    assert (job["status"], job["operation"], job["queue"]) == ("pending", "plan", "keel.jobs")
    missing = keel(db_url, "job", "nope:plan:1", check=False)
    assert missing.returncode == 1 and "no job has the key 'nope:plan:1'" in missing.stderr
    keel(db_url, "cancel", "ops-bot", "--revision", "1", "--reason", "wrong prompt", "--actor", "bob")
    events = json.loads(keel(db_url, "journal", "--agent", "ops-bot", "--json").stdout)
    assert [(e["kind"], e["event"], e["actor"]) for e in events] == [
        ("created", "create", "cli"),
        ("transition", "submit", "alice"),
        ("transition", "cancel", "bob"),
    ]
    assert events[2]["details"] == {"reason": "wrong prompt", "jobs_cancelled": ["req-7:plan:1"]}
    by_request = json.loads(keel(db_url, "journal", "--request-id", "req-7", "--json").stdout)
    assert [e["event"] for e in by_request] == ["submit", "cancel"]
    assert "planning -> failed" in keel(db_url, "journal", "--agent", "ops-bot").stdout
    verified = json.loads(keel(db_url, "audit", "verify", "--json").stdout)
    assert verified == {"ok": True, "agents": 1, "events": 3, "breaks": []}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("agent", "show", "ghost"), "no agent has the id or name 'ghost'"),
        (("agent", "create", "bad name"), "name: String should match pattern"),
        (("agent", "create", "x", "--budget-cost", "lots"), "'lots' is not a number"),
        (("submit", "ops", "r1", "--input", "{oops"), "not JSON"),
        (("approve", "ops", "--revision", "0"), "'approve' is not allowed (allowed: submit, charge)"),
        (("cancel", "ops", "--revision", "5"), "expected revision 5, the agent is at revision 0"),
    ],
)
def test_bad_input_exits_non_zero_with_one_line(db_url: str, args: tuple[str, ...], message: str) -> None:
    keel(db_url, "agent", "create", "ops")
    result = keel(db_url, *args, check=False)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args", [("agent", "list"), ("audit", "verify"), ("db", "upgrade"), ("demo",), ("journal", "--agent", "x")]
)
def test_unreachable_database_is_one_line_too(args: tuple[str, ...]) -> None:
    result = keel("postgresql://nobody@127.0.0.1:1/none", *args, check=False)
    assert result.returncode == 1
    assert result.stderr.startswith("keel: error: database error:"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_audit_verify_exits_1_on_tampering(db_url: str) -> None:
    keel(db_url, "agent", "create", "ops")
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("ALTER TABLE audit.journal DISABLE TRIGGER USER")
        conn.execute("UPDATE audit.journal SET actor = 'mallory'")
    result = keel(db_url, "audit", "verify", check=False)
    assert result.returncode == 1
    assert "BROKEN agent" in result.stderr and "at event 1" in result.stderr


def test_db_upgrade_and_downgrade(empty_db_url: str) -> None:
    assert "database at head" in keel(empty_db_url, "db", "upgrade").stdout
    keel(empty_db_url, "db", "downgrade", "base")
    with psycopg.connect(empty_db_url.replace("+psycopg", "")) as conn:
        tables: list[Any] = conn.execute("SELECT tablename FROM pg_tables WHERE tablename = 'agents'").fetchall()
    assert tables == []


def test_demo_runs_and_every_invariant_holds(db_url: str, own_redis: dict[str, Any]) -> None:
    # A Redis server of its own: the demo starts its processes with a KEEL_* environment of its making.
    result = keel(db_url, "demo", broker=own_redis["url"])
    assert "all invariants held" in result.stdout, result.stdout + result.stderr
    assert "FAILED" not in result.stdout
    assert "SIGKILL the worker" in result.stdout
    assert "duplicate side effects               0" in result.stdout


def test_docs_phases_check_fails_when_the_diagram_is_stale(tmp_path: Path) -> None:
    stale = tmp_path / "phases.md"
    stale.write_text("old")
    assert (
        keel("postgresql://unused@x/y", "docs", "phases", "--output", str(stale), "--check", check=False).returncode
        == 1
    )
    keel("postgresql://unused@x/y", "docs", "phases", "--output", str(stale))
    assert keel("postgresql://unused@x/y", "docs", "phases", "--output", str(stale), "--check").returncode == 0


def test_run_state_and_kpi_from_the_command_line(db_url: str, tmp_path: Path) -> None:
    script = tmp_path / "replies.json"
    script.write_text(json.dumps([{"content": "hello"}]))
    keel(db_url, "agent", "create", "helper")
    ran = json.loads(
        keel(db_url, "run", "helper", "Say hello", "--script", str(script), "--request-id", "r-1", "--json").stdout
    )
    assert (ran["phase"], ran["request_id"], [j["key"] for j in ran["pending_jobs"]]) == (
        "planning",
        "r-1",
        ["r-1:plan:1"],
    )
    state = json.loads(keel(db_url, "state", "helper", "--json").stdout)
    assert state["revision"] == 1 and state["pending_approval"] is None
    assert "jobs       1 pending" in keel(db_url, "state", "helper").stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    refused = keel(db_url, "run", "helper", "x", "--script", str(bad), check=False)
    assert refused.returncode == 2 and "not JSON" in refused.stderr
    kpis = json.loads(keel(db_url, "kpi", "--json").stdout)
    assert kpis["suppressed_duplicates"] == 0 and kpis["keys_confirmed_twice"] == 0

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

from models import migrations

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
        (("approve", "ops", "--revision", "0"), "agent 'ops' is idle: 'approve' is not allowed (allowed: submit)"),
        (("cancel", "ops", "--revision", "5"), "stale revision for agent 'ops': the command expected revision 5,"),
        (("submit", "ops", "r1"), "input of operation 'plan': input: must be a JSON object, got null"),
        (("submit", "ops", "r1", "--input", '"hello"'), "input: must be a JSON object, got a string"),
        (("submit", "ops", "r1", "--input", "[1, 2]"), "input: must be a JSON object, got an array"),
        (("submit", "ops", "r1", "--input", '{"prompt": "hi", "script": [1, 2]}'), "input.script[0]: must be a JSON"),
        (("agent", "create", "x", "--budget-tokens", str(2**63)), "budget_tokens: Input should be less than or equal"),
        (("cancel", "ops", "--revision", str(2**64)), "expected_revision must be from 0 to 9223372036854775807"),
        (("journal", "--limit", str(2**63)), "limit must be from 1 to 9223372036854775807"),
        (("outbox", "list", "--limit", str(2**63)), "is not in the range 1<=x<=9223372036854775807"),
        (("db", "downgrade", "nosuchrev"), "cannot downgrade to 'nosuchrev': no migration has this revision (known"),
        (
            ("db", "upgrade", "--revision", "nosuch"),
            "cannot upgrade to 'nosuch': no migration has this revision (known",
        ),
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


def test_a_database_without_this_codes_schema_says_so_and_what_to_run(empty_db_url: str) -> None:
    """Before: every command said `relation "agents" does not exist`."""
    head, previous = migrations.revisions()[-1], migrations.revisions()[-2]

    def says(*args: str) -> str:
        result = keel(empty_db_url, *args, check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        return lines[0]

    missing = f"keel: error: the database has no Keel schema (code at {head}): run 'keel db upgrade'"
    assert says("agent", "list") == missing
    assert says("journal") == missing
    keel(empty_db_url, "db", "upgrade", "--revision", previous)
    assert (
        says("agent", "create", "ops") == f"keel: error: database at {previous}, code at {head}: run 'keel db upgrade'"
    )
    keel(empty_db_url, "db", "upgrade")
    keel(empty_db_url, "agent", "create", "ops")
    with psycopg.connect(empty_db_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    assert says("agent", "show", "ops").startswith(
        f"keel: error: database at 9999, which this code does not know (code at {head}): it was migrated by a newer"
    )


def test_the_client_names_a_missing_schema_too(empty_db_url: str) -> None:
    from agents.client import Client
    from agents.core.errors import StoreError
    from models.db import Database

    database = Database(empty_db_url)
    try:
        with pytest.raises(
            StoreError, match=r"relation \"agents\" does not exist \(the database schema is missing or not"
        ):
            Client(database).list_agents()
    finally:
        database.dispose()


def test_db_upgrade_and_downgrade(empty_db_url: str) -> None:
    assert "database at head" in keel(empty_db_url, "db", "upgrade").stdout
    keel(empty_db_url, "db", "downgrade", "base")
    with psycopg.connect(empty_db_url.replace("+psycopg", "")) as conn:
        tables: list[Any] = conn.execute("SELECT tablename FROM pg_tables WHERE tablename = 'agents'").fetchall()
    assert tables == []


def test_demo_runs_and_every_invariant_holds(db_url: str, broker_url: str) -> None:
    result = keel(db_url, "demo", broker=broker_url)
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


def test_a_run_script_that_does_not_fit_is_refused_in_one_line(db_url: str, tmp_path: Path) -> None:
    keel(db_url, "agent", "create", "helper")
    for script, message in [
        ([1, 2], "input of operation 'plan': input.script[0]: must be a JSON object, got a number (and 1 more)"),
        (
            [{"tool_calls": [{"name": "slack.post", "arguments": {"channel": "C1", "text": "hi"}}]}],
            "input.script[0].tool_calls[0].name: there is no tool named 'slack.post'"
            " (tools: github_comment, slack_post)",
        ),
    ]:
        path = tmp_path / "replies.json"
        path.write_text(json.dumps(script))
        result = keel(db_url, "run", "helper", "Say hello", "--script", str(path), check=False)
        assert result.returncode == 1 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    state = json.loads(keel(db_url, "state", "helper", "--json").stdout)
    assert (state["phase"], state["revision"]) == ("idle", 0)


def test_resubmitting_a_request_id_with_other_input_is_refused(db_url: str) -> None:
    keel(db_url, "agent", "create", "ops")
    keel(db_url, "submit", "ops", "r1", "--input", '{"prompt": "a"}')
    assert keel(db_url, "submit", "ops", "r1", "--input", '{"prompt": "a"}', "--json").returncode == 0
    result = keel(db_url, "submit", "ops", "r1", "--input", '{"prompt": "b"}', check=False)
    assert result.returncode == 1
    assert result.stderr == (
        "keel: error: request id 'r1' was submitted to agent 'ops' before with a different input: a retry must"
        " repeat the request as it was; use a new request id for a new request\n"
    )


def test_the_readmes_scripted_replies_run_as_written(db_url: str, db: Any, tmp_path: Path) -> None:
    """The README's example script, taken from the README itself, submitted with `keel run` and run to the end."""
    from datetime import timedelta

    import agents.runtime.loop  # noqa: F401 - registers plan and tool
    from agents.core.policies import DEFAULT_RULES, ErrorClass, RetryRule
    from agents.jobs.handlers import registry
    from agents.jobs.runner import Runner

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- scripted-replies-example", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "replies.json"
    script.write_text(block)
    keel(db_url, "agent", "create", "ops-bot")
    keel(db_url, "run", "ops-bot", "Summarise open incidents", "--script", str(script), "--request-id", "r-readme")
    rules = {**DEFAULT_RULES, ErrorClass.TRANSIENT: RetryRule(3, 0.0, 0.0, 0.0)}
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=rules)
    for _ in range(10):
        with psycopg.connect(db.libpq_url) as conn:
            due = conn.execute(
                "SELECT key FROM jobs WHERE status IN ('pending', 'enqueued') ORDER BY created_at, key LIMIT 1"
            ).fetchone()
        if due is None:
            break
        runner.run(due[0])
    state = json.loads(keel(db_url, "state", "ops-bot", "--json").stdout)
    assert (state["phase"], state["spent_tokens"]) == ("done", 120 + 80 + 80)
    job = json.loads(keel(db_url, "job", "r-readme:tool:slack_post:1.call_0_0", "--json").stdout)
    assert job["status"] == "succeeded"
    answer = json.loads(keel(db_url, "job", "r-readme:plan:2", "--json").stdout)
    assert answer["result"]["answer"] == "Two incidents are open; both are about the database."
    assert "transient" in answer["error_attempts"]

"""The `keel` command line against a real database, run as a user would run it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from agents.client import Client
from models import migrations
from tests.support.audit import TEST_ENV, clean_env
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
PROMPT = '{"prompt": "hi"}'
SCRATCH = tempfile.mkdtemp(prefix="keel-cli-")


def keel(
    db_url: str, *args: str, check: bool = True, broker: str | None = None, **more: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))} | TEST_ENV | more
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
    plan = scoped(UUID(created["id"]), "req-7:plan:1")
    shown_text = keel(db_url, "agent", "show", "ops-bot").stdout
    assert "phase      planning" in shown_text and plan in shown_text
    job = json.loads(keel(db_url, "job", plan, "--json").stdout)
    assert (job["status"], job["operation"], job["queue"]) == ("pending", "plan", "keel.jobs")
    missing = keel(db_url, "job", "nope:plan:1", check=False)
    assert missing.returncode == 1 and "no job has the key 'nope:plan:1'" in missing.stderr
    keel(db_url, "cancel", "ops-bot", "--revision", "1", "--reason", "wrong prompt", "--actor", "bob")
    events = json.loads(keel(db_url, "journal", "--agent", "ops-bot", "--json").stdout)["events"]
    assert [(e["kind"], e["event"], e["actor"]) for e in events] == [  # newest first
        ("transition", "cancel", "bob"),
        ("transition", "submit", "alice"),
        ("created", "create", "cli"),
    ]
    assert events[0]["details"] == {"reason": "wrong prompt", "jobs_cancelled": [plan]}
    by_request = keel(db_url, "journal", "--agent", "ops-bot", "--request-id", "req-7", "--json").stdout
    assert [e["event"] for e in json.loads(by_request)["events"]] == ["cancel", "submit"]
    unscoped = keel(db_url, "journal", "--request-id", "req-7", check=False)  # request ids are each agent's own
    assert unscoped.returncode == 1 and "names a request of one agent: give its agent too" in unscoped.stderr
    assert "planning -> failed" in keel(db_url, "journal", "--agent", "ops-bot").stdout
    verified = json.loads(keel(db_url, "audit", "verify", "--json").stdout)
    assert verified == {
        "ok": True,
        "mode": "full",
        "agents": 1,
        "checked": 3,
        "trusted": 0,
        "trusted_chains": 0,
        "trusted_from": None,
        "trusted_to": None,
        "breaks": [],
        "unchecked": [],
        "legacy": [],
        "key_ids": ["test-1"],
        "archive_problems": [],
        "checkpoint_problems": [],
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("agent", "show", "ghost"), "no agent has the id or name 'ghost'"),
        (("agent", "create", "bad name"), "name: String should match pattern"),
        (("agent", "create", "x", "--budget-cost", "lots"), "'lots' is not a number"),
        (("submit", "ops", "r1", "--input", "{oops"), "not valid JSON"),
        (("approve", "ops", "--revision", "0"), "agent 'ops' is idle: 'approve' is not allowed (allowed: submit)"),
        (("cancel", "ops", "--revision", "5"), "stale revision for agent 'ops': the command expected revision 5,"),
        (("submit", "ops", "r1"), "--input is required: the request's input as JSON"),
        (
            ("submit", "ops", "r1", "--input", "null"),
            "input of operation 'plan': input: must be a JSON object, got null",
        ),
        (("submit", "ops", "r1", "--input", '"hello"'), "input: must be a JSON object, got a string"),
        (("submit", "ops", "r1", "--input", "[1, 2]"), "input: must be a JSON object, got an array"),
        (("submit", "ops", "r1", "--input", '{"prompt": "hi", "script": [1, 2]}'), "input.script[0]: must be a JSON"),
        (("agent", "create", "x", "--budget-tokens", str(2**63)), "'--budget-tokens': 9223372036854775808 is not in"),
        (("cancel", "ops", "--revision", str(2**64)), "'--revision': 18446744073709551616 is not in the range 0<=x<="),
        (("approve", "ops", "--revision", str(2**63)), "'--revision': 9223372036854775808 is not in the range"),
        (("journal", "--limit", str(2**63)), "'--limit': 9223372036854775808 is not in the range 1<=x<="),
        (("outbox", "list", "--limit", str(2**63)), "is not in the range 1<=x<=9223372036854775807"),
        (("agent", "list", "--limit", "99999999999999999999"), "'--limit': 99999999999999999999 is not in the range"),
        (("agent", "list", "--limit", str(2**63 - 1)), "'--limit': 9223372036854775807 is not in the range 1<=x<=1000"),
        (("wait", "ops", "r1", "--timeout", "nan"), "'--timeout': 'nan' is not a number of seconds"),
        (("wait", "ops", "r1", "--timeout", "1e308"), "'--timeout': 1e+308 is not in the range 0<x<=2592000"),
        (("submit", "ops", "r1", "--input", PROMPT, "--wait", "--timeout", "inf"), "'--timeout': inf is not in"),
        (("wait", "ops"), "agent 'ops' has had no request yet: nothing to wait for"),
        (("flower", "--port", "99999999999"), "'--port': 99999999999 is not in the range 1<=x<=65535"),
        (("up", "--concurrency", str(2**63)), "'--concurrency': 9223372036854775808 is not in the range 1<=x<=256"),
        (("up", "--give-up-after", "99999999999"), "'--give-up-after': 99999999999 is not in the range"),
        (("up", "--stop-timeout", "-1"), "'--stop-timeout': -1 is not in the range 0<=x<=3600"),
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
    agent_id = json.loads(keel(db_url, "agent", "show", "ops", "--json").stdout)["id"]
    # The agent by name and id (it was the id only).
    assert f"BROKEN agent 'ops' ({agent_id}) at event 1" in result.stderr, result.stderr
    broken = json.loads(keel(db_url, "audit", "verify", "--json", check=False).stdout)["breaks"]
    assert (broken[0]["agent"], broken[0]["agent_id"], broken[0]["seq"]) == ("ops", agent_id, 1)


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
    from models.migrations import head, revisions

    assert keel(empty_db_url, "db", "upgrade").stdout == f"database at {head()} (head)\n"
    previous = revisions()[revisions().index(head()) - 1]
    assert keel(empty_db_url, "db", "downgrade", previous).stdout == f"database at {previous} (head is {head()})\n"
    assert keel(empty_db_url, "db", "downgrade", "base").stdout == "database at base (no Keel schema)\n"
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
    # Numbers as `keel kpi` prints them (it printed `3341 ms`, `100%`, `$0.002000`).
    assert re.search(r"p95 phase-transition latency +(\d{1,3} ms|[\d,]+\.\d\d s) ", result.stdout), result.stdout
    assert re.search(r"recovery rate after first failure +100\.0% of \d+ jobs", result.stdout), result.stdout
    assert re.search(r"failure rate +\d+\.\d%\n", result.stdout) and "$0.002000" not in result.stdout
    # The agent column fits the demo's agent names: every outcome starts under its header.
    requests = result.stdout.split("Requests:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    column = requests[0].index("outcome")
    assert len(requests) == 8 and all(line[column - 1] == " " != line[column] for line in requests), requests
    # The approvals went through the HTTP API: the journal's actor is the demo's approver token, as the summary says.
    token = re.search(
        r"the demo's own approver token, (demo-approver-[0-9a-f]{6}):\n"
        r"scope approver, demo-\* agents only, revoked now",
        result.stdout,
    )
    assert token is not None, result.stdout
    assert re.search(r"HTTP API: (http://127\.0\.0\.1:\d+) \(docs at \1/docs\), stopped with the demo", result.stdout)
    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        approvals = conn.execute(
            "SELECT actor FROM audit.journal WHERE kind = 'transition' AND event = 'approve'"
        ).fetchall()
        (scopes, prefix, revoked) = conn.execute(  # type: ignore[misc]
            "SELECT scopes, agent_prefix, revoked_at IS NOT NULL FROM api_tokens WHERE name = %s", (token[1],)
        ).fetchone()
    assert approvals == [(token[1],), (token[1],)], approvals
    assert (scopes, prefix, revoked) == (["approver"], "demo-", True)


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
    helper = UUID(json.loads(keel(db_url, "agent", "create", "helper", "--json").stdout)["id"])
    ran = json.loads(
        keel(db_url, "run", "helper", "Say hello", "--script", str(script), "--request-id", "r-1", "--json").stdout
    )
    assert (ran["phase"], ran["request_id"], [j["key"] for j in ran["pending_jobs"]]) == (
        "planning",
        "r-1",
        [scoped(helper, "r-1:plan:1")],
    )
    state = json.loads(keel(db_url, "state", "helper", "--json").stdout)
    assert state["revision"] == 1 and state["pending_approval"] is None
    assert "jobs       1 pending" in keel(db_url, "state", "helper").stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    refused = keel(db_url, "run", "helper", "x", "--script", str(bad), check=False)
    assert refused.returncode == 2 and "not valid JSON" in refused.stderr
    kpis = json.loads(keel(db_url, "kpi", "--json").stdout)
    assert sum(kpis["suppressed_duplicates"].values()) == 0 and kpis["side_effect_duplicates"] == 0


# --- the command's own user experience (issue 10) -------------------------------------------------------------

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
TIME_KEYS = {"at", "created_at", "updated_at", "run_at", "archived_at", "next_attempt_at", "enqueued_at"}


def _times(value: Any) -> list[str]:
    """Every value of a time field anywhere in a JSON document."""
    if isinstance(value, dict):
        found = [v for k, v in value.items() if k in TIME_KEYS and v is not None]
        return found + [t for v in value.values() for t in _times(v)]
    if isinstance(value, list):
        return [t for v in value for t in _times(v)]
    return []


def test_version_comes_from_the_installed_package() -> None:
    result = keel("postgresql://unused@x/y", "--version")
    assert result.stdout.strip() == f"keel {importlib.metadata.version('keel')}"


@pytest.mark.parametrize(
    ("shell", "marker"),
    [("bash", "complete -o nosort -F _keel_completion keel"), ("zsh", "#compdef keel"), ("fish", "complete")],
)
def test_shell_completion_scripts_are_produced(shell: str, marker: str) -> None:
    env = clean_env()
    script = subprocess.run(
        [KEEL], env={**env, "_KEEL_COMPLETE": f"{shell}_source"}, capture_output=True, text=True, timeout=60
    )
    assert script.returncode == 0 and marker in script.stdout, script.stdout + script.stderr
    # ... and the completion it drives knows the commands.
    words = subprocess.run(
        [KEEL],
        env={**env, "_KEEL_COMPLETE": "bash_complete", "COMP_WORDS": "keel ag", "COMP_CWORD": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "plain,agent" in words.stdout.splitlines()


def test_agent_list_has_a_header_a_phase_filter_newest_first_and_pages(db_url: str) -> None:
    for name in ("a1", "a2", "a3", "a4", "a5"):
        keel(db_url, "agent", "create", name)
    keel(db_url, "submit", "a2", "r-a2", "--input", PROMPT)
    keel(db_url, "submit", "a4", "r-a4", "--input", PROMPT)
    listed = keel(db_url, "agent", "list").stdout.splitlines()
    assert listed[0].split() == ["NAME", "PHASE", "REV", "REQUEST", "CREATED", "UPDATED"]
    assert [line.split()[0] for line in listed[1:]] == ["a5", "a4", "a3", "a2", "a1"]
    planning = json.loads(keel(db_url, "agent", "list", "--phase", "planning", "--json").stdout)
    assert [a["name"] for a in planning["agents"]] == ["a4", "a2"] and planning["next"] is None
    both = json.loads(keel(db_url, "agent", "list", "--phase", "planning", "--phase", "idle", "--json").stdout)
    assert len(both["agents"]) == 5

    seen: list[str] = []
    cursor: str | None = None
    while True:
        args = ["agent", "list", "--limit", "2", "--json"] + (["--after", cursor] if cursor else [])
        page = json.loads(keel(db_url, *args).stdout)
        seen += [a["name"] for a in page["agents"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == ["a5", "a4", "a3", "a2", "a1"]
    first_text = keel(db_url, "agent", "list", "--limit", "2").stdout
    assert first_text.strip().splitlines()[-1].startswith("next: keel agent list --limit 2 --after ")
    # The next page's command keeps the filters (it dropped them): run as printed, it pages on.
    idle = keel(db_url, "agent", "list", "--phase", "idle", "--limit", "2").stdout.strip().splitlines()
    cursor = json.loads(keel(db_url, "agent", "list", "--phase", "idle", "--limit", "2", "--json").stdout)["next"]
    assert idle[-1] == f"next: keel agent list --phase idle --limit 2 --after {cursor}"
    following = keel(db_url, *idle[-1].removeprefix("next: keel ").split()).stdout.splitlines()
    assert [line.split()[0] for line in following[1:]] == ["a1"]
    keel(db_url, "agent", "archive", "a1")
    keel(db_url, "agent", "archive", "a3")
    archived = keel(db_url, "agent", "list", "--archived", "--limit", "1").stdout.strip().splitlines()
    assert archived[-1].startswith("next: keel agent list --archived --limit 1 --after ")

    bad = keel(db_url, "agent", "list", "--after", "nonsense", check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1  # a usage error, naming --after
    assert "Invalid value for --after" in bad.stderr
    assert "cursor 'nonsense' is not the 'next' of a page of agents" in bad.stderr
    wrong_phase = keel(db_url, "agent", "list", "--phase", "sleeping", check=False)
    assert wrong_phase.returncode == 2 and "'sleeping' is not one of" in wrong_phase.stderr


def test_archive_hides_an_agent_refuses_requests_and_keeps_its_journal(db_url: str) -> None:
    keel(db_url, "agent", "create", "old-bot")
    keel(db_url, "agent", "create", "busy-bot")
    keel(db_url, "submit", "busy-bot", "r-busy", "--input", PROMPT)
    refused = keel(db_url, "agent", "archive", "busy-bot", "--actor", "carol", check=False)
    assert refused.returncode == 1
    assert "agent 'busy-bot' is planning: archive it when it rests" in refused.stderr
    assert json.loads(keel(db_url, "agent", "show", "busy-bot", "--json").stdout)["archived_at"] is None

    archived = json.loads(keel(db_url, "agent", "archive", "old-bot", "--actor", "carol", "--json").stdout)
    assert RFC3339.match(archived["archived_at"]) and archived["phase"] == "idle" and archived["revision"] == 0
    names = [a["name"] for a in json.loads(keel(db_url, "agent", "list", "--json").stdout)["agents"]]
    assert names == ["busy-bot"]
    assert [a["name"] for a in json.loads(keel(db_url, "agent", "list", "--archived", "--json").stdout)["agents"]] == [
        "old-bot"
    ]
    submit = keel(db_url, "submit", "old-bot", "r-old", "--input", PROMPT, check=False)
    assert submit.returncode == 1 and "agent 'old-bot' is archived" in submit.stderr
    assert "ARCHIVED" in keel(db_url, "agent", "show", "old-bot").stdout

    events = json.loads(keel(db_url, "journal", "--agent", "old-bot", "--json").stdout)["events"]
    assert [(e["kind"], e["event"], e["decision"], e["actor"]) for e in events] == [  # newest first
        ("rejected", "submit", "agent_archived", "cli"),
        ("operator", "archive", "archived", "carol"),
        ("created", "create", "accepted", "cli"),
    ]
    busy = json.loads(keel(db_url, "journal", "--agent", "busy-bot", "--json").stdout)["events"]
    assert (busy[0]["kind"], busy[0]["event"], busy[0]["decision"]) == ("rejected", "archive", "agent_busy")
    assert json.loads(keel(db_url, "audit", "verify", "--json").stdout)["ok"] is True

    keel(db_url, "agent", "unarchive", "old-bot")
    assert (
        json.loads(keel(db_url, "submit", "old-bot", "r-old", "--input", PROMPT, "--json").stdout)["phase"]
        == "planning"
    )
    assert json.loads(keel(db_url, "audit", "verify", "--json").stdout) == {
        "ok": True,
        "mode": "full",
        "agents": 2,
        "checked": 8,
        "trusted": 0,
        "trusted_chains": 0,
        "trusted_from": None,
        "trusted_to": None,
        "breaks": [],
        "unchecked": [],
        "legacy": [],
        "key_ids": ["test-1"],
        "archive_problems": [],
        "checkpoint_problems": [],
    }
    quick = json.loads(keel(db_url, "audit", "verify", "--incremental", "--json").stdout)
    # Nothing new since the full pass: every event trusted from the checkpoints it just stamped, none checked.
    assert (quick["ok"], quick["mode"], quick["checked"], quick["trusted"], quick["trusted_chains"]) == (
        True, "incremental", 0, 8, 2
    )  # fmt: skip


def test_kpi_prints_the_counters_for_people_over_all_time_or_a_window(db_url: str) -> None:
    mine = UUID(json.loads(keel(db_url, "agent", "create", "mine", "--json").stdout)["id"])
    keel(db_url, "submit", "mine", "r-mine", "--input", PROMPT)
    keel(db_url, "agent", "create", "other")
    keel(db_url, "submit", "other", "r-other", "--input", PROMPT)
    keel(db_url, "cancel", "other")
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        # A step that failed once, then succeeded, with an awkward cost: counted by the database, however written.
        conn.execute(
            "UPDATE jobs SET status = 'succeeded', error_attempts = '{\"transient\": 1}', failed_cost = 0.0025,"
            " failed_tokens = 12345, finished_at = now() WHERE key = %s",
            (scoped(mine, "r-mine:plan:1"),),
        )
    figures = json.loads(keel(db_url, "kpi", "--json").stdout)
    assert (figures["since"], figures["requests_done"], figures["requests_failed"]) == (None, 0, 1)
    assert (figures["failure_rate"], figures["recovery_rate"], figures["jobs_finished_after_failure"]) == (1.0, 1.0, 1)
    assert (figures["retry_tokens"], figures["retry_cost"], figures["retry_cost_share"]) == (12345, 0.0025, 1.0)
    assert figures["suppressed_duplicates"] == {"submit": 0, "job_delivery": 0, "job_insert": 0, "message_insert": 0}
    text = keel(db_url, "kpi").stdout.splitlines()
    assert text[0] == "KPIs since the counters began"
    rows = dict(re.split(r" {2,}", line.strip(), maxsplit=1) for line in text[1:])
    assert (
        rows["recovery rate after first failure"] == "100.0% of 1 jobs finished after a failure (1 failed a first time)"
    )
    assert rows["retry-caused cost"] == "12,345 tokens, $0.0025 (100.0% of spend)"
    assert (rows["failure rate"], rows["requests finished"]) == ("100.0%", "0 done, 1 failed")
    assert re.fullmatch(r"\d+ ms|[\d,]+\.\d\d s", rows["mean request time"]), rows
    hour = json.loads(keel(db_url, "kpi", "--since", "1h", "--json").stdout)
    assert hour == {**figures, "since": "1h"}
    assert keel(db_url, "kpi", "--since", "90m").stdout.startswith("KPIs over the last 90m\n")
    for bad, rule in (
        ("5x", "e.g. 24h, 90m, 7d"),
        ("0h", "positive"),
        ("400d", "KEEL_KPI_RETENTION_DAYS"),
        ("30s", "30s is under a minute"),  # a window is whole minutes: this one would hold almost nothing
    ):
        refused = keel(db_url, "kpi", "--since", bad, check=False)
        assert refused.returncode == 2 and "--since" in refused.stderr and rule in refused.stderr, refused.stderr
    gone = keel(db_url, "kpi", "--include-demo", check=False)
    assert gone.returncode == 2 and "the KPI counters are global" in gone.stderr


def test_one_timestamp_format_and_one_json_shape(db_url: str) -> None:
    clock = UUID(json.loads(keel(db_url, "agent", "create", "clock", "--json").stdout)["id"])
    keel(db_url, "submit", "clock", "r-clock", "--input", '{"prompt": "what time is it"}')
    plan = scoped(clock, "r-clock:plan:1")
    outputs = {
        args: json.loads(keel(db_url, *args, "--json").stdout)
        for args in [
            ("agent", "show", "clock"),
            ("state", "clock"),
            ("agent", "list"),
            ("journal",),
            ("job", plan),
            ("outbox", "list"),
            ("outbox", "stats"),
            ("kpi",),
            ("audit", "verify"),
        ]
    }
    for args, data in outputs.items():
        assert isinstance(data, dict), args  # one shape: an object; lists are named fields of it
    assert set(outputs[("agent", "list")]) == {"agents", "next"}
    assert set(outputs[("journal",)]) == {"events", "next"}
    assert set(outputs[("outbox", "list")]) == {"messages"}
    times = [t for data in outputs.values() for t in _times(data)]
    assert len(times) >= 8 and all(RFC3339.match(t) for t in times), times

    texts = [
        keel(db_url, *args).stdout
        for args in [("agent", "show", "clock"), ("agent", "list"), ("journal",), ("job", plan)]
    ]
    text_times = re.findall(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d\S*", "\n".join(texts))
    assert text_times and all(RFC3339.match(t) for t in text_times), text_times
    job_text = texts[3]
    # Payloads are JSON, not Python's repr.
    assert '"prompt": "what time is it"' in job_text and "'prompt'" not in job_text


def test_journal_shows_the_whole_actor_and_why_a_command_was_rejected(db_url: str) -> None:
    actor = "deploy-pipeline@build-host-0042.example.internal"
    keel(db_url, "agent", "create", "ops", "--actor", actor)
    stale = keel(db_url, "cancel", "ops", "--revision", "3", "--actor", actor, check=False)
    assert stale.returncode == 1
    text = keel(db_url, "journal", "--agent", "ops").stdout
    assert actor in text
    assert "error: stale revision for agent" in text and "the agent is at revision 0" in text
    assert '"expected_revision": 3' in text and '"judged_phase": "idle"' in text
    # Newest first: the page after the refusal holds the create event alone, which shows no details.
    older = json.loads(keel(db_url, "journal", "--agent", "ops", "--limit", "1", "--json").stdout)["next"]
    assert "details:" not in keel(db_url, "journal", "--agent", "ops", "--limit", "1", "--after", older).stdout
    assert "details: {" in keel(db_url, "journal", "--agent", "ops", "--details").stdout


def test_wait_times_out_with_its_own_status_and_the_request_goes_on(db_url: str) -> None:
    keel(db_url, "agent", "create", "slow")
    # No worker is running: the request cannot move on.
    waited = keel(db_url, "submit", "slow", "r-slow", "--input", PROMPT, "--wait", "--timeout", "0.5", check=False)
    assert waited.returncode == 5, waited.stderr
    assert "timed out after 0.5s: agent 'slow' is planning at revision 1" in waited.stderr
    # The command to wait again, with the values filled in (it said `keel submit AGENT REQUEST_ID --wait`).
    assert "wait again with `keel wait slow r-slow`" in waited.stderr, waited.stderr
    again = keel(db_url, "wait", "slow", "r-slow", "--timeout", "0.3", check=False)
    assert again.returncode == 5 and "wait again with `keel wait slow r-slow`" in again.stderr, again.stderr
    assert "phase      planning" in again.stdout
    current = keel(db_url, "wait", "slow", "--timeout", "0.3", "--json", check=False)  # its current request
    assert current.returncode == 5 and json.loads(current.stdout)["request_id"] == "r-slow"
    unknown = keel(db_url, "wait", "slow", "r-nope", check=False)
    assert unknown.returncode == 1 and unknown.stderr == "keel: error: agent 'slow' has no request 'r-nope'\n"
    assert json.loads(keel(db_url, "state", "slow", "--json").stdout)["phase"] == "planning"
    lonely = keel(db_url, "submit", "slow", "r-2", "--input", PROMPT, "--timeout", "1", check=False)
    assert lonely.returncode == 2 and "--timeout needs --wait or --follow" in lonely.stderr


def test_follow_reads_every_event_once_while_agents_move(client: Client) -> None:
    """Events committed by many writers at once reach a follower exactly once, each agent's chain without gaps."""
    agents = [client.create_agent(f"f{i}") for i in range(4)]
    seen: dict[Any, int] = {}
    got: list[tuple[Any, int]] = []

    def drain() -> None:
        for event in client.journal_after(seen):
            assert event.seq == seen.get(event.agent_id, 0) + 1, "a gap or a repeat"
            seen[event.agent_id] = event.seq
            got.append((event.agent_id, event.seq))

    def churn(agent_id: Any) -> None:
        for n in range(15):
            client.submit(agent_id, f"{agent_id}-{n}", {"prompt": f"step {n}"})
            client.cancel(agent_id, actor="churn")

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(churn, a.id) for a in agents]
        while not all(f.done() for f in futures):
            drain()
        for f in futures:
            f.result()
    drain()
    assert sorted(got) == sorted((e.agent_id, e.seq) for e in client.journal())
    assert len(got) == 4 * (1 + 30)


def test_the_database_refuses_an_archive_that_is_not_journaled(db_url: str) -> None:
    keel(db_url, "agent", "create", "sneaky")
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.RaiseException, match=r"archiving agent .* must be journaled"):
            conn.execute("UPDATE agents SET archived_at = now() WHERE name = 'sneaky'")
    assert json.loads(keel(db_url, "agent", "show", "sneaky", "--json").stdout)["archived_at"] is None


def test_a_run_script_that_does_not_fit_is_refused_in_one_line(db_url: str, tmp_path: Path) -> None:
    keel(db_url, "agent", "create", "helper")
    for script, message in [
        ([1, 2], "input of operation 'plan': input.script[0]: must be a JSON object, got a number (and 1 more)"),
        (
            [{"tool_calls": [{"name": "slack.post", "arguments": {"channel": "C1", "text": "hi"}}]}],
            "input.script[0].tool_calls[0].name: there is no tool named 'slack.post'"
            " (tools: github_comment, slack_post)",
        ),
        (
            [
                {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "#general", "text": "hi"}}]},
                {"content": "ok"},
            ],
            "input of operation 'plan': input.script[0].tool_calls[0].arguments.channel: string should match pattern",
        ),
        (
            [{"tool_calls": [{"name": "slack_post", "arguments": {"chan": 1}}]}, {"content": "ok"}],
            "input.script[0].tool_calls[0].arguments.channel: is required (and 1 more)",
        ),
    ]:
        path = tmp_path / "replies.json"
        path.write_text(json.dumps(script))
        result = keel(db_url, "run", "helper", "Say hello", "--script", str(path), "--wait", check=False)
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


def run_jobs(db: Any, most: int = 10) -> None:
    """Run the due jobs in this process, one at a time, as a worker would (retries without backoff)."""
    from datetime import timedelta

    import agents.runtime.loop  # noqa: F401 - registers plan and tool
    from agents.core.policies import DEFAULT_RULES, ErrorClass, RetryRule
    from agents.jobs.handlers import registry
    from agents.jobs.runner import Runner

    rules = {**DEFAULT_RULES, ErrorClass.TRANSIENT: RetryRule(3, 0.0, 0.0, 0.0)}
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=rules)
    for _ in range(most):
        with psycopg.connect(db.libpq_url) as conn:
            due = conn.execute(
                "SELECT key FROM jobs WHERE status IN ('pending', 'enqueued') ORDER BY created_at, key LIMIT 1"
            ).fetchone()
        if due is None:
            return
        runner.run(due[0])


def test_the_readmes_scripted_replies_run_as_written(db_url: str, db: Any, tmp_path: Path) -> None:
    """The README's example script, taken from the README itself, submitted with `keel run` and run to the end."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- scripted-replies-example", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "replies.json"
    script.write_text(block)
    keel(db_url, "agent", "create", "ops-bot")
    keel(db_url, "run", "ops-bot", "Summarise open incidents", "--script", str(script), "--request-id", "r-readme")
    run_jobs(db)
    state = json.loads(keel(db_url, "state", "ops-bot", "--json").stdout)
    assert (state["phase"], state["spent_tokens"]) == ("done", 120 + 80 + 80)
    agent = UUID(state["id"])
    job = json.loads(keel(db_url, "job", scoped(agent, "r-readme:tool:slack_post:1.call_0_0"), "--json").stdout)
    assert job["status"] == "succeeded"
    answer = json.loads(keel(db_url, "job", scoped(agent, "r-readme:plan:2"), "--json").stdout)
    assert answer["result"]["answer"] == "Two incidents are open; both are about the database."
    assert "transient" in answer["error_attempts"]


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_worker_and_beat_refuse_a_database_without_this_codes_schema(empty_db_url: str, command: str) -> None:
    from models.migrations import head

    result = keel(empty_db_url, command, check=False, broker="redis://127.0.0.1:1/0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == f"keel: error: the database has no Keel schema (code at {head()}): run 'keel db upgrade'\n"


def test_waiting_on_an_older_request_reports_that_requests_own_outcome(db_url: str, db: Any, tmp_path: Path) -> None:
    """Before: the repeat of F1 (a suppressed duplicate) waited for the agent's current request, D1, and exited 0
    printing `request D1, phase done`."""
    failing, fine = tmp_path / "fail.json", tmp_path / "ok.json"
    failing.write_text(json.dumps([{"error": "invalid", "content": "never given"}]))
    fine.write_text(json.dumps([{"content": "hello"}]))
    keel(db_url, "agent", "create", "ops-bot")

    def run(request_id: str, script: Path, *more: str) -> subprocess.CompletedProcess[str]:
        args = ("run", "ops-bot", "hello", "--script", str(script), "--request-id", request_id, *more)
        return keel(db_url, *args, check=False)

    run("F1", failing)
    run_jobs(db)
    assert run("F1", failing, "--wait").returncode == 3
    run("D1", fine)
    run_jobs(db)
    assert run("D1", fine, "--wait").returncode == 0

    again = run("F1", failing, "--wait")
    assert again.returncode == 3, again.stdout + again.stderr
    assert "request    F1: failed at revision 2 (fail, invalid_not_retried" in again.stdout, again.stdout
    assert "has moved on: request D1 is done at revision 4" in again.stdout
    as_json = json.loads(run("F1", failing, "--wait", "--json").stdout)
    assert (as_json["request_id"], as_json["phase"], as_json["revision"]) == ("F1", "failed", 2)
    assert (as_json["agent"]["request_id"], as_json["agent"]["phase"]) == ("D1", "done")
    followed = run("F1", failing, "--follow", "--json")
    assert followed.returncode == 3
    assert {json.loads(line)["request_id"] for line in followed.stdout.splitlines()} == {"F1"}

    # `keel wait` asks without submitting anything: the same outcomes.
    assert keel(db_url, "wait", "ops-bot", "F1", check=False).returncode == 3
    latest = keel(db_url, "wait", "ops-bot", "--json", check=False)
    assert latest.returncode == 0 and json.loads(latest.stdout)["request_id"] == "D1"
    events = json.loads(keel(db_url, "journal", "--agent", "ops-bot", "--json").stdout)["events"]
    assert [e["event"] for e in events if e["kind"] == "transition"].count("submit") == 2  # nothing resubmitted


def test_journal_follow_of_an_unknown_agent_is_one_error_line_and_no_header(db_url: str) -> None:
    result = keel(db_url, "journal", "--agent", "nosuch", "--follow", check=False)
    assert result.returncode == 1
    assert (result.stdout, result.stderr) == ("", "keel: error: no agent has the id or name 'nosuch'\n")


def test_text_output_spells_booleans_and_nothing_as_json_does(db_url: str) -> None:
    ops = UUID(json.loads(keel(db_url, "agent", "create", "ops", "--json").stdout)["id"])
    keel(db_url, "submit", "ops", "r1", "--input", PROMPT)
    message = scoped(ops, "r1:slack:C1")
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (key, agent_id, request_id, channel, destination, payload, next_attempt_at)"
            " SELECT %s, id, 'r1', 'slack', 'C1', '{\"text\": \"hi\"}', now() FROM agents",
            (message,),
        )
    shown = dict(line.split(None, 1) for line in keel(db_url, "outbox", "show", message).stdout.splitlines())
    assert (shown["needs_reconcile"], shown["last_error"], shown["external_id"]) == ("false", "null", "null")
    job = dict(line.split(None, 1) for line in keel(db_url, "job", scoped(ops, "r1:plan:1")).stdout.splitlines())
    assert (job["lease_until"], job["worker"]) == ("null", "null")


LONG = "x" * 5000


@pytest.mark.parametrize(
    "args",
    [
        ("submit", "ops", LONG, "--input", PROMPT),
        ("agent", "create", LONG[:150]),
        ("job", LONG),
        ("outbox", "show", LONG),
        ("outbox", "retry", LONG),
        ("agent", "list", "--after", LONG),
        ("agent", "list", "--limit", "9" * 5000),
        ("wait", "ops", LONG),
        ("cancel", LONG[:150], "--revision", "0"),
    ],
    ids=["request-id", "agent-exists", "job", "outbox-show", "outbox-retry", "cursor", "limit", "wait", "agent"],
)
def test_long_values_are_shortened_in_errors(db_url: str, args: tuple[str, ...]) -> None:
    """A 5,000-character value was echoed whole in its error."""
    keel(db_url, "agent", "create", "ops")
    keel(db_url, "agent", "create", LONG[:150])
    result = keel(db_url, *args, check=False)
    assert result.returncode in (1, 2) and len(result.stderr.splitlines()) == 1, result.stderr
    assert len(result.stderr) < 300 and "x" * 61 not in result.stderr, result.stderr
    assert "…" in result.stderr or "at most 200 characters" in result.stderr, result.stderr


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1 that keeps the service name and trace id of each span it gets."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service.name, span name, trace id)
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                for resource in body.resource_spans:
                    (service,) = (a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
                    for scope in resource.scope_spans:
                        received.extend((service, span.name, span.trace_id.hex()) for span in scope.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_command_traces_when_an_endpoint_is_configured(db_url: str) -> None:
    collector = Collector()
    try:
        created = keel(db_url, "agent", "create", "traced-bot", "--json", KEEL_OTLP_ENDPOINT=collector.url)
        traced = UUID(json.loads(created.stdout)["id"])
        keel(db_url, "submit", "traced-bot", "req-t", "--input", PROMPT, KEEL_OTLP_ENDPOINT=collector.url)
        keel(db_url, "submit", "traced-bot", "req-u", "--input", PROMPT, check=False)  # no endpoint: no trace
    finally:
        collector.stop()
    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        stored = dict(conn.execute("SELECT request_id, traceparent FROM requests").fetchall())
        (job_trace,) = conn.execute(  # type: ignore[misc]
            "SELECT traceparent FROM jobs WHERE key = %s", (scoped(traced, "req-t:plan:1"),)
        ).fetchone()
    assert job_trace is not None and stored["req-t"] is not None
    trace_id = job_trace.split("-")[1]
    # The command's exit exported its spans: the submit's transition, in the trace its job carries.
    assert ("keel-cli", "keel.transition submit", trace_id) in collector.spans, collector.spans
    assert stored.get("req-u", "missing") in (None, "missing")

"""The `keel` command as a whole, against a real database, run as a user would run it: one-line errors, one
output format, the schema check, version, completion, tracing, and the db, docs and demo commands."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading
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
from tests.support.audit import clean_env
from tests.support.cli import KEEL, PROMPT, RFC3339, keel
from tests.support.keys import scoped

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("agent", "show", "ghost"), "no agent has the id or name 'ghost'"),
        (("agent", "create", "bad name"), "name: String should match pattern"),
        (("agent", "create", "x", "--budget-cost", "lots"), "'lots' is not a number"),
        (("submit", "ops", "r1", "--input", "{oops"), "not valid JSON"),
        (("approve", "ops", "--revision", "0"), "agent 'ops' is idle: 'approve' is not allowed (allowed: submit)"),
        (("cancel", "ops", "--revision", "5"), "stale revision for agent 'ops': the command expected revision 5,"),
        (("cancel", "ops", "--revision", "5"), "nothing was done; see what it is at now (`keel state ops`) first"),
        (("submit", "ops", "r1"), """--input is required: the request's input as JSON, e.g. --input '{"prompt": """),
        (("submit", "ops", "r1", "--operation", "summarise"), "e.g. --input '{...}' (what the operation takes; '{}'"),
        (
            ("submit", "ops", "r1", "--input", "null"),
            "input of operation 'plan': input: must be a JSON object, got null",
        ),
        (("submit", "ops", "r1", "--input", '"hello"'), "input: must be a JSON object, got a string"),
        # Every problem, each on its line: the second is the one that says what went wrong (a newcomer's find).
        (
            ("submit", "ops", "r1", "--input", '{"title": "x"}'),
            "input.prompt: is required; input.title: is not a field",
        ),
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
        (("run", "nobody", "hi"), "no agent has the id or name 'nobody'"),  # before any word about --script
        (("flower", "--port", "99999999999"), "'--port': 99999999999 is not in the range 1<=x<=65535"),
        (("up", "--concurrency", str(2**63)), "'--concurrency': 9223372036854775808 is not in the range 1<=x<=5000"),
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


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_worker_and_beat_refuse_a_database_without_this_codes_schema(empty_db_url: str, command: str) -> None:
    from models.migrations import head

    result = keel(empty_db_url, command, check=False, broker="redis://127.0.0.1:1/0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == f"keel: error: the database has no Keel schema (code at {head()}): run 'keel db upgrade'\n"


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
    assert re.search(r"p95 step latency +(\d{1,3} ms|[\d,]+\.\d\d s) ", result.stdout), result.stdout
    assert "phase-transition" not in result.stdout, "the demo's measure is not keel kpi's: it has its own name"
    assert re.search(r"recovery rate after first failure +100\.0% of \d+ jobs", result.stdout), result.stdout
    assert re.search(r"failure rate +\d+\.\d%\n", result.stdout) and "$0.002000" not in result.stdout
    # The agent column fits the demo's agent names: every outcome starts under its header.
    requests = result.stdout.split("Requests:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    column = requests[0].index("outcome")
    assert len(requests) == 9 and all(line[column - 1] == " " != line[column] for line in requests), requests
    assert "[ok] the Pydantic AI agent's model was asked once per reply and its tools ran once" in result.stdout
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
    assert approvals == [(token[1],)] * 3, approvals  # two reviewers' comments and the concierge's page
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


TIME_KEYS = {"at", "created_at", "updated_at", "run_at", "archived_at", "next_attempt_at", "enqueued_at"}


def _times(value: Any) -> list[str]:
    """Every value of a time field anywhere in a JSON document."""
    if isinstance(value, dict):
        found = [v for k, v in value.items() if k in TIME_KEYS and v is not None]
        return found + [t for v in value.values() for t in _times(v)]
    if isinstance(value, list):
        return [t for v in value for t in _times(v)]
    return []


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


def test_outbox_list_has_a_header_row_over_its_columns(db_url: str, client: Client, db: Any) -> None:
    from tests.support.runs import run_all

    agent = client.create_agent("poster")
    post = {"name": "slack_post", "arguments": {"channel": "C0PS", "text": "hello"}}
    client.submit(agent.id, "r1", {"prompt": "post", "script": [{"tool_calls": [post]}, {"content": "Posted."}]})
    run_all(db)
    header, row = keel(db_url, "outbox", "list").stdout.splitlines()
    assert header.split() == ["key", "channel", "destination", "status", "attempts", "last", "error"]
    assert row.split()[1:5] == ["slack", "C0PS", "pending", "0"]
    assert header.index("channel") == row.index(" slack ") + 1 and header.index("status") == row.index(" pending ") + 1


def test_a_command_run_outside_the_stacks_directory_says_so(tmp_path: Path) -> None:
    """Found by a newcomer's walkthrough: `keel state oncall` one directory off started an empty embedded database
    there and said only `run 'keel db upgrade'`, which led on to `no agent has the id or name 'oncall'`."""
    home = tmp_path / ".keel"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")} | {"KEEL_HOME": str(home)}
    keel_bin = str(Path(sys.executable).parent / "keel")
    try:
        result = subprocess.run(
            [keel_bin, "state", "oncall"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 1
        assert result.stderr.startswith(f"keel: error: the embedded database under {home} has no Keel schema: run")
        assert "in the directory where your stack runs" in result.stderr, result.stderr
    finally:
        subprocess.run([keel_bin, "dev", "stop"], env=env, cwd=tmp_path, capture_output=True, timeout=120)

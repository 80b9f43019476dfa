"""The outbox against local fake Slack and GitHub servers: exactly one message per key, confirmed, even when an
attempt's outcome is unknown; nothing emitted by a rolled-back transition; tokens never leak; the `keel outbox`
commands. (Failed sends: test_outbox_retries.py; claims and leases: test_outbox_leases.py; destination lines:
test_outbox_lines.py; planted keys: test_outbox_identity.py.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core.commands import Command, MessageSpec
from agents.core.errors import InvalidInput
from agents.core.phases import Event
from agents.core.transition import transition
from models.db import Database
from models.outbox_sql import message_row, stats
from tests.support.audit import clean_env
from tests.support.cli import run_keel
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped
from tests.support.outbox import (
    GITHUB_TOKEN,
    SLACK_TOKEN,
    close_relays,
    drain,
    emit,
    fake_github,
    fake_slack,
    gh_msg,
    relay,
    slack_msg,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    yield from fake_slack()


@pytest.fixture
def github() -> Iterator[FakeGitHub]:
    yield from fake_github()


@pytest.fixture(autouse=True)
def _close_relays() -> Iterator[None]:
    yield from close_relays()


def test_messages_are_delivered_once_with_their_keys_and_confirmed(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "m1"), gh_msg("acme/api#7", "m2"), slack_msg("C1", "m3"))
    drain(relay(db, slack, github))
    assert slack.order("C1") == [scoped(bot.id, "req-bot:slack:m1"), scoped(bot.id, "req-bot:slack:m3")]
    assert github.order("acme/api#7") == [scoped(bot.id, "req-bot:github:m2")]
    comment = github.comments["acme/api#7"][0]
    assert comment["body"].endswith(f"<!-- keel:{scoped(bot.id, 'req-bot:github:m2')} -->")
    row = message_row(db, scoped(bot.id, "req-bot:github:m2"))
    assert row is not None and (row["status"], row["external_id"]) == ("sent", str(comment["id"]))
    assert row["external_url"] == comment["html_url"]
    with psycopg.connect(db.libpq_url) as conn:
        log = conn.execute("SELECT key, how FROM delivery_log ORDER BY id").fetchall()
    assert sorted(log) == [
        (scoped(bot.id, "req-bot:github:m2"), "sent"),
        (scoped(bot.id, "req-bot:slack:m1"), "sent"),
        (scoped(bot.id, "req-bot:slack:m3"), "sent"),
    ]
    assert stats(db)["max_deliveries_per_key"] == 1


def test_a_rolled_back_transition_emits_nothing_and_a_duplicate_emit_is_suppressed(
    client: Client, db: Database
) -> None:
    agent = client.create_agent("bot")
    client.submit(agent.id, "req-1", None, operation="noop")

    def boom(cur: Any, before: Any, after: Any) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        transition(db, Command(agent.id, Event.PROGRESS, "w", messages=(slack_msg("C1", "m1"),)), effects=boom)
    key = scoped(agent.id, "req-1:slack:m1")
    assert message_row(db, key) is None
    transition(db, Command(agent.id, Event.PROGRESS, "w", messages=(slack_msg("C1", "m1"),)))
    transition(db, Command(agent.id, Event.PROGRESS, "w", messages=(slack_msg("C1", "m1", "changed"),)))
    row = message_row(db, key)
    assert row is not None and row["payload"] == {"text": "hello"}
    assert client.journal(agent_id=agent.id)[-1].details["messages_suppressed"] == [key]


@pytest.mark.parametrize("fault", ["apply_then_timeout", "apply_then_drop", "500", "apply_then_internal_error"])
def test_an_unknown_outcome_is_reconciled_not_resent(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, fault: str
) -> None:
    slack.faults = github.faults = lambda dest, key, attempt: fault if attempt == 1 else None
    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "s"), gh_msg("acme/api#7", "g"))
    drain(relay(db, slack, github), pause=0.3)
    applied = fault != "500"  # a 500 refuses without applying: the reconcile finds nothing and sends
    if fault == "apply_then_internal_error":  # a Slack-only fault: GitHub answered normally
        github_key = scoped(bot.id, "req-bot:github:g")
        assert github.delivered_keys()[github_key] == 1
    pairs = [(slack, scoped(bot.id, "req-bot:slack:s"))] + (
        [] if fault == "apply_then_internal_error" else [(github, scoped(bot.id, "req-bot:github:g"))]
    )
    for fake, key in pairs:
        assert fake.delivered_keys()[key] == 1
        row = message_row(db, key)
        assert row is not None and row["status"] == "sent"
        with psycopg.connect(db.libpq_url) as conn:
            how = conn.execute("SELECT how FROM delivery_log WHERE key = %s", (key,)).fetchall()
        assert how == ([("reconciled",)] if applied else [("sent",)]), (key, how, row["last_error"])


def test_reconciliation_pages_through_a_busy_issue(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    for n in range(150):  # people talk on the issue: the marker will be past the first page
        github.comments.setdefault("acme/api#7", []).append(
            {
                "id": n,
                "body": f"chatter {n}",
                "html_url": "x",
                "created_at": "2026-01-01T00:00:00Z",
                "updated_at": "2099-01-01T00:00:00Z",
            }
        )
    github.faults = lambda dest, key, attempt: "apply_then_drop" if attempt == 1 else None
    bot = client.create_agent("bot")
    emit(client, "bot", gh_msg("acme/api#7", "g"))
    drain(relay(db, slack, github), pause=0.3)
    assert github.delivered_keys()[scoped(bot.id, "req-bot:github:g")] == 1
    with psycopg.connect(db.libpq_url) as conn:
        assert conn.execute("SELECT how FROM delivery_log").fetchall() == [("reconciled",)]


def test_a_token_never_appears_in_logs_or_error_text(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, caplog: pytest.LogCaptureFixture
) -> None:
    slack.faults = lambda dest, key, attempt: "echo_token_500" if attempt == 1 else None
    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "s"))
    caplog.set_level(logging.DEBUG)
    r = relay(db, slack, github)
    r.run_pass()
    row = message_row(db, scoped(bot.id, "req-bot:slack:s"))
    assert row is not None and row["status"] == "pending" and "HTTP 500" in row["last_error"]
    drain(r, pause=0.2)
    with psycopg.connect(db.libpq_url) as conn:
        stored = conn.execute("SELECT coalesce(string_agg(coalesce(last_error, ''), ' '), '') FROM outbox").fetchone()
        journal = conn.execute("SELECT string_agg(details::text, ' ') FROM audit.journal").fetchone()
    for text in (caplog.text, stored[0] if stored else "", journal[0] if journal else ""):
        assert SLACK_TOKEN not in text and GITHUB_TOKEN not in text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (lambda: MessageSpec("email", "x", "t", {"text": "x"}), "channel 'email' is unknown"),
        (lambda: MessageSpec("slack", "#general", "t", {"text": "x"}), "expected a conversation id"),
        (lambda: MessageSpec("github", "not-an-issue", "t", {"body": "x"}), "expected owner/repo#number"),
        (lambda: MessageSpec("slack", "C1", "t", {"text": ""}), r"needs a non-empty payload\['text'\]"),
        (lambda: MessageSpec("slack", "C1", "bad target", {"text": "x"}), "target 'bad target' is invalid"),
        (lambda: MessageSpec("github", "o/r#1", "t", {"body": "x" * 70_000}), "at most 65000 characters"),
    ],
)
def test_malformed_messages_are_refused(spec: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        spec()


def test_outbox_commands_and_kpis(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, db_url: str
) -> None:
    import json
    import subprocess

    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "ok"), slack_msg("CMISSING3", "bad"))
    slack.faults = lambda dest, key, attempt: "apply_then_drop" if key.endswith(":ok") and attempt == 1 else None
    drain(relay(db, slack, github), pause=0.3)
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_keel(args, env, "/")

    listed = json.loads(run("outbox", "list", "--status", "dead", "--json").stdout)
    assert [m["key"] for m in listed["messages"]] == [scoped(bot.id, "req-bot:slack:bad")]
    shown = json.loads(run("outbox", "show", scoped(bot.id, "req-bot:slack:ok"), "--json").stdout)
    assert (shown["status"], shown["destination"]) == ("sent", "C1") and shown["external_id"]
    assert (shown["attempts"], shown["rate_limited_attempts"]) == (2, 0)
    kpis = json.loads(run("outbox", "stats", "--json").stdout)
    assert (kpis["max_deliveries_per_key"], kpis["reconciled"], kpis["dead"]) == (1, 1, 1)
    assert kpis["duplicate_rate"] == 0.0
    retried = run("outbox", "retry", scoped(bot.id, "req-bot:slack:bad"), "--actor", "ops")
    assert retried.returncode == 0 and "dead -> pending" in retried.stdout
    again = run("outbox", "retry", scoped(bot.id, "req-bot:slack:bad"))
    assert again.returncode == 1 and "is pending, not dead" in again.stderr
    assert "no outbox message has the key" in run("outbox", "show", "nope").stderr

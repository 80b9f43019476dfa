"""The outbox against local fake Slack and GitHub servers: exactly one message per key, in order, through faults."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.commands import Command, MessageSpec
from agents.core import transition
from agents.errors import InvalidInput
from agents.outbox import Backoff, Relay, retry_dead
from agents.phases import Event
from agents.receivers import GitHubReceiver, SlackReceiver
from models.db import Database
from models.outbox_sql import message_row, stats
from tests.support.fakes import FakeGitHub, FakeSlack

pytestmark = pytest.mark.integration

SLACK_TOKEN = "xoxb-test-5ecret-slack-token"
GITHUB_TOKEN = "ghp_test5ecretGithubToken"


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(token=SLACK_TOKEN, timeout_delay=1.5, retry_after=1.0)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def github() -> Iterator[FakeGitHub]:
    fake = FakeGitHub(token=GITHUB_TOKEN, timeout_delay=1.5, retry_after=1.0)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(autouse=True)
def _close_relays() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()


OPEN: list[Relay] = []


def relay(db: Database, slack: FakeSlack, github: FakeGitHub, **kw: Any) -> Relay:
    made = Relay(
        db,
        {
            "slack": SlackReceiver(SLACK_TOKEN, f"{slack.url}/api/", timeout=1.0),
            "github": GitHubReceiver(GITHUB_TOKEN, github.url, timeout=1.0),
        },
        lease=timedelta(seconds=10),
        concurrency=kw.pop("concurrency", 8),
        backoff=Backoff(0.05, 0.2, kw.pop("max_attempts", 6)),
        pass_seconds=10,
        secrets=(SLACK_TOKEN, GITHUB_TOKEN),
    )
    OPEN.append(made)
    return made


def emit(client: Client, agent: str, *messages: MessageSpec) -> None:
    state = client.get_state(agent)
    if state.phase == "idle":
        client.submit(agent, f"req-{agent}", None, operation="noop")
    transition(client.db, Command(client.get_state(agent).id, Event.PROGRESS, "worker", messages=messages))


def slack_msg(channel: str, target: str, text: str = "hello") -> MessageSpec:
    return MessageSpec("slack", channel, target, {"text": text})


def gh_msg(issue: str, target: str, body: str = "hello") -> MessageSpec:
    return MessageSpec("github", issue, target, {"body": body})


def drain(r: Relay, rounds: int = 40, pause: float = 0.1) -> None:
    for _ in range(rounds):
        r.run_pass()
        with psycopg.connect(r.db.libpq_url) as conn:
            row = conn.execute("SELECT count(*) FROM outbox WHERE status IN ('pending', 'sending')").fetchone()
        if row == (0,):
            return
        time.sleep(pause)
    raise AssertionError("the outbox did not drain")


def test_messages_are_delivered_once_with_their_keys_and_confirmed(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "m1"), gh_msg("acme/api#7", "m2"), slack_msg("C1", "m3"))
    drain(relay(db, slack, github))
    assert slack.order("C1") == ["req-bot:slack:m1", "req-bot:slack:m3"]
    assert github.order("acme/api#7") == ["req-bot:github:m2"]
    comment = github.comments["acme/api#7"][0]
    assert comment["body"].endswith("<!-- keel:req-bot:github:m2 -->")
    row = message_row(db, "req-bot:github:m2")
    assert row is not None and (row["status"], row["external_id"]) == ("sent", str(comment["id"]))
    assert row["external_url"] == comment["html_url"]
    with psycopg.connect(db.libpq_url) as conn:
        log = conn.execute("SELECT key, how FROM delivery_log ORDER BY id").fetchall()
    assert sorted(log) == [("req-bot:github:m2", "sent"), ("req-bot:slack:m1", "sent"), ("req-bot:slack:m3", "sent")]
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
    assert message_row(db, "req-1:slack:m1") is None
    transition(db, Command(agent.id, Event.PROGRESS, "w", messages=(slack_msg("C1", "m1"),)))
    transition(db, Command(agent.id, Event.PROGRESS, "w", messages=(slack_msg("C1", "m1", "changed"),)))
    row = message_row(db, "req-1:slack:m1")
    assert row is not None and row["payload"] == {"text": "hello"}
    assert client.journal(agent_id=agent.id)[-1].details["messages_suppressed"] == ["req-1:slack:m1"]


@pytest.mark.parametrize("fault", ["apply_then_timeout", "apply_then_drop", "500", "apply_then_internal_error"])
def test_an_unknown_outcome_is_reconciled_not_resent(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, fault: str
) -> None:
    slack.faults = github.faults = lambda dest, key, attempt: fault if attempt == 1 else None
    client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "s"), gh_msg("acme/api#7", "g"))
    drain(relay(db, slack, github), pause=0.3)
    applied = fault != "500"  # a 500 refuses without applying: the reconcile finds nothing and sends
    if fault == "apply_then_internal_error":  # a Slack-only fault: GitHub answered normally
        github_key = "req-bot:github:g"
        assert github.delivered_keys()[github_key] == 1
    pairs = [(slack, "req-bot:slack:s")] + (
        [] if fault == "apply_then_internal_error" else [(github, "req-bot:github:g")]
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
    client.create_agent("bot")
    emit(client, "bot", gh_msg("acme/api#7", "g"))
    drain(relay(db, slack, github), pause=0.3)
    assert github.delivered_keys()["req-bot:github:g"] == 1
    with psycopg.connect(db.libpq_url) as conn:
        assert conn.execute("SELECT how FROM delivery_log").fetchall() == [("reconciled",)]


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (slack_msg("CMISSING", "x"), "slack: channel_not_found"),
        (slack_msg("COUTSIDE", "x"), "slack: not_in_channel"),
        (gh_msg("acme/missing#1", "x"), "github: HTTP 404 Not Found"),
        (gh_msg("acme/api#1", "x", "[reject-422] too long"), "github: HTTP 422 Validation Failed"),
    ],
)
def test_permanent_errors_are_dead_at_once_with_the_reason(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, message: MessageSpec, reason: str
) -> None:
    client.create_agent("bot")
    emit(client, "bot", message)
    relay(db, slack, github).run_pass()
    row = message_row(db, f"req-bot:{message.channel}:x")
    assert row is not None and (row["status"], row["attempts"], row["last_error"]) == ("dead", 1, reason)


def test_bad_credentials_are_permanent_too(client: Client, db: Database, slack: FakeSlack, github: FakeGitHub) -> None:
    client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "s"), gh_msg("acme/api#1", "g"))
    wrong = Relay(
        db,
        {
            "slack": SlackReceiver("xoxb-wrong", f"{slack.url}/api/", 1.0),
            "github": GitHubReceiver("nope", github.url, 1.0),
        },
        lease=timedelta(seconds=10),
        concurrency=2,
        backoff=Backoff(0.05, 0.1, 3),
        pass_seconds=5,
    )
    OPEN.append(wrong)
    wrong.run_pass()
    assert message_row(db, "req-bot:slack:s")["last_error"] == "slack: invalid_auth"  # type: ignore[index]
    assert message_row(db, "req-bot:github:g")["last_error"] == "github: HTTP 401 Bad credentials"  # type: ignore[index]


def test_keel_outbox_retry_sends_a_dead_message_once_and_journals_who(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    client.create_agent("bot")
    emit(client, "bot", slack_msg("CMISSING2", "x"))
    r = relay(db, slack, github)
    r.run_pass()
    assert message_row(db, "req-bot:slack:x")["status"] == "dead"  # type: ignore[index]
    with pytest.raises(InvalidInput, match="no outbox message has the key"):
        retry_dead(db, "nope:slack:x", actor="ops")
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:  # the channel was fixed: point it elsewhere
        conn.execute("UPDATE outbox SET destination = 'C9' WHERE key = 'req-bot:slack:x'")
    retry_dead(db, "req-bot:slack:x", actor="alice")
    event = client.journal(agent_id="bot")[-1]
    assert (event.kind, event.event, event.actor, event.details["key"]) == (
        "operator",
        "outbox_retry",
        "alice",
        "req-bot:slack:x",
    )
    with pytest.raises(InvalidInput, match="not dead"):
        retry_dead(db, "req-bot:slack:x", actor="alice")
    drain(r)
    assert slack.delivered_keys() == {"req-bot:slack:x": 1}


def test_a_rate_limit_holds_its_destination_only_and_order_holds(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    limited = {"req-bot:slack:a1"}
    slack.faults = lambda dest, key, attempt: "429" if key in limited and attempt == 1 else None
    github.faults = lambda dest, key, attempt: "403_secondary" if key == "req-bot:github:g1" and attempt == 1 else None
    client.create_agent("bot")
    emit(client, "bot", slack_msg("CA", "a1"), slack_msg("CA", "a2"), slack_msg("CB", "b1"), gh_msg("o/r#1", "g1"))
    r = relay(db, slack, github)
    r.run_pass()
    # B went out at once; A's line waits behind its rate-limited head, a2 does not overtake a1.
    assert slack.order("CB") == ["req-bot:slack:b1"] and slack.order("CA") == []
    row = message_row(db, "req-bot:slack:a1")
    assert row is not None and row["status"] == "pending" and "retry after 1s" in row["last_error"]
    assert "secondary" in message_row(db, "req-bot:github:g1")["last_error"]  # type: ignore[index]
    started = time.monotonic()
    drain(r, pause=0.1)
    assert time.monotonic() - started >= 0.8, "Retry-After was not honoured"
    assert slack.order("CA") == ["req-bot:slack:a1", "req-bot:slack:a2"]
    assert github.order("o/r#1") == ["req-bot:github:g1"]


def test_a_token_never_appears_in_logs_or_error_text(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, caplog: pytest.LogCaptureFixture
) -> None:
    slack.faults = lambda dest, key, attempt: "echo_token_500" if attempt == 1 else None
    client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "s"))
    caplog.set_level(logging.DEBUG)
    r = relay(db, slack, github)
    r.run_pass()
    row = message_row(db, "req-bot:slack:s")
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
    import os
    import subprocess
    import sys
    from pathlib import Path

    client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "ok"), slack_msg("CMISSING3", "bad"))
    slack.faults = lambda dest, key, attempt: "apply_then_drop" if key.endswith(":ok") and attempt == 1 else None
    drain(relay(db, slack, github), pause=0.3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env["KEEL_DATABASE_URL"] = db_url
    keel = str(Path(sys.executable).parent / "keel")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([keel, *args], env=env, capture_output=True, text=True, timeout=60, cwd="/")

    listed = json.loads(run("outbox", "list", "--status", "dead", "--json").stdout)
    assert [m["key"] for m in listed["messages"]] == ["req-bot:slack:bad"]
    shown = json.loads(run("outbox", "show", "req-bot:slack:ok", "--json").stdout)
    assert (shown["status"], shown["destination"]) == ("sent", "C1") and shown["external_id"]
    kpis = json.loads(run("outbox", "stats", "--json").stdout)
    assert (kpis["max_deliveries_per_key"], kpis["reconciled"], kpis["dead"]) == (1, 1, 1)
    assert kpis["duplicate_rate"] == 0.0
    retried = run("outbox", "retry", "req-bot:slack:bad", "--actor", "ops")
    assert retried.returncode == 0 and "dead -> pending" in retried.stdout
    again = run("outbox", "retry", "req-bot:slack:bad")
    assert again.returncode == 1 and "is pending, not dead" in again.stderr
    assert "no outbox message has the key" in run("outbox", "show", "nope").stderr


def test_a_relay_whose_run_outlives_its_lease_stops_instead_of_racing_another(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    """Slow answers, a short lease and two relays on one line: still one delivery per key, in order."""
    import threading

    slack.timeout_delay = 1.6  # "slow" answers take 0.4 s, inside the HTTP timeout
    slack.faults = lambda dest, key, attempt: "slow"
    client.create_agent("bot")
    emit(client, "bot", *[slack_msg("C1", f"m{n:02d}") for n in range(12)])

    def short_lease() -> Relay:
        made = relay(db, slack, github)
        made.lease = timedelta(seconds=1)
        return made

    first, second = short_lease(), short_lease()
    thread = threading.Thread(target=first.run_pass)
    thread.start()
    time.sleep(1.3)
    second.run_pass()
    thread.join(30)
    drain(first, pause=0.2)
    assert slack.order("C1") == [f"req-bot:slack:m{n:02d}" for n in range(12)]


def test_emitters_to_one_destination_take_turns(client: Client, db: Database) -> None:
    """Creation order is commit order: an emitter waits while another transaction holds the destination's line."""
    import threading

    agent = client.create_agent("bot")
    client.submit(agent.id, "req-1", None, operation="noop")
    done = threading.Event()
    with psycopg.connect(db.libpq_url) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(hashtextextended('keel-outbox:C7', 7))")
        thread = threading.Thread(
            target=lambda: (
                transition(db, Command(agent.id, Event.PROGRESS, "w", messages=(slack_msg("C7", "m"),))),
                done.set(),
            )
        )
        thread.start()
        assert not done.wait(0.8), "the emitter did not wait for the line"
        holder.rollback()
    assert done.wait(10)
    thread.join(10)

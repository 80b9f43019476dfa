"""The outbox against local fake Slack and GitHub servers: exactly one message per key, in order, through faults."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core import transition as core
from agents.core.commands import Command, MessageSpec
from agents.core.errors import InvalidInput
from agents.core.phases import Event
from agents.core.transition import transition
from agents.jobs.handlers import registry
from agents.outbox.relay import Backoff, Relay, retry_dead
from agents.outbox.senders import GitHubSender, SlackSender
from models.db import Database
from models.outbox_sql import NewMessage, insert_messages_txn, message_row, stats
from tests.support.audit import clean_env
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

# The jobs here are never run: the client only needs to know the operation.
for _operation in ("noop",):
    registry.declare(_operation)

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
            "slack": SlackSender(SLACK_TOKEN, f"{slack.url}/api/", timeout=1.0),
            "github": GitHubSender(GITHUB_TOKEN, github.url, timeout=1.0),
        },
        lease=kw.pop("lease", timedelta(seconds=10)),
        concurrency=kw.pop("concurrency", 8),
        backoff=Backoff(0.05, 0.2, kw.pop("max_attempts", 6), kw.pop("max_rate_limited", 200)),
        pass_seconds=10,
        secrets=(SLACK_TOKEN, GITHUB_TOKEN),
        **kw,
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
    bot = client.create_agent("bot")
    emit(client, "bot", message)
    relay(db, slack, github).run_pass()
    row = message_row(db, scoped(bot.id, f"req-bot:{message.channel}:x"))
    assert row is not None and (row["status"], row["attempts"], row["last_error"]) == ("dead", 1, reason)


def test_bad_credentials_are_permanent_too(client: Client, db: Database, slack: FakeSlack, github: FakeGitHub) -> None:
    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "s"), gh_msg("acme/api#1", "g"))
    wrong = Relay(
        db,
        {
            "slack": SlackSender("xoxb-wrong", f"{slack.url}/api/", 1.0),
            "github": GitHubSender("nope", github.url, 1.0),
        },
        lease=timedelta(seconds=10),
        concurrency=2,
        backoff=Backoff(0.05, 0.1, 3),
        pass_seconds=5,
    )
    OPEN.append(wrong)
    wrong.run_pass()
    assert message_row(db, scoped(bot.id, "req-bot:slack:s"))["last_error"] == "slack: invalid_auth"  # type: ignore[index]
    assert message_row(db, scoped(bot.id, "req-bot:github:g"))["last_error"] == "github: HTTP 401 Bad credentials"  # type: ignore[index]


def test_keel_outbox_retry_sends_a_dead_message_once_and_journals_who(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("CMISSING2", "x"))
    r = relay(db, slack, github)
    r.run_pass()
    assert message_row(db, scoped(bot.id, "req-bot:slack:x"))["status"] == "dead"  # type: ignore[index]
    with pytest.raises(InvalidInput, match="no outbox message has the key"):
        retry_dead(db, "nope:slack:x", actor="ops")
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:  # the channel was fixed: point it elsewhere
        conn.execute("UPDATE outbox SET destination = 'C9' WHERE key = %s", (scoped(bot.id, "req-bot:slack:x"),))
    retry_dead(db, scoped(bot.id, "req-bot:slack:x"), actor="alice")
    event = client.journal(agent_id="bot")[-1]
    assert (event.kind, event.event, event.actor, event.details["key"]) == (
        "operator",
        "outbox_retry",
        "alice",
        scoped(bot.id, "req-bot:slack:x"),
    )
    with pytest.raises(InvalidInput, match="not dead"):
        retry_dead(db, scoped(bot.id, "req-bot:slack:x"), actor="alice")
    drain(r)
    assert slack.delivered_keys() == {scoped(bot.id, "req-bot:slack:x"): 1}


def test_a_rate_limit_holds_its_destination_only_and_order_holds(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    bot = client.create_agent("bot")
    limited = {scoped(bot.id, "req-bot:slack:a1")}
    g1 = scoped(bot.id, "req-bot:github:g1")
    slack.faults = lambda dest, key, attempt: "429" if key in limited and attempt == 1 else None
    github.faults = lambda dest, key, attempt: "403_secondary" if key == g1 and attempt == 1 else None
    emit(client, "bot", slack_msg("CA", "a1"), slack_msg("CA", "a2"), slack_msg("CB", "b1"), gh_msg("o/r#1", "g1"))
    r = relay(db, slack, github)
    r.run_pass()
    # B went out at once; A's line waits behind its rate-limited head, a2 does not overtake a1.
    assert slack.order("CB") == [scoped(bot.id, "req-bot:slack:b1")] and slack.order("CA") == []
    row = message_row(db, scoped(bot.id, "req-bot:slack:a1"))
    assert row is not None and row["status"] == "pending" and "retry after 1s" in row["last_error"]
    assert "secondary" in message_row(db, scoped(bot.id, "req-bot:github:g1"))["last_error"]  # type: ignore[index]
    started = time.monotonic()
    drain(r, pause=0.1)
    assert time.monotonic() - started >= 0.8, "Retry-After was not honoured"
    assert slack.order("CA") == [scoped(bot.id, "req-bot:slack:a1"), scoped(bot.id, "req-bot:slack:a2")]
    assert github.order("o/r#1") == [scoped(bot.id, "req-bot:github:g1")]


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
    import sys
    from pathlib import Path

    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "ok"), slack_msg("CMISSING3", "bad"))
    slack.faults = lambda dest, key, attempt: "apply_then_drop" if key.endswith(":ok") and attempt == 1 else None
    drain(relay(db, slack, github), pause=0.3)
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url
    keel = str(Path(sys.executable).parent / "keel")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([keel, *args], env=env, capture_output=True, text=True, timeout=60, cwd="/")

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


def test_a_relay_whose_run_outlives_its_lease_stops_instead_of_racing_another(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    """Slow answers, a short lease and two relays on one line: still one delivery per key, in order."""
    import threading

    slack.timeout_delay = 1.6  # "slow" answers take 0.4 s, inside the HTTP timeout
    slack.faults = lambda dest, key, attempt: "slow"
    bot = client.create_agent("bot")
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
    assert slack.order("C1") == [scoped(bot.id, f"req-bot:slack:m{n:02d}") for n in range(12)]


def test_an_emitter_does_not_wait_for_another_on_the_same_destination(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    """No lock on a line held to commit: a transaction still open with a message to C7 (an earlier seq) holds up
    neither another emitter to C7 nor the relay; its message goes once it commits, after it, once each."""
    import threading

    first, second = client.create_agent("first"), client.create_agent("second")
    client.submit(first.id, "req-first", None, operation="noop")
    client.submit(second.id, "req-second", None, operation="noop")
    done = threading.Event()
    with psycopg.connect(db.libpq_url) as holder:
        early_key, late_key = scoped(first.id, "req-first:slack:early"), scoped(second.id, "req-second:slack:late")
        early = NewMessage(early_key, first.id, "req-first", "slack", "C7", {"text": "hi"})
        assert insert_messages_txn(holder.cursor(), [early]) == ([early_key], [])
        thread = threading.Thread(
            target=lambda: (
                transition(db, Command(second.id, Event.PROGRESS, "w", messages=(slack_msg("C7", "late"),))),
                done.set(),
            )
        )
        thread.start()
        assert done.wait(10), "the emitter waited for another transaction on its destination"
        thread.join(10)
        r = relay(db, slack, github)
        r.run_pass()
        assert slack.order("C7") == [late_key], "the relay waited for a transaction in flight"
        holder.commit()
    drain(r)
    assert slack.order("C7") == [late_key, early_key]
    assert set(slack.delivered_keys().values()) == {1}


def test_a_pass_looks_at_a_bounded_number_of_lines_and_each_gets_its_turn(client: Client, db: Database) -> None:
    """The relay's pass walks the lines' heads a bounded number at a time, going on from where the last pass
    stopped: every due line comes up, a line whose head waits out a backoff never does (nor its followers)."""
    from models.outbox_sql import due_destinations

    bot = client.create_agent("bot")
    emit(client, "bot", *[slack_msg(f"C{n}", f"m{n}-{i}") for n in range(7) for i in range(3)])
    sql(
        db,
        "UPDATE outbox SET next_attempt_at = now() + interval '1 hour' WHERE key = %s",
        scoped(bot.id, "req-bot:slack:m3-0"),
    )
    seen: list[str] = []
    cursor = ""
    for _ in range(4):
        found, cursor = due_destinations(db, 2, after=cursor, probes=3)
        assert len(found) <= 2
        seen += found
    assert set(seen) == {"C0", "C1", "C2", "C4", "C5", "C6"}, seen
    # A whole walk in one pass when it may look at every line: the due heads, oldest first.
    assert due_destinations(db, 10) == (["C0", "C1", "C2", "C4", "C5", "C6"], "")


def test_a_due_line_behind_many_backing_off_ones_is_sent_in_one_pass(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    """Six lines whose heads wait out a backoff (their receiver away) before the one due line, and a pass that looks
    at two heads per walk: the pass walks on until it finds it (it used to look at two and stop: a due line waited
    lines / probes passes behind the backing-off ones)."""
    bot = client.create_agent("bot")
    emit(client, "bot", *[slack_msg(f"C{n}", f"m{n}") for n in range(7)])
    sql(db, "UPDATE outbox SET next_attempt_at = now() + interval '1 hour' WHERE destination <> 'C6'")
    assert relay(db, slack, github, head_probes=2, walks=1).run_pass().sent == 0, "one walk alone stops at two"
    assert relay(db, slack, github, head_probes=2, walks=4).run_pass().sent == 1
    assert slack.order("C6") == [scoped(bot.id, "req-bot:slack:m6")]


def test_a_pass_over_lines_that_all_back_off_stops_once_it_has_come_round(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five lines, every head backing off, two heads per walk: the pass stops when its walks come round (three
    walks), not after all sixteen going over the same lines again."""
    import agents.outbox.relay as relay_module

    client.create_agent("bot")
    emit(client, "bot", *[slack_msg(f"C{n}", f"m{n}") for n in range(5)])
    sql(db, "UPDATE outbox SET next_attempt_at = now() + interval '1 hour'")
    walks: list[str] = []
    real = relay_module.due_destinations

    def counting(*args: Any, **kwargs: Any) -> Any:
        walks.append(kwargs["after"])
        return real(*args, **kwargs)

    monkeypatch.setattr(relay_module, "due_destinations", counting)
    assert relay(db, slack, github, head_probes=2, walks=16).run_pass().sent == 0
    assert walks == ["", "C1", "C3"], walks


# --- one clock, fencing, bounded reconciliation, rate limits ------------------------------------------------------


def sql(db: Database, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


@pytest.mark.parametrize("offset", [timedelta(minutes=5), timedelta(minutes=-5)], ids=["fast", "slow"])
def test_a_relay_whose_clock_is_off_sends_on_time_and_never_takes_over_a_live_lease(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, monkeypatch: pytest.MonkeyPatch, offset: Any
) -> None:
    """Due, backoff and lease are decided on the database's clock: the relay host's clock does not matter."""
    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "early"), slack_msg("C2", "due"), slack_msg("C3", "held"))
    early, due, held = (scoped(bot.id, f"req-bot:slack:{t}") for t in ("early", "due", "held"))
    sql(db, "UPDATE outbox SET next_attempt_at = now() + interval '2 minutes' WHERE key = %s", early)
    sql(db, "UPDATE outbox SET next_attempt_at = now() - interval '1 second' WHERE key = %s", due)
    # Another relay is sending this one right now: its lease runs for another minute.
    sql(
        db,
        "UPDATE outbox SET status = 'sending', attempts = 1, claim_token = 7, lease_until = now() + interval '1 minute'"
        " WHERE key = %s",
        held,
    )
    monkeypatch.setattr(core, "now", lambda: datetime.now(UTC) + offset)
    emit(client, "bot", slack_msg("C4", "fresh"))  # emitted by a host whose clock is off too
    relay(db, slack, github).run_pass()
    assert slack.order("C1") == [], "sent before its backoff ended"
    assert slack.order("C2") == [scoped(bot.id, "req-bot:slack:due")], "a due message was held back"
    assert slack.order("C3") == [], "took over a live lease"
    assert slack.order("C4") == [scoped(bot.id, "req-bot:slack:fresh")], "a fresh message was held back"
    assert sql(db, "SELECT status, claim_token FROM outbox WHERE key = %s", held) == [("sending", 7)]
    (times,) = sql(
        db,
        "SELECT bool_and(updated_at BETWEEN now() - interval '1 minute' AND now() + interval '1 second')"
        " AND bool_and(sent_at BETWEEN now() - interval '1 minute' AND now() + interval '1 second') FROM outbox"
        " WHERE status = 'sent'",
    )
    assert times == (True,), "stored times are not the database's"
    (logged,) = sql(db, "SELECT bool_and(confirmed_at BETWEEN now() - interval '1 minute' AND now()) FROM delivery_log")
    assert logged == (True,)


def test_a_relay_whose_claim_was_taken_over_mid_run_neither_sends_nor_confirms(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    bot = client.create_agent("bot")
    emit(client, "bot", *[slack_msg("C1", f"m{n}") for n in range(3)])

    def take_over(dest: str, key: str, attempt: int) -> None:
        # While the first message is on its way, another relay takes the line over (this one stalled).
        if key.endswith(":m0"):
            sql(db, "UPDATE outbox SET claim_token = claim_token + 100, lease_until = now() + interval '1 minute'")
        return None

    slack.faults = take_over
    report = relay(db, slack, github).run_pass()
    assert slack.attempts == {scoped(bot.id, "req-bot:slack:m0"): 1}, "sent after its claim was lost"
    assert sql(db, "SELECT count(*) FROM delivery_log") == [(0,)], "confirmed after its claim was lost"
    assert sql(db, "SELECT DISTINCT status FROM outbox") == [("sending",)]
    assert report.lost >= 1 and report.sent == 0


def _chatter(github: FakeGitHub, issue: str, n: int) -> None:
    for i in range(n):  # people talk on the issue after the message was created
        github.comments.setdefault(issue, []).append(
            {
                "id": i,
                "body": f"chatter {i}",
                "html_url": "x",
                "created_at": "2099-01-01T00:00:00Z",
                "updated_at": "2099-01-01T00:00:00Z",
            }
        )


def test_reconciliation_reads_at_most_its_page_cap_then_backs_off_and_dies_ambiguous(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    _chatter(github, "acme/api#7", 450)  # five pages of 100, the key is on none of them
    github.faults = lambda dest, key, attempt: "500" if attempt == 1 else None
    bot = client.create_agent("bot")
    emit(client, "bot", gh_msg("acme/api#7", "g"))
    drain(relay(db, slack, github, max_attempts=3, reconcile_pages=2), pause=0.2)
    key = scoped(bot.id, "req-bot:github:g")
    assert github.attempts[key] == 1, "sent blind although reconciliation gave no answer"
    assert github.pages_read == 4, "two reconciliations of at most two pages each"
    row = message_row(db, key)
    assert row is not None and (row["status"], row["needs_reconcile"]) == ("dead", True)
    assert "gave up after 3 attempts" in row["last_error"] and "2 pages" in row["last_error"]
    retry_dead(db, key, actor="ops")  # the operator's retry reconciles first, this time with room to look
    assert message_row(db, key)["needs_reconcile"] is True  # type: ignore[index]
    drain(relay(db, slack, github, reconcile_pages=10), pause=0.2)
    assert github.delivered_keys()[key] == 1 and github.attempts[key] == 2


def test_a_reconciliation_slower_than_the_lease_never_ends_in_a_send(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    _chatter(github, "acme/api#7", 950)  # ten pages
    unfenced: list[str] = []

    def check_fence(dest: str, k: str, attempt: int) -> str | None:
        # Every send must reach the receiver while its sender holds a live lease on the message.
        if attempt > 1 and sql(db, "SELECT lease_until > clock_timestamp() FROM outbox WHERE key = %s", k) != [(True,)]:
            unfenced.append(k)
        return "500" if attempt == 1 else None

    github.faults = check_fence
    bot = client.create_agent("bot")
    key = scoped(bot.id, "req-bot:github:g")
    emit(client, "bot", gh_msg("acme/api#7", "g"))
    github.page_delay = 0.3  # ten pages take 3 s: longer than the lease
    slow = relay(db, slack, github, lease=timedelta(seconds=2), max_attempts=2)
    drain(slow, pause=0.2)
    assert unfenced == [] and github.attempts[key] == 1
    row = message_row(db, key)
    assert row is not None and (row["status"], row["needs_reconcile"]) == ("dead", True)
    assert github.pages_read <= 2 * 3, "each reconciliation stopped within its time budget"
    retry_dead(db, key, actor="ops")
    github.page_delay = 0.0
    drain(slow, pause=0.2)
    assert unfenced == [] and github.delivered_keys()[key] == 1


def test_rate_limits_do_not_use_up_the_attempts(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    """Eleven 429s, then a 5xx: the message is still retried (12 attempts allowed), and delivered once."""
    slack.retry_after = 0.05
    slack.faults = lambda dest, key, attempt: "429" if attempt <= 11 else "500" if attempt == 12 else None
    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "s"))
    drain(relay(db, slack, github, max_attempts=12), rounds=80, pause=0.05)
    row = message_row(db, scoped(bot.id, "req-bot:slack:s"))
    assert row is not None and row["status"] == "sent", row["last_error"]
    assert (row["attempts"], row["rate_limited_attempts"]) == (2, 11)
    assert slack.delivered_keys() == {scoped(bot.id, "req-bot:slack:s"): 1}


def test_endless_rate_limits_end_at_their_own_cap(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    slack.retry_after = 0.05
    slack.faults = lambda dest, key, attempt: "429"
    bot = client.create_agent("bot")
    emit(client, "bot", slack_msg("C1", "s"))
    drain(relay(db, slack, github, max_attempts=2, max_rate_limited=5), rounds=80, pause=0.05)
    row = message_row(db, scoped(bot.id, "req-bot:slack:s"))
    assert row is not None and (row["status"], row["attempts"], row["rate_limited_attempts"]) == ("dead", 0, 5)
    assert row["last_error"].startswith("rate limited 5 times (KEEL_OUTBOX_MAX_RATE_LIMITED):"), row["last_error"]
    assert row["needs_reconcile"] is False

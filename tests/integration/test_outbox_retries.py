"""Failed sends: a permanent error is dead at once with its reason, a rate limit holds its own line only and
counts toward a cap of its own, a reconciliation that cannot tell backs off within its page cap, and an
operator's retry sends a dead message once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from agents.client import Client
from agents.core.commands import MessageSpec
from agents.core.errors import InvalidInput
from agents.outbox.relay import Backoff, Relay, retry_dead
from agents.outbox.senders import GitHubSender, SlackSender
from models.db import Database
from models.outbox_sql import message_row
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped
from tests.support.outbox import (
    OPEN,
    chatter,
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


def test_reconciliation_reads_at_most_its_page_cap_then_backs_off_and_dies_ambiguous(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    chatter(github, "acme/api#7", 450)  # five pages of 100, the key is on none of them
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

"""Reconciliation counts only what Keel itself posted: a key planted at the receiver by someone else (another user on
the issue, another app's bot in the channel) is ignored, warned about, and the message is still delivered once."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from agents.client import Client
from models.db import Database
from models.outbox_sql import message_row
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped
from tests.support.outbox import GITHUB_TOKEN, OPEN, SLACK_TOKEN, drain, emit, gh_msg, relay, slack_msg

pytestmark = pytest.mark.integration


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


def confirmations(db: Database, key: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db.libpq_url) as conn:
        return conn.execute("SELECT how, external_id FROM delivery_log WHERE key = %s", (key,)).fetchall()


@pytest.mark.parametrize("fault", ["500", "apply_then_timeout"])
@pytest.mark.parametrize("channel", ["github", "slack"])
def test_a_key_planted_by_someone_else_is_ignored_and_the_message_delivered_once(
    client: Client,
    db: Database,
    slack: FakeSlack,
    github: FakeGitHub,
    caplog: pytest.LogCaptureFixture,
    channel: str,
    fault: str,
) -> None:
    """Someone who may post where Keel posts plants Keel's key there first; Keel's send then ends ambiguously
    (refused with a 5xx, or applied and timed out). Reconciliation must not take the planted message for Keel's:
    the message is sent (500) or found (applied) — Keel's own, once."""
    bot = client.create_agent("bot")
    key = scoped(bot.id, f"req-bot:{channel}:m")
    fake: FakeSlack | FakeGitHub
    if channel == "github":
        fake, destination = github, "acme/api#7"
        planted = str(github.plant(destination, key))
        message = gh_msg(destination, "m")
    else:
        fake, destination = slack, "C1"
        planted = slack.plant(destination, key)
        message = slack_msg(destination, "m")
    fake.faults = lambda dest, k, attempt: fault if attempt == 1 else None
    emit(client, "bot", message)
    caplog.set_level(logging.WARNING, logger="keel.outbox")
    drain(relay(db, slack, github), pause=0.3)

    assert fake.delivered_keys() == {key: 1}
    (own,) = [a.external_id for a in fake.accepted]
    assert own != planted
    row = message_row(db, key)
    assert row is not None and (row["status"], row["external_id"]) == ("sent", own), row["last_error"]
    assert confirmations(db, key) == [("reconciled" if fault != "500" else "sent", own)]
    if fault == "500":  # Keel's own was not there: the planted one was read, and reported
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(planted in w and "not Keel's" in w for w in warnings), warnings


def _wait_until_due(db: Database, key: str) -> None:
    """Wait (at most 10 s) until the message's retry is due on the database's clock: its backoff has passed."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with psycopg.connect(db.libpq_url) as conn:
            due = conn.execute("SELECT next_attempt_at <= now() FROM outbox WHERE key = %s", (key,)).fetchone()
        if due == (True,):
            return
        time.sleep(0.05)
    raise AssertionError(f"message {key} was not due again within 10 s")


@pytest.mark.parametrize("channel", ["github", "slack"])
def test_without_its_own_identity_reconciliation_waits_and_never_resends(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub, channel: str
) -> None:
    """A send ends ambiguously; a relay that cannot learn who it posts as (the receiver's ``GET /user`` or
    ``auth.test`` fails) neither records the message as delivered nor sends it again: it waits, and reconciles once
    the receiver says who it is."""
    key = scoped(client.create_agent("bot").id, f"req-bot:{channel}:m")
    fake: FakeSlack | FakeGitHub = github if channel == "github" else slack
    fake.faults = lambda dest, k, attempt: "apply_then_timeout" if attempt == 1 else None
    emit(client, "bot", gh_msg("acme/api#7", "m") if channel == "github" else slack_msg("C1", "m"))
    relay(db, slack, github).run_pass()  # the send: applied, no answer
    assert message_row(db, key)["needs_reconcile"] is True  # type: ignore[index]

    if channel == "github":
        github.user_status = 502
    else:
        slack.auth_error = "internal_error"
    fresh = relay(db, slack, github)  # a relay process started since: it has not learnt its identity yet
    _wait_until_due(db, key)
    fresh.run_pass()
    row = message_row(db, key)
    assert row is not None and row["status"] == "pending", row["status"]
    assert "cannot tell yet whether it arrived" in row["last_error"], row["last_error"]
    assert fake.attempts[key] == 1 and confirmations(db, key) == [], "resent or confirmed without its identity"

    github.user_status, slack.auth_error = None, None
    drain(fresh, pause=0.3)
    assert fake.delivered_keys() == {key: 1} and fake.attempts[key] == 1
    assert [how for how, _ in confirmations(db, key)] == ["reconciled"]


def test_the_identity_is_learnt_once_per_relay(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    slack.faults = github.faults = lambda dest, k, attempt: "apply_then_drop" if attempt == 1 else None
    client.create_agent("bot")
    slack_msgs = [slack_msg(f"C{n}", f"s{n}") for n in range(3)]
    emit(client, "bot", *slack_msgs, *[gh_msg(f"acme/api#{n}", f"g{n}") for n in range(1, 4)])
    drain(relay(db, slack, github), pause=0.3)
    with psycopg.connect(db.libpq_url) as conn:
        assert conn.execute("SELECT how, count(*) FROM delivery_log GROUP BY how").fetchall() == [("reconciled", 6)]
    assert (slack.auth_tests, github.user_requests) == (1, 1)


def test_a_github_app_installation_token_is_refused_with_the_reason(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    """An installation token cannot say whose comments are Keel's (``GET /user`` refuses it): Keel refuses to post
    with it, once, saying so, rather than post what it could never reconcile."""
    github.installation = True
    bot = client.create_agent("bot")
    emit(client, "bot", gh_msg("acme/api#7", "m"))
    relay(db, slack, github).run_pass()
    row = message_row(db, scoped(bot.id, "req-bot:github:m"))
    assert row is not None and row["status"] == "dead"
    assert "GitHub App installation token" in row["last_error"] and "403" in row["last_error"], row["last_error"]
    assert github.accepted == []

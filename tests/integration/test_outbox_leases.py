"""A relay's claim on the messages it sends: due times and leases on the database's clock, a claim taken over
mid-run, and runs or reconciliations that outlive their lease — never a send without a live claim."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agents.client import Client
from agents.core import transition as core
from agents.outbox.relay import Relay, retry_dead
from models.db import Database
from models.outbox_sql import message_row
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped
from tests.support.outbox import (
    chatter,
    close_relays,
    drain,
    emit,
    fake_github,
    fake_slack,
    gh_msg,
    relay,
    slack_msg,
    sql,
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


def test_a_reconciliation_slower_than_the_lease_never_ends_in_a_send(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    chatter(github, "acme/api#7", 950)  # ten pages
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

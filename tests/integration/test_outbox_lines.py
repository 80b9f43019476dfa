"""Destination lines: an emitter never waits for another on the same destination, and a relay pass looks at a
bounded number of line heads at a time, going on from where it stopped, so every due line gets its turn."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core.commands import Command
from agents.core.phases import Event
from agents.core.transition import transition
from models.db import Database
from models.outbox_sql import NewMessage, insert_messages_txn
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped
from tests.support.outbox import close_relays, drain, emit, fake_github, fake_slack, relay, slack_msg, sql

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

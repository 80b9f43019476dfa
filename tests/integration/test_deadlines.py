"""Deadline enforcement: per agent (one failure never spares the others), on the database's clock."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core import transition as core
from agents.core.commands import Command, JobSpec
from agents.core.phases import ACTIVE, Event
from agents.core.transition import now
from agents.jobs import deadlines
from agents.jobs.handlers import registry
from models.db import Database
from models.deadlines_sql import agents_past_deadline
from models.outbox_sql import message_row
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

# The jobs here are never run: the client only needs to know the operation.
for _operation in ("count",):
    registry.declare(_operation)


def _database_now(db: Database) -> datetime:
    with psycopg.connect(db.libpq_url) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value.astimezone(UTC)


def _two_past_their_hard_deadline(client: Client) -> tuple[Any, Any]:
    first, second = client.create_agent("first"), client.create_agent("second")
    for agent in (first, second):
        client.submit(agent.id, f"req-{agent.name}", None, operation="count", hard_deadline=timedelta(seconds=60))
    return first, second


def test_one_agent_whose_stop_fails_does_not_spare_the_others(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = _two_past_their_hard_deadline(client)
    real = core.transition

    def failing_for_first(db: Database, command: Command, **kw: Any) -> Any:
        if command.agent_id == first.id:
            raise RuntimeError("the hook of the first agent broke")
        return real(db, command, **kw)

    monkeypatch.setattr(core, "transition", failing_for_first)
    later = now() + timedelta(seconds=61)
    report = deadlines.enforce(db, later)
    assert (report.stopped, report.failed) == ([second.id], [first.id])
    assert client.get_state(second.id).phase == "failed"
    assert client.get_state(first.id).phase == "planning", "nothing changed on the agent whose move failed"
    failure = client.journal(agent_id=first.id)[-1]
    assert (failure.kind, failure.event, failure.decision) == ("rejected", "fail", "deadline_enforcement_failed")
    assert failure.details == {
        "error": "RuntimeError: the hook of the first agent broke",
        "move": "hard_deadline_passed",
    }
    # The same failure on every pass (every 5 s) is logged each time but journaled once: the journal is forever.
    assert deadlines.enforce(db, later + timedelta(seconds=5)).failed == [first.id]
    events = client.journal(agent_id=first.id)
    assert [e.decision for e in events].count("deadline_enforcement_failed") == 1
    # Once the fault is gone, the next pass stops it.
    monkeypatch.setattr(core, "transition", real)
    assert deadlines.enforce(db, later + timedelta(seconds=10)).stopped == [first.id]


def _sighted_past_their_deadlines(client: Client, db: Database, name: str, suffix: str) -> tuple[Any, Any, Any]:
    """Agents ``{name}hard`` and ``{name}soft`` on requests ``req-hard{suffix}`` / ``req-soft{suffix}`` with a hard and
    a soft deadline of a minute, and what a deadline pass a second past them reads (by kind), before it moves them."""
    hard, soft = client.create_agent(f"{name}hard"), client.create_agent(f"{name}soft")
    client.submit(hard.id, f"req-hard{suffix}", None, operation="count", hard_deadline=timedelta(seconds=60))
    client.submit(soft.id, f"req-soft{suffix}", None, operation="count", soft_deadline=timedelta(seconds=60))
    later = now() + timedelta(seconds=61)
    seen = {
        kind: agents_past_deadline(db, [p.value for p in ACTIVE], hard=kind == "hard", at=later, limit=10)
        for kind in ("hard", "soft")
    }
    return hard, soft, seen


def test_a_stale_sighting_never_stops_or_demotes_the_next_request(client: Client, db: Database) -> None:
    """A pass reads the agents past their deadlines, then moves them one by one: an agent whose request was
    cancelled and replaced in between (the next request has no deadline) must not be stopped or demoted for the
    old one's deadline (outside review: the move carried no revision)."""
    hard, soft, seen = _sighted_past_their_deadlines(client, db, "", "-1")
    assert [p.id for p in seen["hard"]] == [hard.id] and [p.id for p in seen["soft"]] == [soft.id]
    for agent, request in ((hard, "req-hard-2"), (soft, "req-soft-2")):
        client.cancel(agent.id, actor="ops")
        client.submit(agent.id, request, None, operation="count")
    report = deadlines.EnforceReport()
    deadlines._move(db, seen["hard"][0], "deadline-enforcer", "C0123456789", None, report)
    deadlines._move(db, seen["soft"][0], "deadline-enforcer", None, None, report)
    assert (report.stopped, report.demoted, report.failed) == ([], [], [])
    state = client.get_state(hard.id)
    assert (state.phase, state.request_id) == ("planning", "req-hard-2")
    assert client.get_state(soft.id).priority == "normal"
    assert message_row(db, scoped(hard.id, "req-hard-2:slack:hard-deadline")) is None
    for agent in (hard, soft):
        last = client.journal(agent_id=agent.id)[-1]
        assert (last.kind, last.decision) == ("rejected", "stale_revision"), last


def test_a_busy_agents_own_progress_does_not_keep_winning_against_its_deadline(client: Client, db: Database) -> None:
    """Between the pass's read and its move, the agent made progress on the same request (its revision moved on):
    the move is retried on the agent as it is now, not given up until a later pass (which a busy agent could keep
    losing, its demotion never applied)."""
    hard, soft, seen = _sighted_past_their_deadlines(client, db, "busy-", "")
    for agent in (hard, soft):
        for _ in range(2):  # its jobs finishing meanwhile
            core.transition(db, Command(agent.id, Event.PROGRESS, "worker", jobs=(JobSpec("count", "2"),)))
    assert client.get_state(soft.id).revision > seen["soft"][0].revision
    report = deadlines.EnforceReport()
    deadlines._move(db, seen["hard"][0], "deadline-enforcer", None, None, report)
    deadlines._move(db, seen["soft"][0], "deadline-enforcer", None, None, report)
    assert (report.stopped, report.demoted, report.failed) == ([hard.id], [soft.id], [])
    assert client.get_state(hard.id).phase == "failed"
    state = client.get_state(soft.id)
    assert (state.priority, state.request_id) == ("low", "req-soft")


def test_a_channel_name_for_notices_never_prevents_a_stop(client: Client, db: Database) -> None:
    first, second = _two_past_their_hard_deadline(client)
    # Settings refuse "#ops" at start-up; a caller passing one of its own still gets every agent stopped.
    report = deadlines.enforce(db, now() + timedelta(seconds=61), notify_slack_channel="#ops")
    assert sorted(report.stopped) == sorted([first.id, second.id]) and report.failed == []
    for agent in (first, second):
        stop = client.journal(agent_id=agent.id)[-1]
        assert (stop.event, stop.decision) == ("fail", "hard_deadline_passed")
        assert "conversation id" in stop.details["notice_not_sent"]
        assert message_row(db, scoped(agent.id, f"req-{agent.name}:slack:hard-deadline")) is None


@pytest.mark.parametrize("host_offset", [timedelta(minutes=5), timedelta(minutes=-5)])
def test_deadlines_bite_on_the_database_clock_not_the_hosts(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch, host_offset: timedelta
) -> None:
    soft_agent, hard_agent = client.create_agent("soft"), client.create_agent("hard")
    start = _database_now(db)
    client.submit(
        soft_agent.id,
        "req-soft",
        None,
        operation="count",
        soft_deadline=start + timedelta(seconds=2),
        hard_deadline=start + timedelta(hours=1),
    )
    client.submit(hard_agent.id, "req-hard", None, operation="count", hard_deadline=start + timedelta(seconds=2))
    real_now = core.now
    monkeypatch.setattr(core, "now", lambda: real_now() + host_offset)

    early = deadlines.enforce(db)  # the host may think the deadlines passed minutes ago: they have not
    assert (early.demoted, early.stopped) == ([], [])
    while _database_now(db) <= start + timedelta(seconds=2):
        time.sleep(0.1)
    on_time = deadlines.enforce(db)  # the host may think they are minutes away: they have passed
    assert (on_time.demoted, on_time.stopped) == ([soft_agent.id], [hard_agent.id])
    assert client.get_state(hard_agent.id).phase == "failed"
    assert client.get_state(soft_agent.id).priority == "low"

"""The journal is append-only, and `keel audit verify` finds any tampering with it."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core import journal
from agents.core.commands import Command
from agents.core.errors import HardDeadlinePassed, StaleRevision
from agents.core.phases import Event
from agents.core.transition import transition
from models.db import Database

pytestmark = pytest.mark.integration
ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}


def _history(client: Client) -> Any:
    agent = client.create_agent("audited")
    client.submit(agent.id, "r1", ASK)
    transition(client.db, Command(agent.id, Event.PLAN, "worker", details={"model": "m", "ratio": 0.1}))
    with pytest.raises(StaleRevision):
        client.cancel(agent.id, expected_revision=0, actor="late")
    client.submit(agent.id, "r1", ASK)  # suppressed
    transition(client.db, Command(agent.id, Event.FINISH, "worker"))
    client.create_agent("bystander")
    return agent


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE audit.journal SET actor = 'mallory'",
        "DELETE FROM audit.journal WHERE seq = 2",
        "TRUNCATE audit.journal",
    ],
)
def test_journal_refuses_update_delete_and_truncate(
    client: Client, raw: psycopg.Connection[Any], statement: str
) -> None:
    _history(client)
    before = raw.execute("SELECT id, actor, hash FROM audit.journal ORDER BY id").fetchall()
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
        raw.execute(statement)
    assert raw.execute("SELECT id, actor, hash FROM audit.journal ORDER BY id").fetchall() == before


def test_verify_passes_on_an_intact_journal(client: Client, db: Database) -> None:
    _history(client)
    report = journal.verify(db)
    assert report.ok and report.agents == 2
    assert report.events == len(client.journal())


def test_journal_heads_gives_each_agents_last_seq_and_leaves_a_deleted_one_out(client: Client, db: Database) -> None:
    """What a live stream's safety re-read uses to wake streams that fell behind."""
    agent = _history(client)
    gone = client.create_agent("gone")
    client.archive(gone.id, actor="op")
    client.delete_agent(gone.id, actor="op")
    last = client.journal(agent_id=agent.id)[-1].seq
    assert journal.journal_heads(db, [agent.id, gone.id]) == {agent.id: last}


def _tamper(raw: psycopg.Connection[Any], sql: str, *params: Any) -> None:
    # A superuser can switch the triggers off; the keyed chain still tells.
    raw.execute("ALTER TABLE audit.journal DISABLE TRIGGER USER")
    raw.execute(sql, params)
    raw.execute("ALTER TABLE audit.journal ENABLE TRIGGER USER")


@pytest.mark.parametrize(
    ("sql", "seq", "reason"),
    [
        (
            "UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 3",
            3,
            "content does not match its HMAC",
        ),
        (
            'UPDATE audit.journal SET details = \'{"model":"m","ratio":0.2}\' WHERE agent_id = %s AND seq = 3',
            3,
            "content does not match",
        ),
        (
            "UPDATE audit.journal SET at = at + interval '1 microsecond' WHERE agent_id = %s AND seq = 4",
            4,
            "content does not match",
        ),
        ("DELETE FROM audit.journal WHERE agent_id = %s AND seq = 2", 2, "event 2 is missing"),
        ("DELETE FROM audit.journal WHERE agent_id = %s AND seq = 6", 6, "chain ends at event 5"),
    ],
)
def test_verify_reports_the_first_broken_link(
    client: Client, db: Database, raw: psycopg.Connection[Any], sql: str, seq: int, reason: str
) -> None:
    agent = _history(client)
    _tamper(raw, sql, agent.id)
    report = journal.verify(db)
    assert not report.ok
    assert len(report.breaks) == 1, "only the tampered agent's chain breaks"
    broken = report.breaks[0]
    assert (broken.agent_id, broken.seq) == (agent.id, seq)
    assert reason in broken.reason


def test_verify_catches_a_rewritten_event_with_a_recomputed_hash(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    """Re-hashing a forged event is not enough: its link is an HMAC under a key the forger does not hold (and the
    next event's prev_hash still points at the original)."""
    agent = _history(client)
    events = client.journal(agent_id=agent.id)
    forged = events[2]
    new_hash = journal.event_hash(
        prev_hash=forged.prev_hash,
        agent_id=forged.agent_id,
        seq=forged.seq,
        kind=forged.kind,
        event=forged.event,
        actor="mallory",
        request_id=forged.request_id,
        from_phase=forged.from_phase,
        to_phase=forged.to_phase,
        revision=forged.revision,
        decision=forged.decision,
        details_json=journal.canonical_json(forged.details),
        at=forged.at,
    )
    _tamper(raw, "UPDATE audit.journal SET actor = 'mallory', hash = %s WHERE id = %s", new_hash, forged.id)
    report = journal.verify(db)
    assert [(b.seq, b.reason.split(":")[0]) for b in report.breaks] == [
        (3, "the event's content does not match its HMAC under key 'test-1'")
    ]


def test_the_database_refuses_a_revision_that_skips_or_repeats(client: Client, raw: psycopg.Connection[Any]) -> None:
    agent = client.create_agent("guarded")
    client.submit(agent.id, "r1", ASK)
    with pytest.raises(psycopg.errors.RaiseException, match="revision must go from 1 to 2, not to 3"):
        raw.execute("UPDATE agents SET revision = 3, phase = 'done' WHERE id = %s", (agent.id,))
    with pytest.raises(psycopg.errors.RaiseException, match="must bump the revision"):
        raw.execute("UPDATE agents SET phase = 'done' WHERE id = %s", (agent.id,))
    with pytest.raises(psycopg.errors.RaiseException, match=r"revision 2 of agent .* has no transition event"):
        raw.execute("UPDATE agents SET revision = revision + 1, phase = 'done' WHERE id = %s", (agent.id,))
    with pytest.raises(psycopg.errors.RaiseException, match=r"journal head of agent .* must move to its next event"):
        raw.execute("UPDATE agents SET journal_seq = journal_seq + 1 WHERE id = %s", (agent.id,))
    raw.execute("ALTER TABLE agents DISABLE TRIGGER USER")  # the check constraints stand alone too
    with pytest.raises(psycopg.errors.CheckViolation, match="ck_agents_phase"):
        raw.execute("UPDATE agents SET phase = 'dreaming' WHERE id = %s", (agent.id,))
    with pytest.raises(psycopg.errors.CheckViolation, match="budget_tokens"):
        raw.execute("UPDATE agents SET budget_tokens = -1 WHERE id = %s", (agent.id,))
    raw.execute("ALTER TABLE agents ENABLE TRIGGER USER")
    with pytest.raises(psycopg.errors.RaiseException, match="must bump the revision"):
        raw.execute("UPDATE agents SET spent_tokens = 5 WHERE id = %s", (agent.id,))
    assert client.get_state(agent.id).revision == 1


def test_verify_catches_a_state_change_that_skipped_the_journal(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    agent = _history(client)
    raw.execute("ALTER TABLE agents DISABLE TRIGGER USER")
    raw.execute("UPDATE agents SET revision = revision + 1, phase = 'planning' WHERE id = %s", (agent.id,))
    raw.execute("ALTER TABLE agents ENABLE TRIGGER USER")
    report = journal.verify(db)
    assert len(report.breaks) == 1 and report.breaks[0].agent_id == agent.id
    assert "the agent row says revision 4 (planning" in report.breaks[0].reason


def test_verify_sees_no_tampering_while_agents_are_busy(client: Client, db: Database) -> None:
    """Transitions committing during a verify must not look like broken chains (one snapshot)."""
    import threading

    ids = [client.create_agent(f"busy-{n}").id for n in range(4)]
    for agent_id in ids:
        client.submit(agent_id, f"r-{agent_id.hex[:8]}", ASK)
    stop = threading.Event()

    def churn(agent_id: Any) -> None:
        event = Event.PLAN
        while not stop.is_set():
            transition(client.db, Command(agent_id, event, "churn"))
            event = Event.OBSERVE if event is Event.PLAN else Event.PLAN

    threads = [threading.Thread(target=churn, args=(a,)) for a in ids]
    for t in threads:
        t.start()
    try:
        reports = [journal.verify(db) for _ in range(15)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert all(r.ok for r in reports), [b for r in reports for b in r.breaks][:3]
    assert reports[-1].events > reports[0].events, "the agents were not busy during the verifies"


# --- one time format ---------------------------------------------------------------------------------------------

RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
LOOKS_LIKE_A_TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d[^\s'\"]*")


def _times_in(value: Any) -> list[str]:
    """Every time written anywhere in ``value`` (a journal event's details), in free text too."""
    if isinstance(value, str):
        return LOOKS_LIKE_A_TIME.findall(value)
    if isinstance(value, dict):
        return [t for v in value.values() for t in _times_in(v)]
    if isinstance(value, list):
        return [t for v in value for t in _times_in(v)]
    return []


def test_every_time_in_the_journal_and_in_errors_is_rfc3339_utc(client: Client, db: Database) -> None:
    """Before: "2030-01-01T00:00:00+00:00" (as given), "2030-01-01 00:00:00+00:00" and
    "2026-11-30 19:04:46.793085+00:00" (the deadlines) in one submit's details, isoformat() in the error text."""
    bot = client.create_agent("dl-bot")
    far = datetime(2030, 1, 1, tzinfo=UTC)
    client.submit(bot.id, "r1", ASK, soft_deadline=timedelta(seconds=1), hard_deadline=far)
    state = client.get_state(bot.id)
    (submit,) = [e for e in client.journal(agent_id=bot.id) if e.event == "submit"]
    assert submit.details["hard_deadline"] == "2030-01-01T00:00:00.000000Z"
    assert submit.details["as_given"] == {"soft_deadline": "+1000000us", "hard_deadline": "2030-01-01T00:00:00.000000Z"}
    assert state.soft_deadline is not None
    assert submit.details["soft_deadline"] == state.soft_deadline.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert client.submit(bot.id, "r1", ASK, soft_deadline=timedelta(seconds=1), hard_deadline=far).revision == (
        state.revision
    ), "the same request again is a suppressed duplicate, as before"

    late = client.create_agent("late-bot")
    client.submit(late.id, "r2", ASK, hard_deadline=timedelta(milliseconds=200))
    deadline = client.get_state(late.id).hard_deadline
    assert deadline is not None
    while True:  # until the database's clock has passed it
        with psycopg.connect(db.libpq_url) as conn:
            row = conn.execute("SELECT clock_timestamp() > %s", (deadline,)).fetchone()
        if row and row[0]:
            break
        time.sleep(0.05)
    with pytest.raises(HardDeadlinePassed) as info:
        transition(db, Command(late.id, Event.PLAN, "worker"))
    shown = deadline.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert str(info.value) == f"agent 'late-bot''s hard deadline {shown} has passed"
    rejected = client.journal(agent_id=late.id)[-1]
    assert (rejected.kind, rejected.details["error"]) == ("rejected", str(info.value))

    times = [t for e in client.journal() for t in _times_in(e.details)]
    assert len(times) >= 5 and all(RFC3339.fullmatch(t) for t in times), times

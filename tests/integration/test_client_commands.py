"""A producer's command through ``Client`` is one transaction that returns the state it committed.

What a caller relies on: the state a command returns is the state a fresh read gives right after it; a command by
agent id borrows one pooled connection and commits once (no read before it, none after, no SQLAlchemy statement to
compile); a refused command is journaled and changes nothing; a connection killed in the middle of a command leaves
nothing of it, and its retry leaves the whole of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from sqlalchemy import event

from agents.client import Client
from agents.core.commands import Command, JobSpec
from agents.core.errors import AgentNotFound, IllegalTransition, RequestConflict, StaleRevision, StoreError
from agents.core.phases import Event
from agents.core.transition import transition
from models.db import Database
from tests.support.keys import scoped

pytestmark = pytest.mark.integration
ASK = {"prompt": "hi"}


@dataclass
class Borrowed:
    """What a block did with the database: pooled connections checked out, SQLAlchemy statements executed."""

    checkouts: int = 0
    statements: int = 0


@contextmanager
def borrowed(db: Database) -> Iterator[Borrowed]:
    seen = Borrowed()

    def checkout(*_: Any) -> None:
        seen.checkouts += 1

    def statement(*_: Any) -> None:
        seen.statements += 1

    event.listen(db.engine, "checkout", checkout)
    event.listen(db.engine, "before_cursor_execute", statement)
    try:
        yield seen
    finally:
        event.remove(db.engine, "checkout", checkout)
        event.remove(db.engine, "before_cursor_execute", statement)


def _journal(raw: psycopg.Connection[Any], agent_id: Any) -> list[tuple[Any, ...]]:
    return raw.execute(
        "SELECT seq, kind, event, decision, revision FROM audit.journal WHERE agent_id = %s ORDER BY seq", (agent_id,)
    ).fetchall()


def test_submit_and_cancel_by_id_are_one_transaction_each(client: Client, db: Database) -> None:
    """One pooled connection each, no SQLAlchemy statement: the transition's transaction (then, on the same
    connection, its journal wake-up). Before: a submit also read its jobs after, a cancel its agent before."""
    agent = client.create_agent("one")
    client.submit(agent.id, "warm", ASK)  # the handlers are imported once, on the first submit
    client.cancel(agent.id, actor="alice")
    with borrowed(db) as submit:
        client.submit(agent.id, "req-1", ASK)
    with borrowed(db) as cancel:
        client.cancel(agent.id, actor="alice", reason="stop")
    assert (submit.checkouts, submit.statements) == (1, 0)
    assert (cancel.checkouts, cancel.statements) == (1, 0)


def test_the_state_a_command_returns_is_what_a_fresh_read_gives(client: Client) -> None:
    agent = client.create_agent("fresh", budget_tokens=100, budget_cost="2.5")
    submitted = client.submit(agent.id, "req-1", ASK, actor="alice")
    assert submitted.phase == "planning" and [j.key for j in submitted.pending_jobs] == [
        scoped(agent.id, "req-1:plan:1")
    ]
    assert submitted == client.get_state(agent.id)
    repeated = client.submit(agent.id, "req-1", ASK, actor="alice")  # a retry: the state as it is, jobs and all
    assert repeated == client.get_state(agent.id) == submitted
    cancelled = client.cancel(agent.id, actor="alice", reason="enough")
    assert cancelled.phase == "failed" and cancelled.pending_jobs == ()
    assert cancelled == client.get_state(agent.id)
    by_name = client.submit("fresh", "req-2", ASK, actor="alice")
    assert by_name == client.get_state(agent.id)
    transition(client.db, Command(agent.id, Event.PLAN, "worker"))
    transition(client.db, Command(agent.id, Event.REQUEST_APPROVAL, "worker"))
    approved = client.approve(agent.id, expected_revision=client.get_state(agent.id).revision, actor="bob")
    assert approved.phase == "executing" and approved == client.get_state(agent.id)
    transition(client.db, Command(agent.id, Event.REQUEST_APPROVAL, "worker"))
    rejected = client.reject(agent.id, expected_revision=approved.revision + 1, actor="bob", reason="no")
    assert rejected == client.get_state(agent.id)


def test_a_command_on_an_agent_with_live_jobs_returns_all_of_them(client: Client, raw: psycopg.Connection[Any]) -> None:
    """A job live under a resting agent (only a superuser bypassing the guards makes one): the next submit's state
    lists it beside the submit's own job, as a fresh read does."""
    agent = client.create_agent("live")
    client.submit(agent.id, "req-1", ASK)
    client.cancel(agent.id, actor="alice")
    raw.execute("SET session_replication_role = replica")
    raw.execute(
        "UPDATE jobs SET status = 'pending', last_error = NULL WHERE key = %s", (scoped(agent.id, "req-1:plan:1"),)
    )
    raw.execute("SET session_replication_role = DEFAULT")
    state = client.submit(agent.id, "req-2", ASK)
    assert sorted(j.key for j in state.pending_jobs) == [
        scoped(agent.id, "req-1:plan:1"),
        scoped(agent.id, "req-2:plan:1"),
    ]
    assert state == client.get_state(agent.id)


def test_refused_commands_are_journaled_and_change_nothing(client: Client, raw: psycopg.Connection[Any]) -> None:
    agent = client.create_agent("refused")
    with pytest.raises(IllegalTransition):
        client.cancel(agent.id, actor="alice")  # idle: nothing to cancel
    state = client.submit(agent.id, "req-1", ASK)
    before = client.get_state(agent.id)
    with pytest.raises(StaleRevision) as stale:
        client.cancel(agent.id, expected_revision=0, actor="alice")
    assert (stale.value.current_revision, stale.value.expected_revision) == (state.revision, 0)
    with pytest.raises(RequestConflict) as conflict:
        client.submit(agent.id, "req-1", {"prompt": "something else"})
    assert conflict.value.differs == ("input",)
    with pytest.raises(StaleRevision):
        client.submit(agent.id, "req-2", ASK, expected_revision=0)
    assert client.get_state(agent.id) == before
    assert [row[1:4] for row in _journal(raw, agent.id)] == [
        ("created", "create", "accepted"),
        ("rejected", "cancel", "illegal_transition"),
        ("transition", "submit", "accepted"),
        ("rejected", "cancel", "stale_revision"),
        ("rejected", "submit", "request_conflict"),
        ("rejected", "submit", "stale_revision"),
    ]
    assert raw.execute("SELECT count(*) FROM requests").fetchone() == (1,)
    assert raw.execute("SELECT count(*) FROM jobs").fetchone() == (1,)


def test_a_command_on_an_unknown_or_deleted_agent_names_it_as_the_caller_did(client: Client) -> None:
    agent = client.create_agent("gone")
    client.archive(agent.id, actor="ops")
    client.delete_agent(agent.id, actor="ops")
    with pytest.raises(AgentNotFound) as by_id:
        client.cancel(agent.id, actor="alice")
    assert by_id.value.deleted is not None and by_id.value.deleted.name == "gone"
    with pytest.raises(AgentNotFound) as by_name:
        client.cancel("gone", actor="alice")
    assert by_name.value.deleted is not None and by_name.value.deleted.id == agent.id


def _waiting_lock(raw: psycopg.Connection[Any], timeout: float = 20.0) -> None:
    """Until a backend waits for a row lock on agents (a command's locking read)."""
    deadline = time.monotonic() + timeout
    while raw.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        " AND query LIKE 'SELECT id, name%%FOR UPDATE%%'"
    ).fetchone() == (0,):
        assert time.monotonic() < deadline, "no command waited for the agent's lock"
        time.sleep(0.02)


def test_a_cancel_that_waited_for_the_lock_sees_the_jobs_the_transition_before_it_added(
    client: Client, raw: psycopg.Connection[Any]
) -> None:
    """A cancel waits for the agent's lock while another transition adds a job: after the wait it counts that job,
    sweeps it, and answers with no live jobs (a miscount would leave the job live under a failed agent and the
    answer would disagree with a fresh read)."""
    agent = client.create_agent("raced")
    client.submit(agent.id, "req-1", ASK)
    holding, release = threading.Event(), threading.Event()
    results: list[Any] = []

    def hold(cur: Any, before: Any, after: Any) -> None:
        holding.set()
        assert release.wait(20)

    def step() -> None:
        command = Command(agent.id, Event.PROGRESS, "worker", jobs=(JobSpec("plan", "2"),))
        results.append(transition(client.db, command, effects=hold))

    def cancel() -> None:
        results.append(client.cancel(agent.id, actor="alice"))

    first = threading.Thread(target=step)
    first.start()
    assert holding.wait(20)
    second = threading.Thread(target=cancel)
    second.start()
    _waiting_lock(raw)
    release.set()
    first.join(20)
    second.join(20)
    assert len(results) == 2
    cancelled = results[1]
    assert cancelled.phase == "failed" and cancelled.pending_jobs == ()
    assert cancelled == client.get_state(agent.id)
    assert raw.execute("SELECT key, status FROM jobs ORDER BY key").fetchall() == [
        (scoped(agent.id, "req-1:plan:1"), "cancelled"),
        (scoped(agent.id, "req-1:plan:2"), "cancelled"),
    ]


def _gone(raw: psycopg.Connection[Any], pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while raw.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone() != (0,):
        assert time.monotonic() < deadline, "the terminated backends did not exit"
        time.sleep(0.02)


def _waiting_insert(raw: psycopg.Connection[Any], timeout: float = 20.0) -> int:
    """The pid of the backend waiting on a lock in an INSERT into jobs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = raw.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            " AND query LIKE 'INSERT INTO jobs%%'"
        ).fetchone()
        if found is not None:
            return int(found[0])
        time.sleep(0.02)
    raise AssertionError("the submit never reached its job insert")


def test_a_connection_killed_mid_command_leaves_nothing_and_the_retry_leaves_the_whole(
    client: Client, raw: psycopg.Connection[Any], db_url: str
) -> None:
    """The submit has locked the agent and claimed its request id when its backend is killed, waiting on a job key
    another transaction holds: none of it stays. The retry commits the transition, its request, job and event."""
    from models.urls import libpq_url

    agent = client.create_agent("killed")
    other = client.create_agent("other")
    client.submit(agent.id, "warm", ASK)
    client.cancel(agent.id, actor="alice")
    before, journal_before = client.get_state(agent.id), _journal(raw, agent.id)
    key = scoped(agent.id, "req-1:plan:1")
    failed: list[BaseException] = []

    def submit() -> None:
        try:
            client.submit(agent.id, "req-1", ASK)
        except BaseException as exc:
            failed.append(exc)

    with psycopg.connect(libpq_url(db_url)) as blocker:
        # An uncommitted job under the submit's key (on another agent): the submit's insert waits for it.
        blocker.execute(
            "INSERT INTO jobs (key, agent_id, request_id, operation, target, queue, run_at)"
            " VALUES (%s, %s, 'elsewhere', 'plan', '1', 'keel.jobs', now())",
            (key, other.id),
        )
        worker = threading.Thread(target=submit)
        worker.start()
        pid = _waiting_insert(raw)
        raw.execute("SELECT pg_terminate_backend(%s)", (pid,))
        worker.join(timeout=20)
        blocker.rollback()
    assert len(failed) == 1 and isinstance(failed[0], StoreError)
    assert client.get_state(agent.id) == before
    assert _journal(raw, agent.id) == journal_before
    assert raw.execute("SELECT count(*) FROM requests WHERE request_id = 'req-1'").fetchone() == (0,)
    assert raw.execute("SELECT count(*) FROM jobs WHERE key = %s", (key,)).fetchone() == (0,)

    retried = client.submit(agent.id, "req-1", ASK)  # the pool's killed connection is replaced, not reused
    assert (retried.phase, retried.revision, retried.request_id) == ("planning", before.revision + 1, "req-1")
    assert retried == client.get_state(agent.id)
    assert _journal(raw, agent.id)[-1][1:] == ("transition", "submit", "accepted", before.revision + 1)
    assert raw.execute("SELECT agent_id FROM requests WHERE request_id = 'req-1'").fetchone() == (agent.id,)
    assert raw.execute("SELECT status FROM jobs WHERE key = %s", (key,)).fetchone() == ("pending",)


def test_commands_after_every_pooled_connection_was_killed_still_work(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    """A database restart kills every pooled connection: the next submit and cancel get fresh ones."""
    agent = client.create_agent("restart")
    client.submit(agent.id, "req-1", ASK)
    with db.connection() as a, db.connection() as b:  # two pooled connections, both idle in the pool afterwards
        a.execute("SELECT 1")
        b.execute("SELECT 1")
        a.rollback()
        b.rollback()
    killed = [
        pid
        for (pid,) in raw.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    ]
    assert len(killed) >= 2
    raw.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (killed,))
    _gone(raw, killed)  # as after a restart: the old backends are no more when the next command comes
    with borrowed(db) as after:
        assert client.cancel(agent.id, actor="alice").phase == "failed"
    assert after.checkouts == 1
    assert client.submit(agent.id, "req-2", ASK).phase == "planning"


def test_a_wake_up_that_cannot_be_sent_does_not_fail_the_committed_command(
    client: Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal's announcement goes after the commit: if it fails (a full notification queue, a connection lost
    right after the commit), the command has happened and is answered as such; the failure is logged."""
    import models.db

    agent = client.create_agent("unannounced")
    monkeypatch.setattr(models.db, "_NOTIFY", "SELECT pg_notify(%s, %s, 'one argument too many')")
    with caplog.at_level("WARNING", logger="keel.db"):
        state = client.submit(agent.id, "req-1", ASK)
    assert (state.phase, state.revision) == ("planning", 1)
    assert state == client.get_state(agent.id)
    assert "could not announce 1 committed journal events" in caplog.text
    assert client.cancel(agent.id, actor="alice").phase == "failed"  # the connection is still good for the next one

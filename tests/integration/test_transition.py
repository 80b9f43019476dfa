"""The single writer: accepted moves, rejections that change nothing, duplicate submits, atomic effects."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core.commands import Command
from agents.core.errors import (
    AgentExists,
    AgentNotFound,
    IllegalTransition,
    InvalidInput,
    RequestConflict,
    StaleRevision,
)
from agents.core.phases import Event
from agents.core.transition import transition
from models.schemas import AgentRow, AgentState
from tests.support.keys import scoped

pytestmark = pytest.mark.integration
ASK = {"prompt": "hi"}


def _state_columns(client: Client, agent: Any) -> AgentState:
    return client.get_state(agent)


def test_create_submit_and_move_through_the_phases(client: Client) -> None:
    agent = client.create_agent("planner", budget_tokens=1000, budget_cost="1.25")
    assert (agent.phase, agent.revision, agent.request_id) == ("idle", 0, None)
    hard = datetime.now(UTC) + timedelta(hours=1)
    state = client.submit(
        agent.id,
        "req-1",
        {"prompt": "hi"},
        expected_revision=0,
        soft_deadline=timedelta(minutes=5),
        hard_deadline=hard,
        actor="alice",
    )
    assert (state.phase, state.revision, state.request_id, state.hard_deadline) == (
        "planning",
        1,
        "req-1",
        hard,
    )
    assert state.soft_deadline is not None and state.soft_deadline < hard
    for event, phase in [(Event.PLAN, "executing"), (Event.REQUEST_APPROVAL, "waiting_approval")]:
        transition(client.db, Command(agent.id, event, "worker"))
        assert client.get_state(agent.id).phase == phase
    approved = client.approve("planner", expected_revision=3, actor="bob")
    assert (approved.phase, approved.revision) == ("executing", 4)
    events = client.journal(agent_id=agent.id)
    assert [(e.kind, e.event, e.actor, e.revision) for e in events] == [
        ("created", "create", "client", 0),
        ("transition", "submit", "alice", 1),
        ("transition", "plan", "worker", 2),
        ("transition", "request_approval", "worker", 3),
        ("transition", "approve", "bob", 4),
    ]
    assert all(e.request_id == "req-1" for e in events[1:])
    assert client.journal(agent_id=agent.id, request_id="req-1") == events[1:]
    with pytest.raises(InvalidInput, match="give its agent too"):  # a request id is its agent's own
        client.journal(request_id="req-1")


def test_stale_command_is_rejected_journaled_and_changes_nothing(client: Client) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "r1", ASK)
    transition(client.db, Command(agent.id, Event.PLAN, "w"))
    transition(client.db, Command(agent.id, Event.REQUEST_APPROVAL, "w"))
    before = client.get_state(agent.id)
    with pytest.raises(StaleRevision) as info:
        client.approve(agent.id, expected_revision=2, actor="bob")
    assert (info.value.current_revision, info.value.expected_revision) == (3, 2)
    assert client.get_state(agent.id) == before
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.kind, last.event, last.actor, last.decision, last.revision) == (
        "rejected",
        "approve",
        "bob",
        "stale_revision",
        3,
    )
    assert last.details["expected_revision"] == 2


def test_illegal_move_names_the_allowed_ones_and_changes_nothing(client: Client) -> None:
    agent = client.create_agent("a")
    before = client.get_state(agent.id)
    with pytest.raises(IllegalTransition) as info:
        client.cancel(agent.id, actor="bob")
    assert (
        info.value.allowed == ("submit",)
        and str(info.value) == "agent 'a' is idle: 'cancel' is not allowed (allowed: submit)"
    )
    assert client.get_state(agent.id) == before
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.kind, last.decision, last.from_phase, last.to_phase) == (
        "rejected",
        "illegal_transition",
        "idle",
        "idle",
    )


def test_duplicate_submit_returns_current_state_and_is_suppressed(client: Client) -> None:
    agent = client.create_agent("a")
    first = client.submit(agent.id, "r1", {"prompt": "one"}, expected_revision=0)
    again = client.submit(agent.id, "r1", {"prompt": "one"}, expected_revision=0)
    assert again == first
    transition(client.db, Command(agent.id, Event.FINISH, "w"))
    client.submit(agent.id, "r2", {"prompt": "two"})
    done = transition(client.db, Command(agent.id, Event.FINISH, "w")).agent
    # A late retry of an older request must not restart it.
    late = client.submit(agent.id, "r1", {"prompt": "one"}, expected_revision=0)
    assert (late.phase, late.revision, late.request_id) == ("done", done.revision, "r2")
    kinds = [(e.kind, e.decision, e.request_id) for e in client.journal(agent_id=agent.id) if e.kind == "suppressed"]
    assert kinds == [("suppressed", "duplicate_request", "r1"), ("suppressed", "duplicate_request", "r1")]


def test_a_request_id_belongs_to_one_agent(client: Client) -> None:
    """Request ids are each agent's own: another agent's submit of the same id is a fresh request of that agent,
    which neither touches nor names the first agent's request."""
    a, b = client.create_agent("a"), client.create_agent("b")
    client.submit(a.id, "shared", ASK)
    a_state, a_events = client.get_state(a.id), client.journal(agent_id=a.id)
    state = client.submit(b.id, "shared", {"prompt": "another"})
    assert (state.phase, state.request_id, state.revision) == ("planning", "shared", 1)
    submit = client.journal(agent_id=b.id)[-1]
    assert (submit.kind, submit.event, submit.request_id) == ("transition", "submit", "shared")
    assert submit.decision != "request_conflict" and str(a.id) not in str(submit.details)
    assert client.get_state(a.id) == a_state and client.journal(agent_id=a.id) == a_events
    assert client.get_request(a.id, "shared").input == ASK
    assert client.get_request(b.id, "shared").input == {"prompt": "another"}
    assert [j.key for j in client.request_jobs(a.id, "shared")] == [scoped(a.id, "shared:plan:1")]
    assert [j.key for j in client.request_jobs(b.id, "shared")] == [scoped(b.id, "shared:plan:1")]
    # Each agent's retry is its own duplicate; a changed one conflicts with its own request only.
    assert client.submit(b.id, "shared", {"prompt": "another"}).revision == 1
    with pytest.raises(RequestConflict) as info:
        client.submit(b.id, "shared", ASK)
    assert info.value.owner == b.id and info.value.differs == ("input",)


def test_effects_commit_with_the_transition_and_roll_back_with_it(client: Client, raw: psycopg.Connection[Any]) -> None:
    raw.execute("CREATE TABLE side (agent_id uuid, revision bigint)")
    agent = client.create_agent("a")
    client.submit(agent.id, "r1", ASK)

    def write(cur: psycopg.Cursor[Any], before: AgentRow, after: AgentRow) -> dict[str, Any]:
        cur.execute("INSERT INTO side VALUES (%s, %s)", (after.id, after.revision))
        return {"side_rows": 1}

    transition(client.db, Command(agent.id, Event.PLAN, "w"), effects=write)
    assert raw.execute("SELECT revision FROM side").fetchall() == [(2,)]
    assert client.journal(agent_id=agent.id)[-1].details["effects"] == {"side_rows": 1}

    def write_then_fail(cur: psycopg.Cursor[Any], before: AgentRow, after: AgentRow) -> None:
        write(cur, before, after)
        raise RuntimeError("effect failed")

    before, events = client.get_state(agent.id), client.journal(agent_id=agent.id)
    with pytest.raises(RuntimeError, match="effect failed"):
        transition(client.db, Command(agent.id, Event.FINISH, "w"), effects=write_then_fail)
    assert client.get_state(agent.id) == before
    assert client.journal(agent_id=agent.id) == events
    assert raw.execute("SELECT count(*) FROM side").fetchone() == (1,)


def test_rejected_submit_does_not_keep_its_request_claim(client: Client) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "r1", ASK)
    with pytest.raises(StaleRevision):
        client.submit(agent.id, "r2", ASK, expected_revision=0)
    transition(client.db, Command(agent.id, Event.FINISH, "w"))
    # r2 was never accepted, so it is still free to start.
    assert client.submit(agent.id, "r2", ASK).request_id == "r2"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c, a: c.submit(a, "bad id!", ASK), "request_id 'bad id!' is invalid"),
        (lambda c, a: c.submit(a, "r", {"x": "y" * 70_000}), "the limit is 65536"),
        (lambda c, a: c.submit(a, "r", {1, 2}), "input must be JSON-serialisable"),
        (lambda c, a: c.submit(a, "r", ASK, hard_deadline=datetime(2030, 1, 1)), "timezone-aware"),
        (lambda c, a: c.submit(a, "r", ASK, hard_deadline=timedelta(seconds=-1)), "has passed already"),
        (lambda c, a: c.approve(a, expected_revision="3", actor="x"), "expected_revision must be an integer"),
        (lambda c, a: c.cancel(a, actor=""), "actor must be"),
        (lambda c, a: c.create_agent("bad name"), "name: String should match pattern"),
        (
            lambda c, a: c.create_agent("x", budget_tokens=-1),
            "budget_tokens: Input should be greater than or equal",
        ),
    ],
)
def test_bad_input_gets_a_clear_error_and_changes_nothing(client: Client, call: Any, message: str) -> None:
    agent = client.create_agent("a")
    events = client.journal()
    with pytest.raises(InvalidInput, match=message):
        call(client, agent.id)
    assert client.get_state(agent.id) == agent
    assert client.journal() == events
    assert [s.name for s in client.list_agents().agents] == ["a"]


def test_unknown_agents_and_taken_names(client: Client) -> None:
    client.create_agent("a")
    with pytest.raises(AgentExists, match="'a' exists already"):
        client.create_agent("a")
    with pytest.raises(AgentNotFound):
        client.get_state("nobody")
    with pytest.raises(AgentNotFound):
        client.submit("00000000-0000-0000-0000-000000000000", "r", ASK)
    # By id the submit's own locking read finds no agent: the error names the id as the caller wrote it, and
    # nothing is written.
    before = client.journal()
    with pytest.raises(AgentNotFound, match="'0000000A-0000-0000-0000-000000000000'"):
        client.submit("0000000A-0000-0000-0000-000000000000", "r", ASK)
    assert client.journal() == before


def test_submit_record_returns_the_request_as_first_submitted(client: Client) -> None:
    agent = client.create_agent("a")
    first = client.submit_record(agent.id, "r1", ASK, actor="alice")
    assert (first.replayed, first.request.request_id, first.request.agent_id) == (False, "r1", agent.id)
    assert (first.request.submitted_by, first.request.input, first.request.revision) == ("alice", ASK, 1)
    # A retry changes nothing and gets the same record back, as submit_request does.
    again = client.submit_record(agent.id, "r1", ASK, actor="alice")
    assert again.replayed and again.request == first.request
    assert client.submit_request(agent.id, "r1", ASK, actor="alice").request == first.request
    assert client.get_state(agent.id).revision == 1

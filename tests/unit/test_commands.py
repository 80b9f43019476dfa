from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from agents.core.commands import Accept, Command, Reject, Suppress, decide
from agents.core.errors import AgentArchived, IllegalTransition, InvalidInput, StaleRevision
from agents.core.phases import Event
from models.schemas import AgentRow
from models.tables import GENESIS_HASH

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def row(phase: str = "idle", revision: int = 0, request_id: str | None = None) -> AgentRow:
    return AgentRow(
        id=uuid.UUID(int=1),
        name="a",
        phase=phase,
        revision=revision,
        request_id=request_id,
        soft_deadline=None,
        hard_deadline=None,
        budget_tokens=None,
        budget_cost=None,
        spent_tokens=0,
        spent_cost=Decimal(0),
        created_at=NOW,
        updated_at=NOW,
        journal_seq=1,
        journal_head=GENESIS_HASH,
    )


def cmd(event: Event, **kw: object) -> Command:
    return Command(agent_id=uuid.UUID(int=1), event=event, actor="t", **kw)  # type: ignore[arg-type]


def test_accepted_move_bumps_revision_by_one_and_sets_the_target() -> None:
    result = decide(row("planning", 4, "r"), cmd(Event.PLAN, expected_revision=4), NOW)
    assert isinstance(result, Accept)
    assert (result.after.phase, result.after.revision, result.after.updated_at) == ("executing", 5, NOW)


def test_stale_revision_carries_the_current_one() -> None:
    result = decide(row("planning", 4, "r"), cmd(Event.PLAN, expected_revision=3), NOW)
    assert isinstance(result, Reject) and isinstance(result.error, StaleRevision)
    assert (result.error.current_revision, result.error.expected_revision, result.decision) == (
        4,
        3,
        "stale_revision",
    )


def test_illegal_move_names_the_allowed_events() -> None:
    result = decide(row("done", 2, "r"), cmd(Event.CANCEL), NOW)
    assert isinstance(result, Reject) and isinstance(result.error, IllegalTransition)
    # A person is told what they may send: the system's own events (charge) are left out, and the agent is named.
    assert result.error.allowed == ("submit",)
    assert str(result.error) == "agent 'a' is done: 'cancel' is not allowed (allowed: submit)"
    waiting = decide(row("waiting_approval", 2, "r"), cmd(Event.SUBMIT, request_id="r2"), NOW)
    assert isinstance(waiting, Reject) and waiting.error.allowed == ("approve", "reject", "cancel")  # type: ignore[attr-defined]
    # A move of the system's own that is illegal lists every event the table has there (for the logs).
    internal = decide(row("done", 2, "r"), cmd(Event.FINISH), NOW)
    assert isinstance(internal, Reject) and internal.error.allowed == ("submit", "charge")  # type: ignore[attr-defined]


def test_out_of_range_numbers_are_refused_naming_the_field() -> None:
    with pytest.raises(
        InvalidInput, match=r"expected_revision must be from 0 to 9223372036854775807, got 1180591620717411303424"
    ):
        cmd(Event.CANCEL, expected_revision=2**70)
    with pytest.raises(InvalidInput, match="hard_deadline must be at most 36500 days ahead"):
        cmd(Event.SUBMIT, request_id="r", hard_deadline=timedelta(days=10**6))


def test_repeat_submit_is_suppressed_even_with_an_old_revision() -> None:
    result = decide(row("executing", 7, "r1"), cmd(Event.SUBMIT, request_id="r1", expected_revision=0), NOW)
    assert result == Suppress("duplicate_request")


def test_submit_of_an_older_request_of_the_same_agent_is_suppressed() -> None:
    result = decide(row("done", 7, "r2"), cmd(Event.SUBMIT, request_id="r1"), NOW, request_seen=True)
    assert result == Suppress("duplicate_request")


def test_a_submit_keys_its_request_by_its_agent() -> None:
    agent = row("idle")
    result = decide(agent, cmd(Event.SUBMIT, request_id="r1"), NOW)
    assert isinstance(result, Accept)
    assert result.after.request_key == f"{agent.id.hex}~r1"


def test_submit_sets_request_and_deadlines() -> None:
    soft, hard = NOW + timedelta(minutes=1), NOW + timedelta(minutes=2)
    result = decide(
        row("failed", 3, "old"),
        cmd(Event.SUBMIT, request_id="new", soft_deadline=soft, hard_deadline=hard),
        NOW,
    )
    assert isinstance(result, Accept)
    assert (result.after.request_id, result.after.soft_deadline, result.after.hard_deadline) == (
        "new",
        soft,
        hard,
    )
    assert (result.after.phase, result.after.revision) == ("planning", 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"event": "teleport"}, "event 'teleport' is unknown"),
        ({"event": Event.PLAN, "actor": ""}, "actor must be"),
        ({"event": Event.PLAN, "expected_revision": -1}, "expected_revision must be from 0 to"),
        ({"event": Event.SUBMIT}, "submit needs a request_id"),
        ({"event": Event.SUBMIT, "request_id": "has space"}, "request_id 'has space' is invalid"),
        ({"event": Event.PLAN, "request_id": "r"}, "set only by submit"),
        ({"event": Event.SUBMIT, "request_id": "r", "hard_deadline": datetime(2030, 1, 1)}, "timezone-aware"),
        (
            {
                "event": Event.SUBMIT,
                "request_id": "r",
                "soft_deadline": NOW + timedelta(2),
                "hard_deadline": NOW,
            },
            "soft_deadline must not be after hard_deadline",
        ),
    ],
)
def test_malformed_commands_are_refused_with_the_rule(kwargs: dict[str, object], message: str) -> None:
    kwargs = {"agent_id": uuid.UUID(int=1), "actor": "t", **kwargs}
    with pytest.raises(InvalidInput, match=message):
        Command(**kwargs)  # type: ignore[arg-type]


def test_an_archived_agent_refuses_a_new_request_but_not_a_repeat() -> None:
    archived = replace(row("done", 4, "r1"), archived_at=NOW)
    refused = decide(archived, cmd(Event.SUBMIT, request_id="r2"), NOW)
    assert isinstance(refused, Reject) and refused.decision == "agent_archived"
    assert isinstance(refused.error, AgentArchived) and "agent 'a' is archived" in str(refused.error)
    assert isinstance(decide(archived, cmd(Event.SUBMIT, request_id="r1"), NOW), Suppress)
    assert isinstance(decide(replace(archived, archived_at=None), cmd(Event.SUBMIT, request_id="r2"), NOW), Accept)


def test_a_resubmit_is_compared_with_the_request_as_it_was_first_given() -> None:
    from agents.core.commands import JobSpec, as_given, differences
    from models.schemas import Submitted

    first = Submitted(
        {"prompt": "hi"},
        {"jobs": ["r:plan:1"], "as_given": {"soft_deadline": None, "hard_deadline": as_given(timedelta(minutes=5))}},
    )

    def retry(input_json: str = '{"prompt": "hi"}', operation: str = "plan", **kw: object) -> list[str]:
        command = cmd(Event.SUBMIT, request_id="r", jobs=(JobSpec(operation, "1"),), **kw)
        return differences(first, command, input_json)

    assert retry(hard_deadline=timedelta(minutes=5)) == []
    assert retry('{"prompt": "ho"}', hard_deadline=timedelta(minutes=5)) == ["input"]
    assert retry(operation="summarise", hard_deadline=timedelta(minutes=5)) == ["operation"]
    assert retry(hard_deadline=timedelta(minutes=6), soft_deadline=timedelta(minutes=1)) == [
        "soft_deadline",
        "hard_deadline",
    ]
    assert retry(hard_deadline=NOW + timedelta(minutes=5)) == ["hard_deadline"], "an instant is not a duration"
    legacy = Submitted({"prompt": "hi"}, {"jobs": ["r:plan:1"]})  # journaled before deadlines were kept as given
    assert differences(legacy, cmd(Event.SUBMIT, request_id="r", jobs=(JobSpec("plan", "1"),)), '{"prompt":"hi"}') == []


def test_a_pruned_request_is_compared_by_the_digest_of_its_input() -> None:
    """Retention replaced the input with its digest; the database compares it (``same_input``), the rest as before."""
    from agents.core.commands import JobSpec, differences
    from models.schemas import Submitted

    command = cmd(Event.SUBMIT, request_id="r", jobs=(JobSpec("plan", "1"),))
    same = Submitted(None, {"jobs": ["r:plan:1"]}, same_input=True)
    other = Submitted(None, {"jobs": ["r:plan:1"]}, same_input=False)
    assert differences(same, command, "null") == []  # a pruned input is None, which is not what is compared
    assert differences(other, command, '{"prompt": "hi"}') == ["input"]
    summarise = cmd(Event.SUBMIT, request_id="r", jobs=(JobSpec("summarise", "1"),))
    assert differences(same, summarise, "{}") == ["operation"]


def test_times_are_written_in_one_format_and_compared_as_instants() -> None:
    from datetime import UTC, datetime, timezone

    from agents.core.commands import JobSpec, as_given, differences
    from agents.core.errors import HardDeadlinePassed
    from models.clock import rfc3339
    from models.schemas import Submitted

    berlin = timezone(timedelta(hours=1))
    assert rfc3339(datetime(2030, 1, 1, 1, 0, tzinfo=berlin)) == "2030-01-01T00:00:00.000000Z"
    assert rfc3339(datetime(999, 1, 2, 3, 4, 5, 6, tzinfo=UTC)) == "0999-01-02T03:04:05.000006Z"
    with pytest.raises(ValueError, match="has no time zone"):
        rfc3339(datetime(2030, 1, 1))  # naive: refused
    assert as_given(datetime(2030, 1, 1, tzinfo=UTC)) == "2030-01-01T00:00:00.000000Z"  # was isoformat(): +00:00
    passed = HardDeadlinePassed(agent_id=uuid.uuid4(), name="a", hard_deadline=datetime(2030, 1, 1, 1, tzinfo=berlin))
    assert str(passed) == "agent 'a''s hard deadline 2030-01-01T00:00:00.000000Z has passed"

    # A request journaled before the one format keeps its spelling: a retry naming the same instant is the same.
    legacy = Submitted(
        {"prompt": "hi"},
        {"jobs": ["r:plan:1"], "as_given": {"soft_deadline": None, "hard_deadline": "2030-01-01T00:00:00+00:00"}},
    )
    retry = cmd(
        Event.SUBMIT, request_id="r", jobs=(JobSpec("plan", "1"),), hard_deadline=datetime(2030, 1, 1, tzinfo=UTC)
    )
    assert differences(legacy, retry, '{"prompt": "hi"}') == []
    later = replace(retry, hard_deadline=datetime(2030, 1, 1, 0, 0, 1, tzinfo=UTC))
    assert differences(legacy, later, '{"prompt": "hi"}') == ["hard_deadline"]


def test_waiting_since_is_when_the_wait_began_and_stays_put_while_it_lasts() -> None:
    gated = decide(row("executing", 4, "r"), cmd(Event.REQUEST_APPROVAL), NOW)
    assert isinstance(gated, Accept) and gated.after.waiting_since == NOW
    later = NOW + timedelta(minutes=5)
    escalated = decide(gated.after, cmd(Event.PROGRESS), later)  # a move within the wait (an escalation)
    assert isinstance(escalated, Accept)
    assert (escalated.after.updated_at, escalated.after.waiting_since) == (later, NOW)
    for event in (Event.APPROVE, Event.REJECT, Event.CANCEL, Event.FAIL):
        out = decide(escalated.after, cmd(event), later)
        assert isinstance(out, Accept) and out.after.waiting_since is None, event
    assert decide(row("planning", 1, "r"), cmd(Event.PLAN), NOW).after.waiting_since is None  # type: ignore[union-attr]

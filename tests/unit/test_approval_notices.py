"""How the follow-up of a wait for approval that ended undecided says what ended it, and which moves send one."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal

from agents.core.approval_notices import ends_undecided, how_it_ended
from agents.core.commands import Command
from agents.core.phases import Event
from models.schemas import AgentRow
from models.tables import GENESIS_HASH

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def row(phase: str) -> AgentRow:
    return AgentRow(
        id=uuid.UUID(int=1), name="a", phase=phase, revision=5, request_id="r", soft_deadline=None,
        hard_deadline=None, budget_tokens=None, budget_cost=None, spent_tokens=0, spent_cost=Decimal(0),
        created_at=NOW, updated_at=NOW, journal_seq=1, journal_head=GENESIS_HASH,
    )  # fmt: skip


def _cmd(event: Event, reason: str | None = None, said: str | None = None) -> Command:
    details = {} if said is None else {"reason": said}
    if reason is None:
        return Command(agent_id=uuid.UUID(int=1), event=event, actor="t", details=details)
    return Command(agent_id=uuid.UUID(int=1), event=event, actor="t", reason=reason, details=details)


def test_the_follow_up_says_what_ended_the_wait() -> None:
    assert how_it_ended(_cmd(Event.CANCEL)) == "the request was cancelled"
    assert how_it_ended(_cmd(Event.CANCEL, said=" wrong service ")) == "the request was cancelled: wrong service"
    assert how_it_ended(_cmd(Event.CANCEL, reason="revoked")) == "the request was cancelled: revoked"
    stopped = how_it_ended(_cmd(Event.FAIL, reason="hard_deadline_passed"))
    assert stopped == "the request passed its hard deadline and was stopped"
    assert how_it_ended(_cmd(Event.FAIL, reason="transient_cap_reached")) == (
        "the request failed: transient_cap_reached"
    )
    leaked = how_it_ended(_cmd(Event.CANCEL, said="token xoxb-1234-secret was pasted " + "x" * 400))
    assert "xoxb-1234" not in leaked and len(leaked) < 340 and leaked.endswith("…")


def test_only_a_move_out_of_the_wait_that_decides_nothing_ends_it_undecided() -> None:
    waiting = row("waiting_approval")
    for event, phase, ends in (
        (Event.CANCEL, "failed", True),
        (Event.FAIL, "failed", True),
        (Event.APPROVE, "executing", False),
        (Event.REJECT, "planning", False),
        (Event.PROGRESS, "waiting_approval", False),  # an escalation: the wait goes on
    ):
        assert ends_undecided(waiting, replace(waiting, phase=phase), _cmd(event)) is ends, event
    executing = row("executing")
    assert not ends_undecided(executing, replace(executing, phase="failed"), _cmd(Event.CANCEL))

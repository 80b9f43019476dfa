"""Deadline enforcement: past the soft deadline an agent's jobs drop to the low-priority queue; past the hard one
the request is stopped (phase failed, live jobs cancelled, running ones fenced off). Journaled like any transition."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from uuid import UUID

from agents import core
from agents.commands import LOW, Command, MessageSpec
from agents.errors import Rejected
from agents.phases import ACTIVE, Event
from models.db import Database
from models.jobs_sql import agents_past_deadlines

log = logging.getLogger("keel.deadlines")


@dataclass
class EnforceReport:
    demoted: list[UUID] = field(default_factory=list)
    stopped: list[UUID] = field(default_factory=list)


def enforce(
    db: Database, now: datetime, *, actor: str = "deadline-enforcer", notify_slack_channel: str | None = None
) -> EnforceReport:
    """Apply both deadlines to every active agent that has passed one. Safe to run from several places at once:
    each move is a transition under the agent's lock, and one that lost a race is simply rejected. A stop is
    announced on ``notify_slack_channel`` through the outbox, in the same transaction."""
    report = EnforceReport()
    soft, hard = agents_past_deadlines(db, now, [p.value for p in ACTIVE])
    for agent_id in hard:
        notice: tuple[MessageSpec, ...] = ()
        if notify_slack_channel:
            text = f"Keel stopped agent {agent_id}: its request passed its hard deadline. Pending work was cancelled."
            notice = (MessageSpec("slack", notify_slack_channel, "hard-deadline", {"text": text}),)
        command = Command(agent_id, Event.FAIL, actor, reason="hard_deadline_passed", messages=notice)
        if _apply(db, command):
            report.stopped.append(agent_id)
    for agent_id in soft:
        command = Command(agent_id, Event.PROGRESS, actor, reason="soft_deadline_passed", priority=LOW)
        if _apply(db, command):
            report.demoted.append(agent_id)
    return report


def _apply(db: Database, command: Command) -> bool:
    try:
        core.transition(db, command)
    except Rejected as exc:  # the agent moved on since we looked; the rejection is journaled
        log.info("deadline move on %s not applied: %s", command.agent_id, exc)
        return False
    return True

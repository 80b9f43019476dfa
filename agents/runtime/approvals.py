"""Approval timeouts, enforced by the leading beat on the database's clock: a call that waited longer than its
tool's ``approval_timeout`` is rejected (the model is told) or escalated (the escalation channel is told, once), each
move a transition against the revision the pass read, so racing beats or people never apply one twice (why:
docs/explanation/runtime-outbox-and-workers.md#approval-timeouts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from uuid import UUID

from agents.core import transition as core
from agents.core.commands import Command, MessageSpec
from agents.core.errors import InvalidInput, Rejected
from agents.core.phases import Event
from agents.runtime.loop import cancel_round_txn, pending_approval, rejection_jobs
from agents.runtime.notices import console_link, escalation_notice
from models.approvals_sql import WaitingCall, calls_past_approval_timeout
from models.db import Database
from models.settings import Settings

log = logging.getLogger("keel.approvals")

ACTOR = "approval-timeout"
TIMED_OUT = "approval_timed_out"
ESCALATED = "approval_escalated"


@dataclass
class TimeoutReport:
    rejected: list[UUID] = field(default_factory=list)
    escalated: list[UUID] = field(default_factory=list)
    failed: list[UUID] = field(default_factory=list)


def waited_text(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


#: How many timed-out calls one query of a pass takes.
DEFAULT_BATCH = 200


def enforce_timeouts(
    db: Database, settings: Settings, *, actor: str = ACTOR, batch: int = DEFAULT_BATCH
) -> TimeoutReport:
    """Reject or escalate every call past its approval timeout, ``batch`` calls per query, each batch read on from
    where the last ended: a call whose move failed is logged and not read again in this pass."""
    if batch < 1:
        raise InvalidInput(f"batch must be at least 1, got {batch}")
    report = TimeoutReport()
    after: tuple[datetime, UUID] | None = None
    while True:
        found = calls_past_approval_timeout(db, after=after, limit=batch)
        for call in found:
            _enforce_one(db, settings, call, actor, report)
        if len(found) < batch:
            return report
        after = (found[-1].since, found[-1].agent_id)


def _enforce_one(db: Database, settings: Settings, call: WaitingCall, actor: str, report: TimeoutReport) -> None:
    """Reject or escalate one timed-out call; its failure is logged and reported, never raised."""
    try:
        command = _command(db, settings, call, actor)
        if command is None:
            return
        core.transition(db, command, effects=cancel_round_txn if command.event is Event.REJECT else None)
    except Rejected as exc:  # decided (or moved on) since the pass read it: journaled, nothing changed
        log.info("approval timeout on %s not applied: %s", call.agent, exc)
    except Exception:
        log.exception("approval timeout on %s failed; the pass goes on", call.agent)
        report.failed.append(call.agent_id)
    else:
        (report.rejected if command.event is Event.REJECT else report.escalated).append(call.agent_id)


def _command(db: Database, settings: Settings, call: WaitingCall, actor: str) -> Command | None:
    pending = pending_approval(db, call.agent_id, call.request_id)
    if pending is None or pending.target != call.target:
        return None  # decided meanwhile: the agent's lock and revision would refuse it anyway
    timeout = float(call.payload["approval_timeout_seconds"])
    waited = waited_text((call.now - call.since).total_seconds())
    details = {"call": pending.as_dict(), "gate": call.key, "approval_timeout_seconds": timeout}
    if call.payload.get("on_timeout") == "escalate":
        channel = settings.approval_escalation_slack_channel
        messages: tuple[MessageSpec, ...] = ()
        if channel:
            notice = escalation_notice(
                channel,
                call.key,
                agent=call.agent,
                tool=pending.tool,
                waited=waited,
                arguments=pending.arguments,
                link=console_link(settings, call.agent),
            )
            messages = (notice,)
        else:
            details["notice_not_sent"] = "KEEL_APPROVAL_ESCALATION_SLACK_CHANNEL is not set"
        return Command(
            call.agent_id,
            Event.PROGRESS,
            actor,
            expected_revision=call.revision,
            reason=ESCALATED,
            details=details,
            messages=messages,
        )
    reason = f"no one approved it within {waited_text(timeout)}: it timed out and was not run"
    return Command(
        call.agent_id,
        Event.REJECT,
        actor,
        expected_revision=call.revision,
        reason=TIMED_OUT,
        details={**details, "reason": reason},
        jobs=rejection_jobs(pending, reason, timed_out=True),
        messages=pending.decided_messages(call.agent, "rejected: it timed out", actor),
    )

"""The Slack messages about a wait for approval, each keyed from the gate step the wait is on (:func:`key`), one
kind per message and channel, so each is sent once; and the follow-up of a wait that ends undecided, which
``transition()`` sends since every way out of waiting_approval is a transition (the runtime sends the others, from
agents/runtime/notices.py). The kinds and why: docs/explanation/journal-and-transitions.md#approval-notices."""

from __future__ import annotations

from typing import Any

import psycopg

from agents.core.commands import ACCEPTED, Command, MessageSpec
from agents.core.keys import step_message_key
from agents.core.phases import Event, Phase
from agents.core.redaction import redact
from models.approvals_sql import waited_gate_txn
from models.outbox_sql import destinations_txn
from models.schemas import AgentRow

WAITING = "approval"
ESCALATED = "approval-escalated"
DECIDED = "approval-decided"
ESCALATION_DECIDED = "approval-escalation-decided"
ENDED = "approval-ended"
ESCALATION_ENDED = "approval-escalation-ended"

#: How much of a reason a follow-up quotes.
MAX_QUOTED_CHARS = 300


def key(gate_key: str, kind: str) -> str:
    """The outbox key of the ``kind`` message about the wait on the gate step ``gate_key``."""
    return step_message_key(gate_key, "slack", kind)


def notice(channel: str, gate_key: str, kind: str, text: str) -> MessageSpec:
    """The ``kind`` message about the wait on the gate step ``gate_key``, to ``channel``: keyed by :func:`key`."""
    return MessageSpec("slack", channel, kind, {"text": text}, step=gate_key)


def ends_undecided(before: AgentRow, after: AgentRow, command: Command) -> bool:
    """Whether this move ends a wait for approval without deciding the call (a cancel, a failure)."""
    return (
        before.phase == Phase.WAITING_APPROVAL.value
        and after.phase != Phase.WAITING_APPROVAL.value
        and command.event not in (Event.APPROVE, Event.REJECT)
    )


def how_it_ended(command: Command) -> str:
    """What ended the wait, for the people told of it: the person's reason (a cancel's, redacted: the channel is read
    by more people than the journal), else the policy's."""
    said = command.details.get("reason")
    reason = redact(said.strip()) if isinstance(said, str) and said.strip() else None
    if reason is None and command.reason != ACCEPTED:
        reason = command.reason
    if reason is not None and len(reason) > MAX_QUOTED_CHARS:
        reason = reason[: MAX_QUOTED_CHARS - 1] + "…"
    if command.event is Event.CANCEL:
        return "the request was cancelled" + (f": {reason}" if reason else "")
    if reason == "hard_deadline_passed":
        return "the request passed its hard deadline and was stopped"
    return "the request failed" + (f": {reason}" if reason else "")


def ended_notices_txn(cur: psycopg.Cursor[Any], before: AgentRow, command: Command) -> tuple[MessageSpec, ...]:
    """The follow-ups of a wait that ends undecided, one to each channel told of it (none if none was), read
    under the agent's lock in the transition that ends it."""
    if before.request_id is None:
        return ()
    gate = waited_gate_txn(cur, before.id, before.request_id)
    if gate is None:
        return ()
    told = {kind: key(gate.key, kind) for kind in (WAITING, ESCALATED)}
    found = destinations_txn(cur, list(told.values()))
    text = (
        f"Agent {before.name}'s call to {gate.tool or 'its tool'} no longer waits for approval:"
        f" {how_it_ended(command)} (by {command.actor}). There is nothing to approve."
    )
    follow_ups = ((WAITING, ENDED), (ESCALATED, ESCALATION_ENDED))
    return tuple(notice(found[told[sent]], gate.key, kind, text) for sent, kind in follow_ups if told[sent] in found)

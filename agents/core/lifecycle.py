"""An agent's life outside its requests: created, archived or unarchived, deleted. Each is journaled on its chain in
the transaction that changes the agent row, as :func:`~agents.core.transition.transition` journals a move."""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from uuid import UUID

import psycopg

from agents.core import journal
from agents.core.errors import AgentBusy, AgentExists, AgentInUse, AgentNotFound, LostUpdate, Rejected, StaleRevision
from agents.core.phases import RESTING, Phase
from agents.core.store import store_errors
from models.db import Database
from models.schemas import AgentRow, DeletedAgent
from models.sql import (
    agent_schedules_txn,
    delete_agent_txn,
    deleted_agent_txn,
    insert_agent_txn,
    lock_agent_txn,
    set_archived_txn,
)


def create_agent(db: Database, name: str, *, budget_tokens: int | None, budget_cost: Any, actor: str) -> AgentRow:
    """Insert a new idle agent at revision 0 and start its journal chain with a ``created`` event."""
    keys = journal.signing_keys(db)
    with store_errors(), db.transaction() as cur:
        row = insert_agent_txn(cur, name=name, budget_tokens=budget_tokens, budget_cost=budget_cost)
        if row is None:
            raise AgentExists(name)
        at = row.created_at
        details = {
            "budget_tokens": budget_tokens,
            "budget_cost": None if budget_cost is None else str(budget_cost),
        }
        link = journal.append_side_event_txn(
            cur,
            row,
            keys=keys,
            kind="created",
            event="create",
            actor=actor,
            decision="accepted",
            details=details,
            at=at,
        )
    return replace(row, journal_seq=link.seq, journal_head=link.hash)


def set_archived(db: Database, agent_id: UUID, *, archived: bool, actor: str) -> AgentRow:
    """Archive (or unarchive) a resting agent: an archived agent refuses new requests and is left out of lists;
    its row, phase, revision and journal stay as they are. Journaled as an ``operator`` event (``archive`` /
    ``unarchive``); archiving an agent with a request in flight is refused with :class:`AgentBusy` and journaled
    as ``rejected``. Archiving an archived agent (or unarchiving one in use) changes nothing and journals nothing."""
    event = "archive" if archived else "unarchive"
    keys = journal.signing_keys(db)
    with store_errors(), db.transaction() as cur:
        locked = lock_agent_txn(cur, agent_id)
        if locked is None:
            raise missing_agent(cur, agent_id)
        row, at = locked.row, locked.at
        if (row.archived_at is not None) == archived:
            return row
        if archived and Phase(row.phase) not in RESTING:
            busy = AgentBusy(agent_id=row.id, name=row.name, phase=row.phase)
            journal.append_side_event_txn(
                cur, row, keys=keys, kind="rejected", event=event, actor=actor, decision="agent_busy",
                details={"error": str(busy)}, at=at,
            )  # fmt: skip
            refused: AgentBusy | None = busy
        else:
            refused = None
            appended = journal.new_event(
                row,
                keys=keys,
                kind="operator",
                event=event,
                actor=actor,
                request_id=row.request_id,
                from_phase=row.phase,
                to_phase=row.phase,
                revision=row.revision,
                decision="archived" if archived else "unarchived",
                details={},
                at=at,
            )
            archived_at = at if archived else None
            if not set_archived_txn(cur, appended, archived_at):
                raise LostUpdate(f"agent {row.id}'s journal chain is no longer at event {row.journal_seq}")
            row = replace(row, archived_at=archived_at, journal_seq=appended.seq, journal_head=appended.hash)
    if refused is not None:
        raise refused  # after the commit: the refusal is on record
    return row


def delete_agent(
    db: Database, agent_id: UUID, *, actor: str, reason: str | None = None, expected_revision: int | None = None
) -> DeletedAgent:
    """Delete an archived agent at rest: its row and schedules go (its name is free again); its journal, requests,
    jobs and outbox messages stay, and its tombstone keeps the head of its chain, which ends in an ``operator``/
    ``delete`` event, for ``keel audit verify``. A stale ``expected_revision`` (:class:`StaleRevision`) or an agent
    not archived or not at rest (:class:`AgentInUse`) is refused, journaled as ``rejected``; nothing else changes."""
    keys = journal.signing_keys(db)
    with store_errors(), db.transaction() as cur:
        locked = lock_agent_txn(cur, agent_id)
        if locked is None:
            raise missing_agent(cur, agent_id)
        row, at = locked.row, locked.at
        refused: Rejected | None = None
        if expected_revision is not None and expected_revision != row.revision:
            refused = StaleRevision(agent_id=row.id, name=row.name, expected=expected_revision, current=row.revision)
            decision = "stale_revision"
        elif row.archived_at is None or Phase(row.phase) not in RESTING or locked.live_jobs:
            at_rest = Phase(row.phase) in RESTING and not locked.live_jobs
            refused = AgentInUse(
                agent_id=row.id, name=row.name, phase=row.phase, archived=row.archived_at is not None, at_rest=at_rest
            )
            decision = "agent_in_use"
        details: dict[str, Any] = {} if reason is None else {"reason": reason}
        if refused is not None:
            details["error"] = str(refused)
            if expected_revision is not None:
                details["expected_revision"] = expected_revision
            journal.append_side_event_txn(
                cur,
                row,
                keys=keys,
                kind="rejected",
                event="delete",
                actor=actor,
                decision=decision,
                details=details,
                at=at,
            )
        else:
            schedules = agent_schedules_txn(cur, row.id)
            details["name"] = row.name
            if schedules:
                details["schedules_removed"] = schedules
            link = journal.append_side_event_txn(
                cur,
                row,
                keys=keys,
                kind="operator",
                event="delete",
                actor=actor,
                decision="deleted",
                details=details,
                at=at,
            )
            tombstone = DeletedAgent(
                id=row.id,
                name=row.name,
                created_at=row.created_at,
                deleted_at=at,
                deleted_by=actor,
                phase=row.phase,
                revision=row.revision,
                request_id=row.request_id,
                journal_seq=link.seq,
                journal_head=link.hash,
            )
            if not delete_agent_txn(cur, tombstone):
                raise LostUpdate(f"agent {row.id}'s journal chain is no longer at event {link.seq}")
    if refused is not None:
        raise refused  # after the commit: the refusal is on record
    return tombstone


def missing_agent(cur: psycopg.Cursor[Any], agent_id: UUID) -> AgentNotFound:
    """The error for an agent id with no row: saying when and by whom it was deleted, if it was."""
    return AgentNotFound(agent_id, deleted=deleted_agent_txn(cur, agent_id))

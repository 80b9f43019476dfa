"""Appending to the journal: the next event of an agent's chain, linked onto its head under the ring's current
key, in the caller's transaction (which holds the agent row's lock)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg

from agents.core.errors import LostUpdate
from agents.core.journal.chain import canonical_json, event_mac
from agents.core.redaction import redact_value
from models.audit_keys import AuditKeys
from models.schemas import AgentRow
from models.sql import NewEvent, advance_chain_txn


def new_event(
    row: AgentRow,
    *,
    keys: AuditKeys,
    kind: str,
    event: str,
    actor: str,
    request_id: str | None,
    from_phase: str | None,
    to_phase: str | None,
    revision: int,
    decision: str,
    details: Mapping[str, Any],
    at: datetime,
) -> NewEvent:
    """The next event of ``row``'s chain, linked onto its head with an HMAC under the ring's current key (the
    caller holds the row's lock)."""
    fields: dict[str, Any] = {
        "agent_id": row.id,
        "seq": row.journal_seq + 1,
        "kind": kind,
        "event": event,
        "actor": actor,
        "request_id": request_id,
        "from_phase": from_phase,
        "to_phase": to_phase,
        "revision": revision,
        "decision": decision,
        # The one place every journaled detail passes through: secrets are masked before they are hashed and kept.
        "details_json": canonical_json(redact_value(details)),
        "at": at,
    }
    digest = event_mac(keys, keys.current, prev_hash=row.journal_head, **fields)
    return NewEvent(**fields, prev_hash=row.journal_head, hash=digest, key_id=keys.current)


def append_side_event_txn(
    cur: psycopg.Cursor[Any],
    row: AgentRow,
    *,
    keys: AuditKeys,
    kind: str,
    event: str,
    actor: str,
    decision: str,
    details: Mapping[str, Any],
    at: datetime,
    request_id: str | None = None,
) -> NewEvent:
    """Journal an event that leaves the agent's state as it is (created, rejected, suppressed); move the head."""
    appended = new_event(
        row,
        keys=keys,
        kind=kind,
        event=event,
        actor=actor,
        request_id=request_id if request_id is not None else row.request_id,
        from_phase=row.phase,
        to_phase=row.phase,
        revision=row.revision,
        decision=decision,
        details=details,
        at=at,
    )
    if not advance_chain_txn(cur, appended):
        raise LostUpdate(f"agent {row.id}'s journal chain is no longer at event {row.journal_seq}")
    return appended

"""The journal's hash chain: how an event is linked onto the one before it. A keyed event's link is an HMAC-SHA256
under an audit key (models/audit_keys.py) over the previous hash and every field of the event; a legacy event's, from
before migration 0015, is a plain sha256. Why it is built this way: docs/explanation/journal-and-transitions.md."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from models.audit_keys import AuditKeyMissing, AuditKeys
from models.clock import rfc3339
from models.db import Database


def canonical_json(value: Mapping[str, Any]) -> str:
    """The one JSON text of ``value`` that is hashed and stored; a time in it is written in Keel's one format."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain)


def _plain(value: Any) -> str:
    return rfc3339(value) if isinstance(value, datetime) else str(value)


def _linked(
    prev_hash: str,
    agent_id: UUID,
    seq: int,
    kind: str,
    event: str,
    actor: str,
    request_id: str | None,
    from_phase: str | None,
    to_phase: str | None,
    revision: int,
    decision: str,
    details_json: str,
    at: datetime,
) -> list[str | int | None]:
    # The fields a link covers, in a fixed order; written as one JSON array, which no other list of them shares.
    return [
        prev_hash,
        str(agent_id),
        seq,
        kind,
        event,
        actor,
        request_id,
        from_phase,
        to_phase,
        revision,
        decision,
        details_json,
        at.astimezone(UTC).isoformat(),
    ]


def event_hash(
    *,
    prev_hash: str,
    agent_id: UUID,
    seq: int,
    kind: str,
    event: str,
    actor: str,
    request_id: str | None,
    from_phase: str | None,
    to_phase: str | None,
    revision: int,
    decision: str,
    details_json: str,
    at: datetime,
) -> str:
    """The unkeyed link of a legacy event (written before migration 0015): sha256 over the previous hash and every
    field of the event, in a fixed unambiguous encoding. Anyone can compute it: new events use :func:`event_mac`."""
    fields = _linked(
        prev_hash, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,
        details_json, at,
    )  # fmt: skip
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()


#: Starts what an event's HMAC covers, so no other use of the audit key (a legacy seal) shares its input.
_EVENT_TAG = "keel-journal-v1"


def mac_parts(
    key_id: str,
    *,
    prev_hash: str,
    agent_id: UUID,
    seq: int,
    kind: str,
    event: str,
    actor: str,
    request_id: str | None,
    from_phase: str | None,
    to_phase: str | None,
    revision: int,
    decision: str,
    details_json: str,
    at: datetime,
) -> list[str | int | None]:
    """What an event's HMAC covers: the fields :func:`event_hash` covers, and the id of the key."""
    return [
        _EVENT_TAG,
        key_id,
        *_linked(
            prev_hash, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,
            details_json, at,
        ),
    ]  # fmt: skip


def event_mac(keys: AuditKeys, key_id: str, **fields: Any) -> str:
    """An event's keyed link: HMAC-SHA256 under key ``key_id`` of :func:`mac_parts` (``fields``: its keywords)."""
    return keys.mac(key_id, mac_parts(key_id, **fields))


def signing_keys(db: Database) -> AuditKeys:
    """The key ring journal events are linked with, or :class:`~models.audit_keys.AuditKeyMissing` (before anything
    is written) when ``db`` has none."""
    if db.audit_keys is None:
        raise AuditKeyMissing()
    return db.audit_keys


#: The linked fields, as event_hash names them (less agent_id); a chain query selects them after id, hash, key_id.
HASHED = (
    "prev_hash", "seq", "kind", "event", "actor", "request_id", "from_phase", "to_phase", "revision", "decision",
    "details_json", "at",
)  # fmt: skip


def link_problem(
    agent_id: UUID, keys: AuditKeys | None, key_id: str | None, fields: Mapping[str, Any], digest: str
) -> str | None:
    """Why an event's content does not match its link: its plain hash (a legacy event, ``key_id`` None) or its HMAC
    under ``key_id``, which the ring must hold; None: it matches."""
    if key_id is None:
        if event_hash(agent_id=agent_id, **fields) == digest:
            return None
        return "the event's content does not match its hash"
    assert keys is not None and key_id in keys
    if keys.verifies(key_id, mac_parts(key_id, agent_id=agent_id, **fields), digest):
        return None
    return (
        f"the event's content does not match its HMAC under key {key_id!r}: it was changed or forged (or"
        " KEEL_AUDIT_KEYS holds another secret under that id)"
    )

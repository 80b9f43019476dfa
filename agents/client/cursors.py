"""The opaque ``next`` cursors of paged reads: agents and approvals by (time, id), the journal by position."""

from __future__ import annotations

import base64
from datetime import datetime
from uuid import UUID

from agents.core.commands import MAX_BIGINT
from agents.core.errors import BadCursor, quoted


def encode_cursor(created_at: datetime, agent_id: UUID) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{agent_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, UUID]:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created_at, agent_id = text.split("|")
        at = datetime.fromisoformat(created_at)
        if at.tzinfo is None:
            raise ValueError("naive time")
        return at, UUID(agent_id)
    except (ValueError, UnicodeDecodeError):
        raise BadCursor(
            f"cursor {quoted(cursor)} is not the 'next' of a page of agents (from `keel agent list` or the API)"
        ) from None


def encode_journal_cursor(by: str, before: int) -> str:
    return base64.urlsafe_b64encode(f"journal|{by}|{before}".encode()).decode().rstrip("=")


def decode_journal_cursor(cursor: str, by: str) -> int:
    # A cursor of one agent's chain counts events of that chain (seq); of the whole journal, journal ids.
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, found, number = text.split("|")
        value = int(number)
        if kind != "journal" or found != by or not 1 <= value <= MAX_BIGINT:
            raise ValueError(text)
        return value
    except (ValueError, UnicodeDecodeError):
        scope = "one agent's journal (with --agent)" if by == "seq" else "the journal (without --agent)"
        raise BadCursor(
            f"cursor {quoted(cursor)} is not the 'next' of a page of {scope}, as `keel journal` printed it"
        ) from None

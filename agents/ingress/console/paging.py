"""The console's page cursors, carried by a list's "Next page" link: the agents list's is its last agent's key
(:class:`models.console_sql.AgentKey`) in URL-safe base64; the outbox's and the journal's are a sequence number, and the
next page holds what comes before it."""

from __future__ import annotations

import base64
from datetime import datetime
from uuid import UUID

from agents.core.errors import KeelError
from models.console_sql import AGENT_ORDER, AgentKey

#: Longer than any cursor the console makes.
MAX_CURSOR = 200
#: The largest sequence number PostgreSQL's bigint holds.
MAX_SEQ = 2**63 - 1


class BadCursor(KeelError):
    """The page cursor is not one this list made (mistyped, cut short, or from another list)."""

    def __init__(self, cursor: str) -> None:
        super().__init__(f"the page cursor {cursor[:80]!r} is not one this list made")
        self.cursor = cursor


def agents_cursor(key: AgentKey) -> str:
    text = f"{key.phase}|{key.at.isoformat()}|{key.id}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def agents_key(cursor: str) -> AgentKey:
    """The key an agents cursor holds; :class:`BadCursor` when it holds none."""
    try:
        if len(cursor) > MAX_CURSOR:
            raise ValueError("too long")
        phase, at, agent_id = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().split("|")
        when = datetime.fromisoformat(at)
        if phase not in AGENT_ORDER or when.tzinfo is None:
            raise ValueError("not a key")
        return AgentKey(phase, when, UUID(agent_id))
    except ValueError:  # bad base64 (binascii.Error), bad UTF-8, too few or many parts, a bad time or id
        raise BadCursor(cursor) from None


def seq_cursor(cursor: str, *, low: int) -> int:
    """The sequence number a cursor holds (at least ``low``); :class:`BadCursor` when it holds none."""
    text = cursor.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 19 or not low <= int(text) <= MAX_SEQ:
        raise BadCursor(cursor)
    return int(text)

"""Keys in tests: a request's keys start with its agent (``agents.core.keys.request_key``)."""

from __future__ import annotations

from uuid import UUID

from agents.core.keys import request_key, split_key


def scoped(agent_id: UUID, key: str) -> str:
    """``key`` written as ``{request_id}:{operation}:{target}`` (``"req-1:plan:1"``), as its agent keys it."""
    request_id, operation, target = split_key(key)
    return f"{request_key(agent_id, request_id)}:{operation}:{target}"

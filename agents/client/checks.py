"""What both clients accept for an agent and a deadline, and the argument checks that run before anything is sent."""

from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID

from agents.core.commands import MAX_ACTOR_CHARS, MAX_REASON_CHARS, check_text
from agents.core.errors import InvalidInput

#: An agent by id or by name.
AgentRef = UUID | str
#: Absolute (timezone-aware) or relative to the transition's time; None for no deadline.
Deadline = datetime | timedelta | None


def as_uuid(agent: AgentRef) -> UUID | None:
    """The agent's id, if ``agent`` is one (else it is a name)."""
    if isinstance(agent, UUID):
        return agent
    try:
        return UUID(agent)
    except ValueError:
        return None


def check_deadline(name: str, value: Deadline) -> datetime | timedelta | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        if value <= timedelta(0):
            raise InvalidInput(f"{name} {value} is not in the future: it has passed already")
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidInput(f"{name} must be timezone-aware (got a naive datetime)")
        return value
    raise InvalidInput(f"{name} must be a datetime or a timedelta, got {type(value).__name__}")


def check_actor(actor: str) -> None:
    if isinstance(actor, str) and not actor:
        raise InvalidInput(f"actor must be 1-{MAX_ACTOR_CHARS} characters: every change names who made it")
    check_text("actor", actor, limit=MAX_ACTOR_CHARS)


def check_reason(reason: str | None) -> None:
    if reason is not None:
        check_text("reason", reason, limit=MAX_REASON_CHARS)

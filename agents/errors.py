"""Keel's errors. Each class's docstring is its default message; each carries the facts a caller needs."""

from __future__ import annotations

from collections.abc import Sequence
from uuid import UUID


class KeelError(Exception):
    """Keel could not do what was asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class InvalidInput(KeelError):
    """The input is not valid."""


class AgentNotFound(KeelError):
    """No agent has this id or name."""

    def __init__(self, agent: UUID | str) -> None:
        self.agent = agent
        super().__init__(f"no agent has the id or name {str(agent)!r}")


class AgentExists(KeelError):
    """An agent with this name exists already."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"an agent named {name!r} exists already")


class Rejected(KeelError):
    """The command was rejected and journaled; the agent did not change."""


class StaleRevision(Rejected):
    """The command was based on an old revision of the agent."""

    def __init__(self, *, agent_id: UUID, expected: int, current: int) -> None:
        self.agent_id = agent_id
        self.expected_revision = expected
        self.current_revision = current
        super().__init__(
            f"stale revision for agent {agent_id}: the command expected revision {expected}, "
            f"the agent is at revision {current}"
        )


class IllegalTransition(Rejected):
    """The phase table has no such move from the agent's current phase."""

    def __init__(self, *, agent_id: UUID, phase: str, event: str, allowed: Sequence[str]) -> None:
        self.agent_id = agent_id
        self.phase = phase
        self.event = event
        self.allowed = tuple(allowed)
        moves = ", ".join(self.allowed) or "none"
        super().__init__(f"agent {agent_id} is {phase}: {event!r} is not allowed (allowed: {moves})")


class RequestConflict(Rejected):
    """This request id belongs to another agent."""

    def __init__(self, *, request_id: str, owner: UUID) -> None:
        self.request_id = request_id
        self.owner = owner
        super().__init__(f"request id {request_id!r} already belongs to agent {owner}")


class StoreError(KeelError):
    """The database failed."""


class EmbeddedError(KeelError):
    """The embedded development servers could not be started or stopped."""

"""Keel's errors. Each class's docstring is its default message; each carries the facts a caller needs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

# The root is defined in models/ so that errors raised there share it too.
from models.errors import KeelError as KeelError


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


class AgentArchived(Rejected):
    """The agent is archived: it takes no new requests until it is unarchived."""

    def __init__(self, *, agent_id: UUID, name: str) -> None:
        self.agent_id = agent_id
        self.name = name
        super().__init__(f"agent {name!r} is archived: it takes no new requests (unarchive it first)")


class AgentBusy(Rejected):
    """The agent has a request in flight: it can be archived only while it rests (idle, done or failed)."""

    def __init__(self, *, agent_id: UUID, name: str, phase: str) -> None:
        self.agent_id = agent_id
        self.name = name
        self.phase = phase
        super().__init__(
            f"agent {name!r} is {phase}: archive it when it rests (idle, done or failed), or cancel its request first"
        )


class InvalidDeadlines(Rejected):
    """The request's deadlines are impossible (a hard deadline that has passed, a soft one after the hard one)."""


class HardDeadlinePassed(Rejected):
    """The request's hard deadline has passed: only cancel or fail may move the agent now."""

    def __init__(self, *, agent_id: UUID, hard_deadline: datetime) -> None:
        self.agent_id = agent_id
        self.hard_deadline = hard_deadline
        super().__init__(f"agent {agent_id}'s hard deadline {hard_deadline.isoformat()} has passed")


class JobError(KeelError):
    """A job's step failed. Raised by handlers; the class decides whether and when it is retried."""

    error_class = "unknown"

    def __init__(self, message: str | None = None, *, usage: Any = None, retry_after: float | None = None) -> None:
        self.usage = usage  # agents.core.commands.Usage spent before the failure, charged as retry-caused cost
        self.retry_after = retry_after
        super().__init__(message)


class TransientError(JobError):
    """A temporary failure (5xx, timeout, dropped connection); trying again later may succeed."""

    error_class = "transient"


class RateLimited(JobError):
    """The receiver is rate limiting; retry after ``retry_after`` seconds."""

    error_class = "rate_limited"


class InvalidJob(JobError):
    """The job cannot succeed as asked (bad input, 4xx, unknown operation); it is not retried."""

    error_class = "invalid"


class BudgetExceeded(JobError):
    """The agent's budget does not allow this step."""

    error_class = "budget"


class FencedOff(KeelError):
    """The job's claim was taken over (its lease expired) or cancelled: this worker may no longer write its outcome."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"job {key}: this worker's claim was taken over or cancelled; its outcome is not recorded")


class StoreError(KeelError):
    """The database failed."""


class LostUpdate(StoreError):
    """A guarded write matched no row although the row was locked: another writer bypassed the lock."""


class LostClaim(KeelError):
    """Another relay took the outbox message over: this relay may neither send it nor record its outcome."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"outbox message {key!r} was taken over by another relay")

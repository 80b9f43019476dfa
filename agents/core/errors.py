"""Keel's errors. Each class's docstring is its default message; each carries the facts a caller needs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

# The root is defined in models/ so that errors raised there share it too.
from models.clock import rfc3339
from models.errors import KeelError as KeelError
from models.schemas import DeletedAgent

#: How much of a long value an error message quotes: the rest is counted, not echoed.
QUOTED_CHARS = 60


def quoted(value: object) -> str:
    """``value`` (a name, an id, a key someone gave) as an error message quotes it: its ``repr``, and of a long one
    only the first :data:`QUOTED_CHARS` characters, ``…`` and its length — a 5,000-character request id is not
    echoed whole."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= QUOTED_CHARS:
        return repr(text)
    return f"{text[:QUOTED_CHARS] + '…'!r} ({len(text):,} characters)"


class InvalidInput(KeelError):
    """The input is not valid."""

    #: Each problem, when the check knows them: ``{"path": "input.prompt", "message": "is required"}``.
    errors: list[dict[str, str]] = []  # noqa: RUF012 - replaced per instance, never mutated


class BadCursor(InvalidInput):
    """The cursor is not the 'next' of a page this listing printed."""


class UnknownOperation(InvalidInput):
    """No handler is registered (or declared) for this operation."""

    def __init__(self, operation: str, known: Sequence[str]) -> None:
        self.operation = operation
        self.known = tuple(known)
        super().__init__(
            f"operation {quoted(operation)} is unknown: no handler is registered for it (known:"
            f" {', '.join(known) or 'none'}; handler modules are imported from KEEL_IMPORTS and the keel.handlers"
            " entry points)"
        )


class AgentNotFound(KeelError):
    """No agent has this id or name. ``deleted``: the tombstone of the agent that had it, if one was deleted."""

    def __init__(self, agent: UUID | str, *, deleted: DeletedAgent | None = None) -> None:
        self.agent = agent
        self.deleted = deleted
        if deleted is None:
            message = f"no agent has the id or name {quoted(agent)}"
        else:
            at = rfc3339(deleted.deleted_at)
            message = (
                f"agent {quoted(deleted.name)} was deleted at {at} by {deleted.deleted_by} (id {deleted.id});"
                " its journal is kept"
            )
        super().__init__(message)


class RequestNotFound(KeelError):
    """No request has this id."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"no request has the id {quoted(request_id)}")


class MessageNotFound(InvalidInput):
    """No outbox message has this key."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"no outbox message has the key {quoted(key)}")


class MessageNotDead(InvalidInput):
    """Only a dead outbox message can be retried."""

    def __init__(self, key: str, status: str) -> None:
        self.key = key
        self.status = status
        super().__init__(f"outbox message {quoted(key)} is {status}, not dead: only dead messages can be retried")


class AgentExists(KeelError):
    """An agent with this name exists already."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"an agent named {quoted(name)} exists already")


class Rejected(KeelError):
    """The command was rejected and journaled; the agent did not change."""


def _agent(agent_id: UUID, name: str | None) -> str:
    """An agent as a person named it: its name (what they typed, or what the id stands for)."""
    return quoted(name) if name else str(agent_id)


class StaleRevision(Rejected):
    """The command was based on an old revision of the agent."""

    def __init__(self, *, agent_id: UUID, expected: int, current: int, name: str | None = None) -> None:
        self.agent_id = agent_id
        self.name = name
        self.expected_revision = expected
        self.current_revision = current
        super().__init__(
            f"stale revision for agent {_agent(agent_id, name)}: the command expected revision {expected}, "
            f"the agent is at revision {current}"
        )


class IllegalTransition(Rejected):
    """The phase table has no such move from the agent's current phase. ``allowed`` lists the events a person or
    producer may send in that phase (for a command of the system's own, every event the table allows there)."""

    def __init__(
        self, *, agent_id: UUID, phase: str, event: str, allowed: Sequence[str], name: str | None = None
    ) -> None:
        self.agent_id = agent_id
        self.name = name
        self.phase = phase
        self.event = event
        self.allowed = tuple(allowed)
        moves = ", ".join(self.allowed) or "none"
        super().__init__(f"agent {_agent(agent_id, name)} is {phase}: {event!r} is not allowed (allowed: {moves})")


class RequestConflict(Rejected):
    """This request id was submitted to this agent before with a different request: a retry must repeat the request
    as it was (``differs`` names what is not the same), or use a new request id."""

    def __init__(
        self,
        *,
        request_id: str,
        owner: UUID,
        owner_name: str | None = None,
        differs: Sequence[str] = (),
    ) -> None:
        self.request_id = request_id
        self.owner = owner
        self.owner_name = owner_name
        self.differs = tuple(differs)
        if self.differs:
            what = " and ".join(self.differs)
            message = (
                f"request id {quoted(request_id)} was submitted to agent {_agent(owner, owner_name)} before with a"
                f" different {what}: a retry must repeat the request as it was; use a new request id for a new request"
            )
        else:
            message = f"request id {quoted(request_id)} already belongs to agent {_agent(owner, owner_name)}"
        super().__init__(message)


class AgentArchived(Rejected):
    """The agent is archived: it takes no new requests until it is unarchived."""

    def __init__(self, *, agent_id: UUID, name: str) -> None:
        self.agent_id = agent_id
        self.name = name
        super().__init__(f"agent {quoted(name)} is archived: it takes no new requests (unarchive it first)")


class AgentBusy(Rejected):
    """The agent has a request in flight: it can be archived only while it rests (idle, done or failed)."""

    def __init__(self, *, agent_id: UUID, name: str, phase: str) -> None:
        self.agent_id = agent_id
        self.name = name
        self.phase = phase
        super().__init__(
            f"agent {quoted(name)} is {phase}: archive it when it rests (idle, done or failed), or cancel its request"
            " first"
        )


class AgentInUse(Rejected):
    """Only an archived agent at rest can be deleted: archive it first."""

    def __init__(self, *, agent_id: UUID, name: str, phase: str, archived: bool, at_rest: bool) -> None:
        self.agent_id = agent_id
        self.name = name
        self.phase = phase
        self.archived = archived
        if not at_rest:
            message = (
                f"agent {quoted(name)} is {phase}: only an archived agent at rest (idle, done or failed) can be"
                " deleted: cancel its request and archive it first"
            )
        elif not archived:
            message = f"agent {quoted(name)} is not archived: archive it first (it then takes no new requests)"
        else:  # pragma: no cover - an agent at rest has no live jobs (coming to rest cancels them)
            message = f"agent {quoted(name)} still has live jobs: it can be deleted once they are over"
        super().__init__(message)


class InvalidDeadlines(Rejected):
    """The request's deadlines are impossible (a hard deadline that has passed, a soft one after the hard one)."""


class HardDeadlinePassed(Rejected):
    """The request's hard deadline has passed: only cancel or fail may move the agent now."""

    def __init__(self, *, agent_id: UUID, hard_deadline: datetime, name: str | None = None) -> None:
        self.agent_id = agent_id
        self.name = name
        self.hard_deadline = hard_deadline
        super().__init__(f"agent {_agent(agent_id, name)}'s hard deadline {rfc3339(hard_deadline)} has passed")


class JobError(KeelError):
    """A job's step failed. Raised by handlers; the class decides whether and when it is retried."""

    error_class = "unknown"
    #: The policy decision journaled when this failure ends the request (None: the retry policy's, e.g.
    #: ``invalid_not_retried``).
    decision: str | None = None

    def __init__(
        self,
        message: str | None = None,
        *,
        usage: Any = None,
        retry_after: float | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        self.usage = usage  # agents.core.commands.Usage spent before the failure, charged as retry-caused cost
        self.retry_after = retry_after
        self.details = dict(details or {})  # JSON facts journaled with the failure
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


class UnknownTool(InvalidJob):
    """The model called a tool Keel does not have: the request fails, naming the tool and the tools there are."""

    decision = "unknown_tool"

    def __init__(self, name: str, known: Sequence[str], *, usage: Any = None) -> None:
        self.name = name
        self.known = tuple(known)
        super().__init__(
            f"the model called a tool that does not exist: {name[:64]!a} (tools: {', '.join(known) or 'none'})",
            usage=usage,
            details={"tool": name[:64], "known_tools": list(known)},
        )


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
        super().__init__(f"outbox message {quoted(key)} was taken over by another relay")


class TokenExists(KeelError):
    """An API token with this name exists already (revoked ones included: a name is never reused)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"an API token named {quoted(name)} exists already (see keel token list)")


class TokenNotFound(KeelError):
    """No API token has this id or name."""

    def __init__(self, token: UUID | str) -> None:
        self.token = token
        super().__init__(f"no API token has the id or name {quoted(token)} (see keel token list)")

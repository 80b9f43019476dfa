"""An API refusal (RFC 9457 problem details) turned back into the Keel error it stands for, carrying its facts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import UUID

import httpx

from agents.client.checks import as_uuid
from agents.client.errors import AccessDenied, ApiUnavailable
from agents.core.errors import (
    AgentArchived,
    AgentBusy,
    AgentExists,
    AgentInUse,
    AgentNotFound,
    HardDeadlinePassed,
    IllegalTransition,
    InvalidDeadlines,
    InvalidInput,
    KeelError,
    MessageNotDead,
    MessageNotFound,
    Rejected,
    RequestConflict,
    RequestNotFound,
    StaleRevision,
    UnknownOperation,
)
from models.schemas import AgentState


def problem_kind(response: httpx.Response) -> str:
    """The slug of a problem answer's ``type`` ("" for any other answer)."""
    try:
        body = response.json()
    except ValueError:
        return ""
    return str(body.get("type", "")).rsplit("/", 1)[-1] if isinstance(body, dict) else ""


def problem_error(
    status: int, kind: str, detail: str, body: Mapping[str, Any], *, agent: str | None = None
) -> KeelError:
    """The Keel exception a problem answer stands for, its text the server's ``detail``. ``agent``: the agent the
    request named, for :class:`AgentNotFound`."""
    made: KeelError
    agent_id = as_uuid(str(body.get("agent_id", ""))) or UUID(int=0)
    if status in (401, 403):
        made = AccessDenied(detail, status=status)
    elif kind == "stale-revision":
        stale = StaleRevision(
            agent_id=agent_id,
            expected=int(body.get("expected_revision") or 0),
            current=int(body.get("current_revision") or 0),
        )
        state = body.get("current_state")
        stale.current_state = None if state is None else AgentState.model_validate(state)  # type: ignore[attr-defined]
        made = stale
    elif kind == "illegal-transition":
        made = IllegalTransition(
            agent_id=agent_id,
            phase=str(body.get("phase")),
            event=str(body.get("event")),
            allowed=list(body.get("allowed") or ()),
        )
    elif kind == "request-conflict":
        made = RequestConflict(
            request_id=str(body.get("request_id")), owner=agent_id, differs=list(body.get("differs") or ())
        )
    elif (cls := _BY_KIND.get(kind) or _BY_STATUS.get(status, KeelError)) is AgentNotFound:
        made = AgentNotFound(agent or "?")
    else:
        made = cls.__new__(cls)
        # The facts each of these errors carries, as far as the answer gives them (None where it does not).
        for name in _FACTS.get(cls, ()):
            value = body.get(name, agent_id if name == "agent_id" else None)
            setattr(made, name, tuple(value) if isinstance(value, list) else value)
    made.args = (detail,)
    return made


_FACTS: dict[type[KeelError], tuple[str, ...]] = {
    RequestNotFound: ("request_id",),
    AgentExists: ("name",),
    AgentArchived: ("agent_id", "name"),
    AgentBusy: ("agent_id", "name", "phase"),
    AgentInUse: ("agent_id", "name", "phase", "archived", "at_rest"),
    HardDeadlinePassed: ("agent_id", "name", "hard_deadline"),
    MessageNotFound: ("key",),
    MessageNotDead: ("key", "status"),
    UnknownOperation: ("operation", "known"),
}


_BY_KIND: dict[str, type[KeelError]] = {
    "agent-not-found": AgentNotFound,
    "request-not-found": RequestNotFound,
    "agent-exists": AgentExists,
    "agent-archived": AgentArchived,
    "agent-busy": AgentBusy,
    "agent-in-use": AgentInUse,
    "hard-deadline-passed": HardDeadlinePassed,
    "invalid-deadlines": InvalidDeadlines,
    "unknown-operation": UnknownOperation,
    "invalid-input": InvalidInput,
    "outbox-message-not-found": MessageNotFound,
    "outbox-message-not-dead": MessageNotDead,
    "precondition-required": Rejected,
    "store-unavailable": ApiUnavailable,
}
_BY_STATUS: dict[int, type[KeelError]] = {
    400: InvalidInput,
    404: AgentNotFound,
    409: Rejected,
    412: StaleRevision,
    413: InvalidInput,
    422: InvalidInput,
    428: Rejected,
    429: ApiUnavailable,
    500: ApiUnavailable,
    502: ApiUnavailable,
    503: ApiUnavailable,
    504: ApiUnavailable,
}

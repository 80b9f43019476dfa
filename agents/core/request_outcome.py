"""A request's outcome, the one rule every door shows it by (the CLI, the clients, the HTTP API, the console): its
phase as its latest transition left it, the answer when done, why it failed when failed, what its steps spent, and
its side effects with their delivery."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any
from uuid import UUID

from models.schemas import RequestFailure, RequestOutcome, SideEffect


def outcome_of(agent_id: UUID, request_id: str, parts: Mapping[str, Any]) -> RequestOutcome:
    """The outcome of agent ``agent_id``'s request from the parts ``models.outcome_sql.request_outcome_parts`` read."""
    last = parts["last"]
    spend = parts.get("spend") or {}
    return RequestOutcome(
        request_id=request_id,
        agent_id=agent_id,
        phase=last["to_phase"],
        revision=last["revision"],
        at=last["at"],
        answer=answer_of(parts.get("answered")) if last["to_phase"] == "done" else None,
        failure=failure_of(last, parts.get("failed")) if last["to_phase"] == "failed" else None,
        tokens=int(spend.get("tokens") or 0),
        cost=Decimal(str(spend.get("cost") or 0)),
        failed_attempts=dict(parts.get("failed_attempts") or {}),
        side_effects=tuple(SideEffect(**m) for m in parts.get("messages") or ()),
        pruned=not spend.get("steps"),  # every request has a first step: none left means retention took them
    )


def as_seen(outcome: RequestOutcome, *, story: bool) -> RequestOutcome:
    """The outcome as its reader may see it: whole for one who may read the request's story (``read_story``); for
    others (a producer reading its answer) the side effects keep their channel, destination and status but not their
    errors or receiver links, and a failed step keeps its error class but not its error text."""
    if story:
        return outcome
    effects = tuple(e.model_copy(update={"last_error": None, "external_url": None}) for e in outcome.side_effects)
    failure = None if outcome.failure is None else outcome.failure.model_copy(update={"error": None})
    return outcome.model_copy(update={"side_effects": effects, "failure": failure, "partial": True})


def answer_of(step: Mapping[str, Any] | None) -> Any:
    """What the step that finished a request answered (``models.outcome_sql`` reads it: its result's ``answer`` when it
    has one — Keel's own loop and the framework integrations store it there — else a handler's whole result)."""
    if step is None:
        return None
    return step.get("answer")


def failure_of(last: Mapping[str, Any], step: Mapping[str, Any] | None) -> RequestFailure:
    """Why a request failed, from its ``fail`` or ``cancel`` event and the step that failed (if one did)."""
    details = last.get("details") or {}
    if last["event"] == "cancel":
        given = details.get("reason")
        reason = f"cancelled by {last['actor']}" + (f": {given}" if given else "")
    else:
        reason = str(last.get("decision") or "failed")
    return RequestFailure(
        event=last["event"],
        actor=last["actor"],
        reason=reason,
        job=None if step is None else step["key"],
        error_class=None if step is None else step.get("error_class"),
        error=None if step is None else step.get("last_error"),
    )

"""``/v1/agents/{agent}/requests``: submit a request (idempotent by ``Idempotency-Key``) and read its story."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, Depends, Header, Response

from agents.core.errors import RequestConflict, RequestNotFound, StaleRevision
from agents.core.journal import events as journal_events
from agents.core.keys import check_request_id
from agents.core.observe import annotate
from agents.core.request_outcome import as_seen
from agents.ingress.auth import require as require_permission
from agents.ingress.auth import resolve, seen_agents, stale
from agents.ingress.bodies import JsonBodyRoute
from agents.ingress.etags import if_match as if_match_revision
from agents.ingress.problems import BAD_REQUEST, Problem, kind_for
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.schemas import (
    ConversationMessage,
    Links,
    OutboxMessage,
    RequestOut,
    RequestStory,
    RequestView,
    SubmitRequest,
)
from agents.ingress.tokens import ApiToken, Permission
from models.schemas import RequestRecord

router = APIRouter(prefix="/v1/agents/{agent}/requests", tags=["requests"], route_class=JsonBodyRoute)

Keel = Annotated[Ingress, Depends(ingress)]


def _out(record: RequestRecord) -> RequestOut:
    base = f"/v1/agents/{record.agent_id}"
    return RequestOut(
        **record.model_dump(),
        links=Links(
            self=f"{base}/requests/{record.request_id}",
            agent=base,
            story=f"{base}/requests/{record.request_id}/story",
            events=f"{base}/events",
        ),
    )


@router.post(
    "",
    status_code=201,
    response_model=RequestOut,
    summary="Submit a request",
    responses={
        409: {"description": "The Idempotency-Key was used on this agent before with a different request"},
        412: {"description": "If-Match names a revision that is not the current one"},
    },
)
def submit(
    agent: str,
    body: SubmitRequest,
    response: Response,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require_permission(Permission.SUBMIT))],
    idempotency_key: Annotated[
        str | None, Header(description="The request id: 1-128 of letters, digits, '.', '_', '-'")
    ] = None,
    if_match: Annotated[str | None, Header(description='"r<revision>": submit only if the agent is there')] = None,
) -> RequestOut:
    """Starts the request on an idle, done or failed agent. The same ``Idempotency-Key`` with the same body gives the
    original response again (201, ``Idempotent-Replayed: true``) and changes nothing; with a different body a 409
    naming what differs."""
    if idempotency_key is None:
        raise Problem(
            BAD_REQUEST,
            "send an Idempotency-Key header: it is the request id, and a retry under it is never run twice",
        )
    request_id = check_request_id(idempotency_key)
    annotate(request_id=request_id)  # authenticated and checked: the request's lines and span name it from here
    expected = if_match_revision(if_match)
    # Given an id, a token that sees every agent needs no read first (the transition's locking read finds the agent or
    # answers as for a missing one); a prefixed token's agent is checked by name. Request ids are each agent's own.
    agent_id = _uuid(agent) if token.agent_prefix is None else None
    if agent_id is None:
        agent_id = resolve(keel, token, agent).id
    soft = body.soft_deadline or _seconds(body.soft_deadline_seconds)
    hard = body.hard_deadline or _seconds(body.hard_deadline_seconds)
    try:
        done = keel.client.submit_record(
            agent_id,
            request_id,
            body.input,
            expected_revision=expected,
            soft_deadline=soft,
            hard_deadline=hard,
            actor=token.name,
            operation=body.operation,
        )
    except StaleRevision as exc:
        raise stale(keel, token, exc, agent) from None
    annotate(agent_id=agent_id)  # not resolved above when given an id: the request's lines name its agent
    out = _out(done.request)
    response.headers["Location"] = out.links.self
    if done.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return out


def _uuid(ref: str) -> UUID | None:
    try:
        return UUID(ref)
    except ValueError:
        return None


def _seconds(value: float | None) -> timedelta | None:
    return None if value is None else timedelta(seconds=value)


def _record(keel: Keel, token: ApiToken, agent: str, request_id: str) -> RequestRecord:
    found = resolve(keel, token, agent, deleted_ok=True)
    return keel.client.get_request(found.id, request_id)


def _view(keel: Keel, token: ApiToken, record: RequestRecord) -> RequestView:
    outcome = as_seen(keel.client.outcome(record.agent_id, record.request_id), story=token.can(Permission.READ_STORY))
    return RequestView(**_out(record).model_dump(), outcome=outcome)


@router.get("/{request_id}", response_model=RequestView, summary="A request: as submitted, and its outcome")
def get_request(
    agent: str,
    request_id: str,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require_permission(Permission.READ_STATE))],
) -> RequestView:
    """The request as it was submitted, and ``outcome``: its phase, the answer when done, why it failed when failed,
    what its steps spent, and its Slack/GitHub side effects with their delivery (dead ones included). A token that may
    not read the request's story gets it ``partial``: no side effect's error or receiver link, no failed step's
    error text."""
    return _view(keel, token, _record(keel, token, agent, request_id))


@router.get("/{request_id}/story", response_model=RequestStory, summary="Everything that happened for a request")
def story(
    agent: str,
    request_id: str,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require_permission(Permission.READ_STORY))],
) -> RequestStory:
    """The request, its jobs (every step, finished ones included), its journal events and its outbox messages."""
    record = _record(keel, token, agent, request_id)
    return RequestStory(
        request=_out(record),
        outcome=keel.client.outcome(record.agent_id, request_id),
        jobs=keel.client.request_jobs(record.agent_id, request_id),
        journal=journal_events(keel.db, agent_id=record.agent_id, request_id=request_id),
        outbox=[OutboxMessage(**m) for m in keel.client.request_messages(record.agent_id, request_id)],
        conversation=[ConversationMessage(**m) for m in keel.client.conversation(record.agent_id, request_id)],
    )


by_id = APIRouter(prefix="/v1/requests", tags=["requests"], route_class=JsonBodyRoute)


@by_id.get("/{request_id}", response_model=RequestView, summary="A request by its id alone")
def find_request(
    request_id: str,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require_permission(Permission.READ_STATE))],
) -> RequestView:
    """Where a request id (an ``Idempotency-Key``) went: its agent, and links to its story and the agent's events.
    Request ids are each agent's own: only the token's agents are looked at; if several of them have a request of
    this id, a 409 lists them (read it under its agent instead)."""
    check_request_id(request_id)
    mine = seen_agents(keel, token, keel.client.request_agents(request_id))
    if not mine:
        raise RequestNotFound(request_id)
    if len(mine) > 1:
        raise Problem(
            kind_for(RequestConflict),
            f"{len(mine)} of your agents have a request {request_id!r}: read it under its agent,"
            f" /v1/agents/{{agent}}/requests/{request_id}",
            extra={"request_id": request_id, "agents": [str(a) for a in mine]},
        )
    return _view(keel, token, keel.client.get_request(mine[0], request_id))

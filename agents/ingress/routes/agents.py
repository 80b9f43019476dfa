"""``/v1/agents``: create, list and read agents; approve, reject and cancel; their journal and live events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Depends, Header, Query, Response
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from agents.core.errors import StaleRevision
from agents.core.journal import agent_events_after, events_at_revision
from agents.core.observe import annotate
from agents.core.phases import Phase
from agents.ingress.auth import require, resolve, stale
from agents.ingress.bodies import JsonBodyRoute
from agents.ingress.etags import etag, none_match
from agents.ingress.etags import if_match as if_match_revision
from agents.ingress.events import InvalidEventId, parse_last_event_id, sse_events
from agents.ingress.problems import BAD_REQUEST, FORBIDDEN, Problem
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.schemas import MAX_BIGINT, Approval, CreateAgent, Decision, JournalPage
from agents.ingress.streams import Hold
from agents.ingress.tokens import ApiToken, Permission
from models.schemas import AgentPage, AgentState

router = APIRouter(prefix="/v1/agents", tags=["agents"], route_class=JsonBodyRoute)

Keel = Annotated[Ingress, Depends(ingress)]
IfMatch = Annotated[str | None, Header(description='"r<revision>": the revision the decision was made on')]
MAX_PAGE = 1000


def _with_etag(state: AgentState, response: Response) -> AgentState:
    response.headers["ETag"] = etag(state.revision)
    return state


@router.post("", status_code=201, response_model=AgentState, summary="Create an agent")
def create_agent(
    body: CreateAgent,
    response: Response,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.CREATE_AGENT))],
) -> AgentState:
    """An idle agent at revision 0. A name that is taken is a 409."""
    if not token.sees(body.name):
        raise Problem(
            FORBIDDEN,
            f"token {token.name!r} may only create agents whose name starts with {token.agent_prefix!r}",
        )
    state = keel.client.create_agent(
        body.name, budget_tokens=body.budget_tokens, budget_cost=body.budget_cost, actor=token.name
    )
    response.headers["Location"] = f"/v1/agents/{state.id}"
    return _with_etag(state, response)


@router.get("", response_model=AgentPage, summary="List agents, newest first")
def list_agents(
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.READ_STATE))],
    phase: Annotated[list[Phase] | None, Query(description="Only agents in these phases")] = None,
    archived: Annotated[bool, Query(description="The archived agents instead of those in use")] = False,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[str | None, Query(max_length=512, description="The `next` of the previous page")] = None,
) -> AgentPage:
    return keel.client.list_agents(
        phases=[p.value for p in phase or ()],
        archived=archived,
        limit=limit,
        after=cursor,
        name_prefix=token.agent_prefix,
    )


@router.get(
    "/{agent}",
    response_model=AgentState,
    summary="An agent's state",
    responses={304: {"description": "Not modified: the If-None-Match revision is the current one"}},
)
def get_agent(
    agent: str,
    response: Response,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.READ_STATE))],
    if_none_match: Annotated[str | None, Header()] = None,
) -> AgentState | Response:
    """By id or name: phase, revision (also the ETag), deadlines, budget, pending jobs, the call waiting for
    approval."""
    row = resolve(keel, token, agent)
    if none_match(if_none_match, row.revision):
        return Response(status_code=304, headers={"ETag": etag(row.revision)})
    return _with_etag(keel.client.get_state(row.id), response)


def _decide(
    keel: Keel,
    token: ApiToken,
    agent: str,
    if_match: str | None,
    *,
    required: bool,
    act: str,
    reason: str | None,
    arguments: Mapping[str, Any] | None = None,
) -> AgentState:
    expected = if_match_revision(if_match, required=required)
    row = resolve(keel, token, agent)
    if row.row is not None:  # the decision is about the request in flight: the request's lines say so
        annotate(request_id=row.row.request_id)
    try:
        if act == "approve":
            assert expected is not None
            return keel.client.approve(row.id, expected_revision=expected, actor=token.name, arguments=arguments)
        if act == "reject":
            assert expected is not None
            return keel.client.reject(row.id, expected_revision=expected, actor=token.name, reason=reason)
        return keel.client.cancel(row.id, expected_revision=expected, actor=token.name, reason=reason)
    except StaleRevision as exc:
        raise stale(keel, token, exc, agent) from None


@router.post("/{agent}/approve", response_model=AgentState, summary="Approve the call waiting for approval")
def approve(
    agent: str,
    response: Response,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.APPROVE))],
    if_match: IfMatch = None,
    body: Approval | None = None,
) -> AgentState:
    """Requires ``If-Match`` (428 without): a stale revision is a 412 with the current state; an agent that is not
    waiting for approval a 409 naming the events allowed in its phase. ``arguments`` in the body edit the call
    first: arguments its tool refuses are a 422 naming the field, and nothing changes."""
    arguments = body.arguments if body else None
    state = _decide(keel, token, agent, if_match, required=True, act="approve", reason=None, arguments=arguments)
    return _with_etag(state, response)


@router.post("/{agent}/reject", response_model=AgentState, summary="Reject the call waiting for approval")
def reject(
    agent: str,
    response: Response,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.REJECT))],
    if_match: IfMatch = None,
    body: Decision | None = None,
) -> AgentState:
    """The model is told the reason and revises its plan. Requires ``If-Match``, as approve does."""
    reason = body.reason if body else None
    state = _decide(keel, token, agent, if_match, required=True, act="reject", reason=reason)
    return _with_etag(state, response)


@router.post("/{agent}/cancel", response_model=AgentState, summary="Cancel the request in flight")
def cancel(
    agent: str,
    response: Response,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.CANCEL))],
    if_match: IfMatch = None,
    body: Decision | None = None,
) -> AgentState:
    """Any active phase moves to failed. ``If-Match`` is optional."""
    reason = body.reason if body else None
    state = _decide(keel, token, agent, if_match, required=False, act="cancel", reason=reason)
    return _with_etag(state, response)


@router.get("/{agent}/journal", response_model=JournalPage, summary="An agent's journal, oldest first")
def journal(
    agent: str,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.READ_JOURNAL))],
    after: Annotated[int, Query(ge=0, description="Events after this seq (the `next` of the previous page)")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    revision: Annotated[
        int | None, Query(ge=0, le=MAX_BIGINT, description="Only the events at this revision (what moved it there)")
    ] = None,
) -> JournalPage:
    """A deleted agent's journal stays readable (by its id)."""
    agent_id = resolve(keel, token, agent, deleted_ok=True).id
    if revision is not None:
        return JournalPage(events=events_at_revision(keel.db, agent_id, revision, limit=limit))
    found = agent_events_after(keel.db, agent_id, after, limit=limit + 1)
    more = len(found) > limit
    page = found[:limit]
    return JournalPage(events=page, next=page[-1].seq if more else None)


@dataclass(frozen=True)
class _Start:
    agent_id: UUID
    after_seq: int
    token: ApiToken


async def _stream_start(
    agent: str,
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.READ_EVENTS))],
    last_event_id: Annotated[str | None, Header(description="Resume after this journal seq")] = None,
    after: Annotated[
        int | None, Query(ge=0, le=MAX_BIGINT, description="Start after this journal seq (default: from now)")
    ] = None,
) -> _Start:
    """Everything a stream is checked for before its 200 goes out: the token, the agent, where to start. A deleted
    agent's stream may still be resumed from before its end: it delivers what was missed, up to the delete event."""
    found = await run_in_threadpool(resolve, keel, token, agent, deleted_ok=True)
    if last_event_id is not None and last_event_id.strip() == "":
        last_event_id = None  # an empty Last-Event-ID is none at all
    try:
        start = None if last_event_id is None else parse_last_event_id(last_event_id, head=found.journal_seq)
    except InvalidEventId as exc:
        raise Problem(BAD_REQUEST, str(exc)) from None
    if start is None and after is not None:
        if after > found.journal_seq:
            raise Problem(BAD_REQUEST, f"after={after} is past the agent's last journal event ({found.journal_seq})")
        start = after
    if found.row is None and (start is None or start >= found.journal_seq):
        await run_in_threadpool(resolve, keel, token, agent)  # nothing left to deliver: the deleted agent's 404
    return _Start(found.id, found.journal_seq if start is None else start, token)


async def _stream_hold(
    keel: Keel, start: Annotated[_Start, Depends(_stream_start)]
) -> AsyncIterator[tuple[_Start, Hold]]:
    """The stream's place among the process's open streams (a 429 past the caps), held until the stream ends."""
    with keel.streams.admit(start.token) as hold:
        yield start, hold


@router.get(
    "/{agent}/events",
    summary="Follow an agent live (Server-Sent Events)",
    response_class=EventSourceResponse,
)
async def agent_events(
    keel: Keel, held: Annotated[tuple[_Start, Hold], Depends(_stream_hold)]
) -> AsyncIterator[ServerSentEvent]:
    """Each committed journal event of the agent as it commits: ``id`` = its journal seq, ``event`` = its kind
    (transition, rejected, suppressed, created, operator), ``data`` = JSON with revision, phase, from_phase, event,
    actor, request_id, decision, at, details. Reconnect with ``Last-Event-ID`` to get every event missed meanwhile,
    in order, then the live stream; without it the stream starts now (or after ``?after=<seq>``). The stream ends
    once its token is revoked: at its next event, or within 5 s. A token holds at most
    ``KEEL_API_MAX_STREAMS_PER_TOKEN`` streams open, a process ``KEEL_API_MAX_STREAMS_PER_PROCESS``: past either,
    a 429."""
    start, hold = held
    async for message in sse_events(keel.listener, start.agent_id, start.after_seq, guard=hold):
        yield message

"""One agent's page: its state, a page of its journal and what was verified of it, its request's jobs and messages
(redrawn live), and the Approve, Edit and Reject forms. Every decision goes through the same
:class:`~agents.client.Client` calls as the API's routes, with the signed-in token's name as the actor, at the revision
the form was drawn at: a stale one is refused, naming who moved the agent and to which revision."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, RedirectResponse, Response

from agents.core.errors import AgentNotFound, InvalidInput, KeelError, RequestNotFound, StaleRevision
from agents.core.journal import journal_page
from agents.core.journal.verdict import Verdict
from agents.core.request_outcome import as_seen
from agents.ingress.auth import resolve
from agents.ingress.console import paging, sessions, views
from agents.ingress.console.common import Held, Keel, Viewer, Who, bad_cursor, checked, link, page, read_form
from agents.ingress.console.paging import BadCursor
from agents.ingress.events import sse_events
from agents.ingress.problems import kind_of
from agents.ingress.runtime import Ingress
from agents.ingress.tokens import Permission
from models import alerts_sql, approvals_sql
from models.jobs_sql import job_row
from models.schemas import AgentState

router = APIRouter(include_in_schema=False)

#: How many of the moves since a stale decision's revision its notice names.
STALE_MOVES_SHOWN = 10


def _found(keel: Ingress, who: Viewer, ref: str) -> tuple[UUID, AgentState] | None:
    try:
        found = resolve(keel, who.token, ref)
    except AgentNotFound:
        return None
    return found.id, keel.client.get_state(found.id)


def _agent_context(keel: Ingress, who: Viewer, state: AgentState, before: int | None = None) -> dict[str, Any]:
    """Everything the agent page shows besides the state: a page of the journal (its latest events, or those before
    event ``before``) and what was verified of it, the latest full verification, the request's records."""
    journal = journal_page(keel.db, state.id, before=before, limit=keel.settings.console_page_size)
    if journal is None:  # deleted since its state was read
        raise AgentNotFound(str(state.id))
    events = list(reversed(journal.events))  # oldest first
    request_id = state.request_id or next((e.request_id for e in reversed(events) if e.request_id), None)
    jobs: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    if request_id and who.can(Permission.READ_STORY):
        # The same reads as the API's story: scoped to this agent, whoever else used the id.
        jobs = [row for job in keel.client.request_jobs(state.id, request_id) if (row := job_row(keel.db, job.key))]
        messages = keel.client.request_messages(state.id, request_id)
    waiting_since = None
    conversation: list[dict[str, Any]] = []
    if state.phase == "waiting_approval":  # since its gate finished, as the inbox says (not its latest move)
        call = approvals_sql.waiting_call(keel.db, state.id)
        waiting_since = call.since if call is not None else state.updated_at
    # What an approver decides on, with the call (READ_APPROVALS: what waits, and why); and part of the request's
    # story for whoever reads that: the prompt, the model's replies and reasoning, the calls and their results.
    waiting = state.phase == "waiting_approval" and state.pending_approval and who.can(Permission.READ_APPROVALS)
    if request_id and (waiting or who.can(Permission.READ_STORY)):
        conversation = keel.client.conversation(state.id, request_id)
    outcome = None
    if request_id:
        try:
            outcome = as_seen(keel.client.outcome(state.id, request_id), story=who.can(Permission.READ_STORY))
        except RequestNotFound:  # its journal's month was archived
            outcome = None
    # The agent's side effects that never arrived, for whoever may read the outbox.
    dead = keel.client.dead_messages(state.id) if who.can(Permission.READ_OUTBOX) else 0
    path = f"/agents/{state.id}"
    return {
        "outcome": outcome,
        "dead_messages": dead,
        "events": list(journal.events),
        "journal": journal,
        "journal_head": journal.head_seq,
        "chain_break": journal.broken,
        "full_check": _full_check(keel, state.id),
        "older_url": journal.older and link(path, cursor=journal.older),
        "newest_url": None if journal.at_head else path,
        "journal_cursor": before,
        "request_id": request_id,
        "jobs": jobs,
        "messages": messages,
        "waiting_since": waiting_since,
        "conversation": conversation,
    }


@dataclass(frozen=True, slots=True)
class FullCheck:
    """The latest recorded ``keel audit verify`` (full or incremental) as the agent page tells it."""

    verification: alerts_sql.Verification
    #: The first broken event of this agent's chain it found, if it listed this agent (it lists 20 at most).
    broken_at: int | None
    #: What it checked and what it trusted from checkpoints (None: recorded before verify kept them apart).
    verdict: Verdict | None = None


def _full_check(keel: Ingress, agent_id: UUID) -> FullCheck | None:
    found = alerts_sql.last_verification(keel.db)
    if found is None:
        return None
    breaks = found.details.get("breaks", []) if isinstance(found.details, dict) else []
    mine = next((b.get("seq") for b in breaks if isinstance(b, dict) and b.get("agent_id") == str(agent_id)), None)
    details = found.details if isinstance(found.details, dict) else {}
    verdict = Verdict.recorded(ok=found.ok, agents=found.agents, details=details)
    return FullCheck(found, mine if isinstance(mine, int) else None, verdict)


def _journal_cursor(who: Viewer, cursor: str | None, path: str) -> int | HTMLResponse | None:
    """The journal page's cursor (events before this seq), or the 400 page naming a bad one."""
    if not cursor:
        return None
    try:
        return paging.seq_cursor(cursor, low=2)
    except BadCursor as exc:
        return bad_cursor(who, exc, path)


@router.get("/agents/{ref}")
def agent_page(
    ref: str,
    keel: Keel,
    who: Who,
    cursor: Annotated[str | None, Query()] = None,
    decided: Annotated[str | None, Query()] = None,
    proof: Annotated[str | None, Query()] = None,
) -> HTMLResponse:
    """The agent's page; after a decision made on it, a notice confirming it — only for the session that made it
    (``proof``, see :func:`sessions.notice_proof`): a crafted link shows no text of its own."""
    found = _found(keel, who, ref)
    if found is None:
        return page("message.html", who, status=404, title="No such agent", message=f"No agent is called {ref!r}.")
    _, state = found
    before = _journal_cursor(who, cursor, f"/agents/{state.id}")
    if isinstance(before, HTMLResponse):
        return before
    done = None
    if sessions.notice_ok(sessions.session_key(keel.settings), who.session, decided, proof):
        done = _decided_notice(decided or "")
    context = _agent_context(keel, who, state, before)
    return page("agent.html", who, state=state, drawn=state.revision, decided=done, **context)


#: What a decision made on the agent page is confirmed with, by act.
_DECIDED = {
    "approve": "Approved at revision {0}: the call runs next.",
    "reject": "Rejected at revision {0}: the call will not run, and the model is told why.",
}


def _decided_notice(decided: str) -> str | None:
    """``approve:5`` (as the decision's redirect names it) as the notice the page shows."""
    act, _, revision = decided.partition(":")
    if act not in _DECIDED or not revision.isdigit():
        return None
    return _DECIDED[act].format(revision)


@router.get("/agents/{ref}/panel")
def agent_panel(
    ref: str,
    keel: Keel,
    who: Who,
    drawn: Annotated[int, Query(ge=0)] = 0,
    cursor: Annotated[str | None, Query()] = None,
    forms: Annotated[bool, Query()] = False,
) -> HTMLResponse:
    """The agent page's live part (state, journal, jobs, outbox), redrawn by the script; the decision forms stay
    as they were drawn, at their revision, and the journal at the page it shows."""
    found = _found(keel, who, ref)
    if found is None:
        return page("message.html", who, status=404, title="No such agent", message=f"No agent is called {ref!r}.")
    _, state = found
    before = _journal_cursor(who, cursor, f"/agents/{state.id}")
    if isinstance(before, HTMLResponse):
        return before
    context = _agent_context(keel, who, state, before)
    return page("agent_panel.html", who, state=state, drawn=drawn, forms=forms, **context)


@router.get("/agents/{ref}/live", response_class=EventSourceResponse)
async def agent_live(
    ref: str, keel: Keel, who: Who, hold: Held, after: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None
) -> AsyncIterator[ServerSentEvent]:
    """The agent's journal events as they commit (the API's live events, for the session's token), after the
    journal seq the page was drawn at: what committed while the page loaded arrives too."""
    found = await run_in_threadpool(_found, keel, who, ref)
    if found is None:
        return
    agent_id, _ = found
    head = (await run_in_threadpool(keel.client.agent_row, agent_id)).journal_seq
    start = head if after is None else min(after, head)
    async for message in sse_events(keel.listener, agent_id, start, guard=hold):
        yield message


async def _decide(request: Request, ref: str, keel: Ingress, who: Viewer, act: str) -> Response:
    form = await read_form(request)
    refusal = checked(who, form, Permission.APPROVE if act == "approve" else Permission.REJECT)
    if refusal is not None:
        return refusal
    return await run_in_threadpool(_apply, keel, who, ref, act, form)


def _apply(keel: Ingress, who: Viewer, ref: str, act: str, form: dict[str, str]) -> Response:
    found = _found(keel, who, ref)
    if found is None:
        return page("message.html", who, status=404, title="No such agent", message=f"No agent is called {ref!r}.")
    agent_id, _ = found
    try:
        drawn = int(form.get("revision", ""))
    except ValueError:
        return page("message.html", who, status=400, title="Bad form", message="The form names no revision.")
    reason = form.get("reason", "").strip() or None
    # The edit form sends the arguments as typed; the plain Approve form sends none (the call runs as it is).
    typed = form.get("arguments") if act == "approve" else None
    arguments = None
    if typed is not None:
        try:
            arguments = views.edited_arguments(typed)
        except ValueError as exc:
            return _edit_refused(keel, who, agent_id, drawn, typed, str(exc))
    try:
        if act == "approve":
            keel.client.approve(agent_id, expected_revision=drawn, actor=who.token.name, arguments=arguments)
        else:
            keel.client.reject(agent_id, expected_revision=drawn, actor=who.token.name, reason=reason)
    except StaleRevision as exc:
        state = keel.client.get_state(agent_id)
        context = _agent_context(keel, who, state)
        # Every move since the revision the decision was made on, oldest first: who moved it, and to where.
        moves = sorted(
            (e for e in context["events"] if e.kind == "transition" and e.revision > drawn), key=lambda e: e.seq
        )
        return page(
            "agent.html",
            who,
            status=412,
            state=state,
            drawn=state.revision,
            stale={"act": act, "drawn": drawn, "current": exc.current_revision, "moves": moves[:STALE_MOVES_SHOWN]},
            **context,
        )
    except KeelError as exc:
        if typed is not None and isinstance(exc, InvalidInput):  # the tool refused the edit
            return _edit_refused(keel, who, agent_id, drawn, typed, str(exc))
        state = keel.client.get_state(agent_id)
        return page(
            "agent.html",
            who,
            status=kind_of(exc).status,
            state=state,
            drawn=state.revision,
            error=str(exc),
            **_agent_context(keel, who, state),
        )
    decided = f"{act}:{drawn}"
    proof = sessions.notice_proof(sessions.session_key(keel.settings), who.session, decided)
    return RedirectResponse(link(f"/agents/{agent_id}", decided=decided, proof=proof), status_code=303)


def _edit_refused(keel: Ingress, who: Viewer, agent_id: UUID, drawn: int, typed: str, error: str) -> HTMLResponse:
    """The agent page again after an edit the tool (or JSON) refused: nothing was applied or journaled (as over the
    API). The edit form keeps what was typed, at the revision it was drawn at, unless the agent has moved since:
    then the forms are drawn anew for the call waiting now."""
    state = keel.client.get_state(agent_id)
    moved = state.revision != drawn
    error = error if error.endswith(".") else error + "."
    if moved:
        error += f" The agent has moved since, to revision {state.revision} ({state.phase}): the forms are drawn anew."
    return page(
        "agent.html",
        who,
        status=422,
        state=state,
        drawn=state.revision,
        edit_error=error,
        edited=None if moved else typed,
        **_agent_context(keel, who, state),
    )


@router.post("/agents/{ref}/approve")
async def approve(ref: str, request: Request, keel: Keel, who: Who) -> Response:
    return await _decide(request, ref, keel, who, "approve")


@router.post("/agents/{ref}/reject")
async def reject(ref: str, request: Request, keel: Keel, who: Who) -> Response:
    return await _decide(request, ref, keel, who, "reject")

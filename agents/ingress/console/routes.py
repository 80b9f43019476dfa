"""The operator console's pages, served by the API's app under ``/``: rendered on the server, readable without
JavaScript; a small script follows the journal's live events to redraw what changed.

Every decision goes through the same :class:`~agents.client.Client` calls as the API's routes, with the signed-in
token's name as the actor, and every form carries the revision it was drawn at: a stale one is refused and the page
says who moved the agent, and to which revision."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote, urlencode
from uuid import UUID

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.routing import APIRoute
from fastapi.sse import EventSourceResponse, ServerSentEvent
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from agents.core.commands import check_text
from agents.core.errors import AgentNotFound, InvalidInput, KeelError, StaleRevision
from agents.core.journal import journal_page
from agents.core.journal.verdict import Verdict
from agents.core.phases import Phase
from agents.ingress.auth import resolve, sees_named
from agents.ingress.console import paging, sessions, views
from agents.ingress.console.headers import STATIC_PATH, ConsoleHeaders
from agents.ingress.console.paging import BadCursor
from agents.ingress.console.sessions import Session
from agents.ingress.events import ANY_AGENT, sse_events
from agents.ingress.problems import kind_of
from agents.ingress.ratelimit import headers as rate_headers
from agents.ingress.routes.approvals import approvals_for
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.streams import Hold
from agents.ingress.tokens import ApiToken, Permission, live_token
from models import alerts_sql, approvals_sql, console_sql, kpi_sql
from models.jobs_sql import job_row
from models.outbox_sql import UNSENT, message_row, unsent_page
from models.schemas import AgentState

router = APIRouter(include_in_schema=False)
Keel = Annotated[Ingress, Depends(ingress)]

STATIC = Path(__file__).parent / "static"
#: How many of the moves since a stale decision's revision its notice names.
STALE_MOVES_SHOWN = 10
#: How often the live list of agents redraws at most (seconds): a burst of transitions is one redraw.
LIST_REDRAW_SECONDS = 0.5
#: The KPI charts' span and the counters they draw.
CHART_SPAN = timedelta(hours=1)
CHARTS = (
    ("requests_finished", "Requests finished per minute"),
    ("job_attempt_failures", "Failed attempts per minute"),
    ("suppressed_duplicates", "Suppressed duplicates per minute"),
    ("side_effect_confirmations", "Confirmed deliveries per minute"),
    ("spent_tokens", "Tokens spent per minute"),
)

templates = Environment(
    loader=PackageLoader("agents.ingress.console", "templates"),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)
templates.filters["spend"] = views.spend
templates.filters["pretty"] = views.pretty
templates.filters["compact"] = views.compact


class SignInRequired(KeelError):
    """Sign in to the console first: there is no valid session (pages send the person to the sign-in form, scripts
    get a 401)."""


class OverRate(KeelError):
    """The signed-in token is over its rate (the API's per-token limit, which the console's POSTs count against
    too): nothing was changed; wait and send it again."""

    def __init__(self, viewer: Viewer, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.viewer = viewer
        self.headers = headers


@dataclass(frozen=True, slots=True)
class Viewer:
    """The signed-in person: their API token and their session."""

    token: ApiToken
    session: Session

    def can(self, permission: Permission | str) -> bool:
        return self.token.can(Permission(permission))


async def viewer(request: Request, keel: Keel) -> Viewer:
    """A dependency: the signed-in person, if the session cookie is good and its token still live."""
    session = sessions.decode_session(sessions.session_key(keel.settings), request.cookies.get(sessions.SESSION_COOKIE))
    if session is None:
        raise SignInRequired
    token = await run_in_threadpool(_signed_in_token, keel, session)
    if token is None or not sessions.may_sign_in(token):
        raise SignInRequired
    found = Viewer(token, session)
    if request.method == "POST":  # every decision, retry and sign-out: in the token's bucket, as its API calls are
        await _count_against_rate(keel, found)
    return found


def _signed_in_token(keel: Ingress, session: Session) -> ApiToken | None:
    """The session's token if it is live and the session was not signed out."""
    if console_sql.signed_out(keel.db, sessions.session_id(session)):
        return None
    return live_token(keel.db, session.token_id)


async def _count_against_rate(keel: Ingress, who: Viewer) -> None:
    if keel.limiter is None:
        return
    policy = keel.policy_for(who.token)
    decision = await run_in_threadpool(keel.limiter.check, str(who.token.id), policy)
    if not decision.allowed:
        limits = rate_headers(decision, policy)
        raise OverRate(
            who,
            f"Token {who.token.name!r} is over its rate ({policy.rate_per_second:g} requests a second, burst"
            f" {policy.burst}, shared with its API calls): wait {limits['Retry-After']} seconds and send it again."
            " Nothing was changed.",
            limits,
        )


Who = Annotated[Viewer, Depends(viewer)]


async def on_sign_in_required(request: Request, exc: Exception) -> Response:
    if request.method == "GET" and request.headers.get("accept", "").startswith("text/html"):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/signin?next={quote(target, safe='')}", status_code=303)
    if request.method == "GET" and "text/event-stream" not in request.headers.get("accept", ""):
        return RedirectResponse("/signin", status_code=303)
    return HTMLResponse(_render("message.html", None, title="Signed out", message="Sign in again."), status_code=401)


async def on_over_rate(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OverRate)
    return _page(
        "message.html", exc.viewer, status=429, headers=exc.headers, title="Too many requests", message=str(exc)
    )


def install(app: FastAPI) -> None:
    """Serve the console from ``app``: its pages, its static files, its sign-in redirect, and its headers on every
    answer under its paths."""
    app.add_exception_handler(SignInRequired, on_sign_in_required)
    app.add_exception_handler(OverRate, on_over_rate)
    app.mount(STATIC_PATH, StaticFiles(directory=STATIC), name="static")
    app.include_router(router)
    sections = {route.path.split("/")[1] for route in router.routes if isinstance(route, APIRoute)} - {""}
    app.add_middleware(ConsoleHeaders, sections=sections)


def _render(name: str, who: Viewer | None, **context: Any) -> str:
    return templates.get_template(name).render(who=who, now=datetime.now(UTC), views=views, **context)


def _page(
    name: str, who: Viewer | None, *, status: int = 200, headers: dict[str, str] | None = None, **context: Any
) -> HTMLResponse:
    """A page (its security headers are added on the way out, as to every console answer: :class:`ConsoleHeaders`)."""
    return HTMLResponse(_render(name, who, **context), status_code=status, headers=headers)


def _refused(who: Viewer, message: str, status: int = 403) -> HTMLResponse:
    return _page("message.html", who, status=status, title="Not allowed", message=message)


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (the console's forms send nothing else): its first values."""
    body = await request.body()
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        return {}
    return {name: values[0] for name, values in fields.items()}


def _checked(who: Viewer, form: dict[str, str], permission: Permission) -> HTMLResponse | None:
    """The refusal of a POST: a CSRF token that is not the session's, or a token without ``permission``."""
    if not sessions.csrf_ok(who.session, form.get("csrf")):
        return _refused(who, "The form was not sent from this session's console (CSRF check): nothing was changed.")
    if not who.can(permission):
        scopes = ", ".join(sorted(who.token.scopes))
        action = permission.value.replace("_", " ")
        return _refused(who, f"Token {who.token.name!r} (scopes: {scopes}) may not {action}: nothing was changed.")
    return None


# --- signing in and out ------------------------------------------------------------------------------------------


def _signin_page(
    keel: Ingress,
    next_url: str,
    *,
    error: str | None = None,
    status: int = 200,
    headers: dict[str, str] | None = None,
) -> HTMLResponse:
    nonce, cookie = sessions.new_signin_nonce(sessions.session_key(keel.settings))
    response = _page("signin.html", None, status=status, headers=headers, csrf=nonce, next_url=next_url, error=error)
    sessions.set_cookie(response, keel.settings, sessions.SIGNIN_COOKIE, cookie, max_age=sessions.SIGNIN_SECONDS)
    return response


def _safe_next(value: str | None) -> str:
    # Only a path on this site: never an open redirect.
    if value and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/agents"


@router.get("/")
async def home() -> Response:
    return RedirectResponse("/agents", status_code=303)


@router.get("/signin")
async def signin_form(keel: Keel, next: str | None = None) -> Response:
    return _signin_page(keel, _safe_next(next))


@router.post("/signin")
async def signin(request: Request, keel: Keel) -> Response:
    form = await _form(request)
    next_url = _safe_next(form.get("next"))
    key = sessions.session_key(keel.settings)
    if not sessions.signin_nonce_ok(key, request.cookies.get(sessions.SIGNIN_COOKIE), form.get("csrf")):
        return _signin_page(keel, next_url, error="The sign-in form expired: try again.", status=403)
    secret = form.get("token", "").strip()
    attempt = await run_in_threadpool(keel.try_token, request.client.host if request.client else None, secret)
    if attempt.refused:
        return _signin_page(
            keel,
            next_url,
            error=f"Too many failed sign-ins from your address: wait {attempt.retry_after} seconds, then try again"
            " (the token was not checked).",
            status=429,
            headers=attempt.headers,
        )
    token = attempt.token
    if token is None:
        return _signin_page(
            keel, next_url, error="That token is unknown or revoked.", status=401, headers=attempt.headers
        )
    if not sessions.may_sign_in(token):
        return _signin_page(
            keel,
            next_url,
            error=f"Token {token.name!r} is a producer token: the console needs an approver, operator or auditor one.",
            status=403,
        )
    response = RedirectResponse(next_url, status_code=303)
    cookie = sessions.encode_session(key, sessions.new_session(token))
    sessions.set_cookie(response, keel.settings, sessions.SESSION_COOKIE, cookie, max_age=sessions.SESSION_SECONDS)
    sessions.clear_cookie(response, keel.settings, sessions.SIGNIN_COOKIE)
    return response


@router.post("/signout")
async def signout(request: Request, keel: Keel, who: Who) -> Response:
    form = await _form(request)
    if not sessions.csrf_ok(who.session, form.get("csrf")):
        return _refused(who, "The form was not sent from this session's console (CSRF check).")
    # Ended here, not only in this browser: a copy of the cookie is refused from now on too.
    await run_in_threadpool(
        console_sql.sign_out, keel.db, sessions.session_id(who.session), sessions.expires_at(who.session)
    )
    response = RedirectResponse("/signin", status_code=303)
    sessions.clear_cookie(response, keel.settings, sessions.SESSION_COOKIE)
    return response


# --- paging ------------------------------------------------------------------------------------------------------


def _link(path: str, **query: str | int | None) -> str:
    """``path`` with the query parameters that have a value (a list's filter and cursor)."""
    given = {name: value for name, value in query.items() if value is not None and value != ""}
    return f"{path}?{urlencode(given)}" if given else path


def _bad_cursor(who: Viewer, exc: BadCursor, first_page: str) -> HTMLResponse:
    return _page(
        "message.html",
        who,
        status=400,
        title="Unknown page cursor",
        message=f"The page cursor {exc.cursor[:80]!r} is not one this list made (mistyped, cut short, or from"
        " another list or filter): start again from the first page.",
        back=first_page,
    )


# --- agents ------------------------------------------------------------------------------------------------------


def _agents(keel: Ingress, who: Viewer, phase: str | None, cursor: str | None) -> tuple[list[AgentState], str | None]:
    """A page of the agents the viewer sees, in the order people handle them, and the next page's cursor."""
    after = None if cursor is None else paging.agents_key(cursor)
    try:
        rows, next_key = console_sql.agents_page(
            keel.db,
            phases=[phase] if phase else [],
            after=after,
            limit=keel.settings.console_page_size,
            name_prefix=who.token.agent_prefix,
        )
    except ValueError:  # a cursor from another filter's list
        assert cursor is not None
        raise BadCursor(cursor) from None
    return [AgentState.of(row) for row in rows], None if next_key is None else paging.agents_cursor(next_key)


PHASES = [p.value for p in Phase]


def _unknown_phase(who: Viewer, phase: str | None) -> HTMLResponse | None:
    if not phase or phase in PHASES:
        return None
    message = f"There is no phase {phase[:60]!r}: the phases are {', '.join(PHASES)}."
    return _page("message.html", who, status=400, title="Unknown phase", message=message)


def _agents_list(keel: Ingress, who: Viewer, phase: str | None, cursor: str | None) -> dict[str, Any]:
    agents, next_cursor = _agents(keel, who, phase, cursor)
    return {
        "agents": agents,
        "phase": phase,
        "cursor": cursor,
        "next_url": next_cursor and _link("/agents", phase=phase, cursor=next_cursor),
        "first_url": _link("/agents", phase=phase),
    }


@router.get("/agents")
def agents_page(
    keel: Keel,
    who: Who,
    phase: Annotated[str | None, Query()] = None,
    cursor: Annotated[str | None, Query()] = None,
) -> HTMLResponse:
    refused = _unknown_phase(who, phase)
    if refused is not None:
        return refused
    try:
        listed = _agents_list(keel, who, phase or None, cursor or None)
    except BadCursor as exc:
        return _bad_cursor(who, exc, _link("/agents", phase=phase))
    return _page("agents.html", who, phases=PHASES, **listed)


@router.get("/agents/rows")
def agents_rows(keel: Keel, who: Who, phase: Annotated[str | None, Query()] = None) -> HTMLResponse:
    """The list of the first page alone (its rows and its link to the next page): what the live script swaps in.
    Later pages are not redrawn live."""
    return _unknown_phase(who, phase) or _page("agents_rows.html", who, **_agents_list(keel, who, phase or None, None))


async def _hold(keel: Keel, who: Who) -> AsyncIterator[Hold]:
    """A live stream's place among the process's open streams (a 429 past the caps), held until it ends."""
    with keel.streams.admit(who.token) as hold:
        yield hold


Held = Annotated[Hold, Depends(_hold)]


@router.get("/agents/live", response_class=EventSourceResponse)
async def agents_live(keel: Keel, who: Who, hold: Held) -> AsyncIterator[ServerSentEvent]:
    """A ``changed`` event whenever the journal of an agent the session's token sees moves (at most every half
    second): the script then fetches the rows again. Ends when the session's token is revoked."""
    with keel.listener.subscribe(ANY_AGENT, sees=partial(sees_named, who.token)) as sub:
        while True:
            await sub.wait(or_=hold.ended)
            if keel.listener.stopped or hold.ended.is_set():
                return
            sub.clear()  # at once: what commits while the event goes out or the redraw pause lasts wakes it again
            if not await hold.allowed():
                return
            yield ServerSentEvent(event="changed", data={})
            await asyncio.sleep(LIST_REDRAW_SECONDS)


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
    if state.phase == "waiting_approval":  # since its gate finished, as the inbox says (not its latest move)
        call = approvals_sql.waiting_call(keel.db, state.id)
        waiting_since = call.since if call is not None else state.updated_at
    path = f"/agents/{state.id}"
    return {
        "events": list(journal.events),
        "journal": journal,
        "journal_head": journal.head_seq,
        "chain_break": journal.broken,
        "full_check": _full_check(keel, state.id),
        "older_url": journal.older and _link(path, cursor=journal.older),
        "newest_url": None if journal.at_head else path,
        "journal_cursor": before,
        "request_id": request_id,
        "jobs": jobs,
        "messages": messages,
        "waiting_since": waiting_since,
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
        return _bad_cursor(who, exc, path)


@router.get("/agents/{ref}")
def agent_page(ref: str, keel: Keel, who: Who, cursor: Annotated[str | None, Query()] = None) -> HTMLResponse:
    found = _found(keel, who, ref)
    if found is None:
        return _page("message.html", who, status=404, title="No such agent", message=f"No agent is called {ref!r}.")
    _, state = found
    before = _journal_cursor(who, cursor, f"/agents/{state.id}")
    if isinstance(before, HTMLResponse):
        return before
    return _page("agent.html", who, state=state, drawn=state.revision, **_agent_context(keel, who, state, before))


@router.get("/agents/{ref}/panel")
def agent_panel(
    ref: str,
    keel: Keel,
    who: Who,
    drawn: Annotated[int, Query(ge=0)] = 0,
    cursor: Annotated[str | None, Query()] = None,
) -> HTMLResponse:
    """The agent page's live part (state, journal, jobs, outbox), redrawn by the script; the decision forms stay
    as they were drawn, at their revision, and the journal at the page it shows."""
    found = _found(keel, who, ref)
    if found is None:
        return _page("message.html", who, status=404, title="No such agent", message=f"No agent is called {ref!r}.")
    _, state = found
    before = _journal_cursor(who, cursor, f"/agents/{state.id}")
    if isinstance(before, HTMLResponse):
        return before
    return _page("agent_panel.html", who, state=state, drawn=drawn, **_agent_context(keel, who, state, before))


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
    form = await _form(request)
    refused = _checked(who, form, Permission.APPROVE if act == "approve" else Permission.REJECT)
    if refused is not None:
        return refused
    return await run_in_threadpool(_apply, keel, who, ref, act, form)


def _apply(keel: Ingress, who: Viewer, ref: str, act: str, form: dict[str, str]) -> Response:
    found = _found(keel, who, ref)
    if found is None:
        return _page("message.html", who, status=404, title="No such agent", message=f"No agent is called {ref!r}.")
    agent_id, _ = found
    try:
        drawn = int(form.get("revision", ""))
    except ValueError:
        return _page("message.html", who, status=400, title="Bad form", message="The form names no revision.")
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
        return _page(
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
        return _page(
            "agent.html",
            who,
            status=kind_of(exc).status,
            state=state,
            drawn=state.revision,
            error=str(exc),
            **_agent_context(keel, who, state),
        )
    return RedirectResponse(f"/agents/{agent_id}", status_code=303)


def _edit_refused(keel: Ingress, who: Viewer, agent_id: UUID, drawn: int, typed: str, error: str) -> HTMLResponse:
    """The agent page again after an edit the tool (or JSON) refused: nothing was applied or journaled (as over the
    API). The edit form keeps what was typed, at the revision it was drawn at, unless the agent has moved since:
    then the forms are drawn anew for the call waiting now."""
    state = keel.client.get_state(agent_id)
    moved = state.revision != drawn
    error = error if error.endswith(".") else error + "."
    if moved:
        error += f" The agent has moved since, to revision {state.revision} ({state.phase}): the forms are drawn anew."
    return _page(
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


# --- the inbox ---------------------------------------------------------------------------------------------------

#: How many waiting calls one page of the inbox shows (``?limit=``: up to ``INBOX_MAX_PAGE``); a link pages on with
#: the API's keyset cursor.
INBOX_PAGE = 50
INBOX_MAX_PAGE = 200


@dataclass(frozen=True, slots=True)
class InboxQuery:
    """The inbox's filters as given in the page's address (the GET form's fields), unparsed."""

    tool: str = ""
    min_age: str = ""
    agent_prefix: str = ""
    limit: str = ""
    cursor: str = ""

    def url(self, path: str, *, cursor: str | None = None) -> str:
        """``path`` with these filters (and ``cursor``) as its query."""
        fields = {
            "tool": self.tool,
            "min_age": self.min_age,
            "agent_prefix": self.agent_prefix,
            "limit": self.limit,
            "cursor": cursor,
        }
        query = urlencode({name: value for name, value in fields.items() if value})
        return f"{path}?{query}" if query else path

    def page_size(self) -> int:
        if not self.limit:
            return INBOX_PAGE
        size = int(self.limit) if self.limit.isdecimal() and len(self.limit) <= 6 else 0
        if not 1 <= size <= INBOX_MAX_PAGE:
            shown = self.limit if len(self.limit) <= 20 else self.limit[:19] + "…"
            raise ValueError(f"limit must be a whole number from 1 to {INBOX_MAX_PAGE}, got {shown!r}")
        return size


def inbox_query(
    tool: Annotated[str | None, Query()] = None,
    min_age: Annotated[str | None, Query()] = None,
    agent_prefix: Annotated[str | None, Query()] = None,
    limit: Annotated[str | None, Query()] = None,
    cursor: Annotated[str | None, Query()] = None,
) -> InboxQuery:
    """A dependency: the inbox's filters, taken as text (checked by :func:`_inbox`, which names a bad one)."""
    given = (tool, min_age, agent_prefix, limit, cursor)
    return InboxQuery(*((value or "").strip() for value in given))


Filters = Annotated[InboxQuery, Depends(inbox_query)]
#: The inbox's filters by name: a refusal's message begins with the one it refuses.
INBOX_FIELDS = ("tool", "min_age", "agent_prefix", "limit", "cursor")


def _inbox(keel: Ingress, who: Viewer, q: InboxQuery) -> dict[str, Any]:
    """One page of the calls waiting, through the API's own query; a bad filter is an ``error`` naming it."""
    try:
        page = approvals_for(
            keel.client,
            who.token,
            tool=q.tool or None,
            min_age=views.parse_age(q.min_age),
            agent_prefix=q.agent_prefix or None,
            limit=q.page_size(),
            cursor=q.cursor or None,
        )
    except (InvalidInput, ValueError) as exc:
        error = str(exc)
        field = next((name for name in INBOX_FIELDS if error.startswith(name + " ")), None)
        return {"q": q, "calls": (), "error": error, "error_field": field, "next_url": None, "first_url": None}
    return {
        "q": q,
        "calls": page.approvals,
        "error": None,
        "error_field": None,
        "next_url": q.url("/inbox", cursor=page.next) if page.next else None,
        "first_url": q.url("/inbox") if q.cursor else None,
    }


@router.get("/inbox")
def inbox_page(keel: Keel, who: Who, q: Filters) -> HTMLResponse:
    """Every call waiting for approval across the agents the token sees, oldest first; live."""
    if not who.can(Permission.READ_APPROVALS):
        return _refused(who, f"Token {who.token.name!r} may not read the approvals inbox.")
    context = _inbox(keel, who, q)
    status = 400 if context["error"] else 200
    return _page("inbox.html", who, status=status, rows_url=q.url("/inbox/rows", cursor=q.cursor), **context)


@router.get("/inbox/rows")
def inbox_rows(keel: Keel, who: Who, q: Filters) -> HTMLResponse:
    """The inbox's list alone: what the live script swaps in."""
    if not who.can(Permission.READ_APPROVALS):
        return _refused(who, f"Token {who.token.name!r} may not read the approvals inbox.")
    context = _inbox(keel, who, q)
    return _page("inbox_list.html", who, status=400 if context["error"] else 200, **context)


# --- outbox ------------------------------------------------------------------------------------------------------

OUTBOX_STATUSES = UNSENT
#: The longest message key a Retry form may name (a key is far shorter; the limit only bounds the lookup).
MAX_KEY_CHARS = 2000


def _outbox(keel: Ingress, who: Viewer, status: str | None = None, before: int | None = None) -> dict[str, Any]:
    """A page of the messages not sent (newest first; only ``status`` if given; created before ``before`` if given),
    grouped per channel and destination, and the link to the next page."""
    size = keel.settings.console_page_size
    rows = unsent_page(keel.db, status=status, before_seq=before, limit=size + 1, name_prefix=who.token.agent_prefix)
    more = len(rows) > size
    rows = rows[:size]
    statuses = (status,) if status else OUTBOX_STATUSES
    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for row in rows:
        group = groups.setdefault((row["channel"], row["destination"]), {s: [] for s in statuses})
        group[row["status"]].append(row)
    return {
        "groups": dict(sorted(groups.items())),
        "statuses": statuses,
        "all_statuses": OUTBOX_STATUSES,
        "status_filter": status,
        "cursor": before,
        "paged": more or before is not None,
        "next_url": _link("/outbox", status=status, cursor=rows[-1]["seq"]) if more else None,
        "first_url": _link("/outbox", status=status),
    }


@router.get("/outbox")
def outbox_page(
    keel: Keel,
    who: Who,
    status: Annotated[str | None, Query()] = None,
    cursor: Annotated[str | None, Query()] = None,
    retried: Annotated[str | None, Query()] = None,
    proof: Annotated[str | None, Query()] = None,
) -> HTMLResponse:
    """The messages not sent yet; after a Retry, a notice naming the message — only for the session that retried it
    (``proof``, see :func:`sessions.notice_proof`): a crafted link shows no text of its own."""
    if not who.can(Permission.READ_OUTBOX):
        return _refused(who, f"Token {who.token.name!r} may not read the outbox.")
    if status and status not in OUTBOX_STATUSES:
        message = f"There is no status {status[:60]!r} here: the Outbox page lists {', '.join(OUTBOX_STATUSES)}."
        return _page("message.html", who, status=400, title="Unknown status", message=message, back="/outbox")
    try:
        before = paging.seq_cursor(cursor, low=1) if cursor else None
    except BadCursor as exc:
        return _bad_cursor(who, exc, _link("/outbox", status=status))
    notice = None
    if sessions.notice_ok(sessions.session_key(keel.settings), who.session, retried, proof):
        notice = f"Retrying {retried}: it is back in line to be sent."
    return _page("outbox.html", who, notice=notice, **_outbox(keel, who, status or None, before))


@router.post("/outbox/retry")
async def outbox_retry(request: Request, keel: Keel, who: Who) -> Response:
    form = await _form(request)
    refused = _checked(who, form, Permission.RETRY_OUTBOX)
    if refused is not None:
        return refused
    key = form.get("key", "")
    try:
        check_text("key", key, limit=MAX_KEY_CHARS)
    except InvalidInput as exc:
        return _page("message.html", who, status=400, title="Bad form", message=f"{exc}: nothing was changed.")
    try:
        row = await run_in_threadpool(_retry, keel, who, key)
    except KeelError as exc:
        return _page("outbox.html", who, status=kind_of(exc).status, error=str(exc), **_outbox(keel, who))
    if row is None:
        return _page("message.html", who, status=404, title="No such message", message=f"No message has key {key!r}.")
    proof = sessions.notice_proof(sessions.session_key(keel.settings), who.session, key)
    return RedirectResponse(_link("/outbox", retried=key, proof=proof), status_code=303)


def _retry(keel: Ingress, who: Viewer, key: str) -> dict[str, Any] | None:
    row = message_row(keel.db, key)
    if row is None or not _sees(keel, who, row.get("agent_id")):
        return None
    keel.client.retry_outbox(key, actor=who.token.name)
    return row


def _sees(keel: Ingress, who: Viewer, agent_id: object) -> bool:
    if who.token.agent_prefix is None:
        return True
    if not isinstance(agent_id, UUID):
        return False
    name = keel.client.agent_names([agent_id]).get(agent_id, "")
    return who.token.sees(name.removesuffix(" (deleted)"))


# --- KPIs --------------------------------------------------------------------------------------------------------


@router.get("/kpis")
def kpis_page(keel: Keel, who: Who) -> HTMLResponse:
    if not who.can(Permission.READ_STORY) or who.token.agent_prefix is not None:
        return _refused(who, f"Token {who.token.name!r} may not read the KPIs of every agent.")
    now = datetime.now(UTC)
    series = kpi_sql.per_minute(keel.db, [name for name, _ in CHARTS], CHART_SPAN)
    charts = [views.chart(title, series[name], now, CHART_SPAN) for name, title in CHARTS]
    return _page(
        "kpis.html",
        who,
        totals=kpi_sql.totals(keel.db),
        hour=kpi_sql.window(keel.db, timedelta(hours=1)),
        gauges=kpi_sql.gauges(keel.db),
        charts=charts,
        alerts=alerts_sql.open_episodes(keel.db),
    )

"""The operator console's pages, served by the API's app under ``/``: rendered on the server, readable without
JavaScript; a small script follows the journal's live events to redraw what changed.

Every decision goes through the same :class:`~agents.client.Client` calls as the API's routes, with the signed-in
token's name as the actor, and every form carries the revision it was drawn at: a stale one is refused and the page
says who moved the agent, and to which revision."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote
from uuid import UUID

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from agents.core.errors import AgentNotFound, KeelError, StaleRevision
from agents.core.journal import agent_events_after, verify_chain
from agents.core.phases import Phase
from agents.ingress.auth import resolve
from agents.ingress.console import sessions, views
from agents.ingress.console.sessions import Session
from agents.ingress.events import ANY_AGENT, sse_events
from agents.ingress.problems import kind_of
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.tokens import ApiToken, Permission, authenticate, live_token
from models import alerts_sql, kpi_sql
from models.jobs_sql import job_row
from models.outbox_sql import message_row, page_messages, request_messages
from models.schemas import AgentState

router = APIRouter(include_in_schema=False)
Keel = Annotated[Ingress, Depends(ingress)]

STATIC = Path(__file__).parent / "static"
#: How many of an agent's latest journal events its page shows.
JOURNAL_SHOWN = 200
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


class SignInRequired(KeelError):
    """Sign in to the console first: there is no valid session (pages send the person to the sign-in form, scripts
    get a 401)."""


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
    token = await run_in_threadpool(live_token, keel.db, session.token_id)
    if token is None or not sessions.may_sign_in(token):
        raise SignInRequired
    return Viewer(token, session)


Who = Annotated[Viewer, Depends(viewer)]


async def on_sign_in_required(request: Request, exc: Exception) -> Response:
    if request.method == "GET" and request.headers.get("accept", "").startswith("text/html"):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/signin?next={quote(target, safe='')}", status_code=303)
    if request.method == "GET" and "text/event-stream" not in request.headers.get("accept", ""):
        return RedirectResponse("/signin", status_code=303)
    return HTMLResponse(_render("message.html", None, title="Signed out", message="Sign in again."), status_code=401)


def install(app: FastAPI) -> None:
    """Serve the console from ``app``: its pages, its static files, its sign-in redirect."""
    app.add_exception_handler(SignInRequired, on_sign_in_required)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(router)


def _render(name: str, who: Viewer | None, **context: Any) -> str:
    return templates.get_template(name).render(who=who, now=datetime.now(UTC), views=views, **context)


#: Every page: nothing loaded from elsewhere, no inline script, never framed by another site, never cached.
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none';"
        " base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def _page(name: str, who: Viewer | None, *, status: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(_render(name, who, **context), status_code=status, headers=PAGE_HEADERS)


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


def _signin_page(keel: Ingress, next_url: str, *, error: str | None = None, status: int = 200) -> HTMLResponse:
    nonce, cookie = sessions.new_signin_nonce(sessions.session_key(keel.settings))
    response = _page("signin.html", None, status=status, csrf=nonce, next_url=next_url, error=error)
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
    token = await run_in_threadpool(authenticate, keel.db, form.get("token", "").strip())
    if token is None:
        return _signin_page(keel, next_url, error="That token is unknown or revoked.", status=401)
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
    response = RedirectResponse("/signin", status_code=303)
    sessions.clear_cookie(response, keel.settings, sessions.SESSION_COOKIE)
    return response


# --- agents ------------------------------------------------------------------------------------------------------


def _agents(keel: Ingress, who: Viewer, phase: str | None) -> list[AgentState]:
    page = keel.client.list_agents(phases=[phase] if phase else [], limit=500, name_prefix=who.token.agent_prefix)
    return views.by_urgency(page.agents)


PHASES = [p.value for p in Phase]


def _unknown_phase(who: Viewer, phase: str | None) -> HTMLResponse | None:
    if not phase or phase in PHASES:
        return None
    message = f"There is no phase {phase[:60]!r}: the phases are {', '.join(PHASES)}."
    return _page("message.html", who, status=400, title="Unknown phase", message=message)


@router.get("/agents")
def agents_page(keel: Keel, who: Who, phase: Annotated[str | None, Query()] = None) -> HTMLResponse:
    refused = _unknown_phase(who, phase)
    if refused is not None:
        return refused
    return _page("agents.html", who, agents=_agents(keel, who, phase or None), phase=phase or None, phases=PHASES)


@router.get("/agents/rows")
def agents_rows(keel: Keel, who: Who, phase: Annotated[str | None, Query()] = None) -> HTMLResponse:
    """The list's rows alone: what the live script swaps in."""
    return _unknown_phase(who, phase) or _page("agents_rows.html", who, agents=_agents(keel, who, phase or None))


async def _live(keel: Ingress, who: Viewer) -> Callable[[], Awaitable[bool]]:
    async def allowed() -> bool:
        return await run_in_threadpool(live_token, keel.db, who.token.id) is not None

    return allowed


@router.get("/agents/live", response_class=EventSourceResponse)
async def agents_live(keel: Keel, who: Who) -> AsyncIterator[ServerSentEvent]:
    """A ``changed`` event whenever any agent's journal moves (at most every half second): the script then fetches
    the rows again. Ends when the session's token is revoked."""
    allowed = await _live(keel, who)
    with keel.listener.subscribe(ANY_AGENT) as sub:
        while not keel.listener.stopped:
            woken = await sub.wait(15.0)
            sub.clear()  # at once: what commits while the event goes out or the redraw pause lasts wakes it again
            if woken:
                if not await allowed():
                    return
                yield ServerSentEvent(event="changed", data={})
                await asyncio.sleep(LIST_REDRAW_SECONDS)
            elif not await allowed():
                return


def _found(keel: Ingress, who: Viewer, ref: str) -> tuple[UUID, AgentState] | None:
    try:
        found = resolve(keel, who.token, ref)
    except AgentNotFound:
        return None
    return found.id, keel.client.get_state(found.id)


def _agent_context(keel: Ingress, who: Viewer, state: AgentState) -> dict[str, Any]:
    """Everything the agent page shows besides the state: the journal, its verify status, the request's records."""
    head = keel.client.agent_row(state.id).journal_seq
    events = agent_events_after(keel.db, state.id, max(0, head - JOURNAL_SHOWN), limit=JOURNAL_SHOWN)
    request_id = state.request_id or next((e.request_id for e in reversed(events) if e.request_id), None)
    jobs: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    if request_id and who.can(Permission.READ_STORY):
        jobs = [row for job in keel.client.request_jobs(request_id) if (row := job_row(keel.db, job.key))]
        messages = request_messages(keel.db, request_id)
    waiting_since = None
    if state.phase == "waiting_approval":
        waiting_since = next((e.at for e in reversed(events) if e.to_phase == "waiting_approval"), state.updated_at)
    return {
        "events": list(reversed(events)),
        "journal_head": head,
        "chain": verify_chain(keel.db, state.id),
        "request_id": request_id,
        "jobs": jobs,
        "messages": messages,
        "waiting_since": waiting_since,
    }


@router.get("/agents/{ref}")
def agent_page(ref: str, keel: Keel, who: Who) -> HTMLResponse:
    found = _found(keel, who, ref)
    if found is None:
        return _page("message.html", who, status=404, title="No such agent", message=f"No agent is called {ref!r}.")
    _, state = found
    return _page("agent.html", who, state=state, drawn=state.revision, **_agent_context(keel, who, state))


@router.get("/agents/{ref}/panel")
def agent_panel(ref: str, keel: Keel, who: Who, drawn: Annotated[int, Query(ge=0)] = 0) -> HTMLResponse:
    """The agent page's live part (state, journal, jobs, outbox), redrawn by the script; the decision forms stay
    as they were drawn, at their revision."""
    found = _found(keel, who, ref)
    if found is None:
        return _page("message.html", who, status=404, title="No such agent", message=f"No agent is called {ref!r}.")
    _, state = found
    return _page("agent_panel.html", who, state=state, drawn=drawn, **_agent_context(keel, who, state))


@router.get("/agents/{ref}/live", response_class=EventSourceResponse)
async def agent_live(
    ref: str, keel: Keel, who: Who, after: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None
) -> AsyncIterator[ServerSentEvent]:
    """The agent's journal events as they commit (the API's live events, for the session's token), after the
    journal seq the page was drawn at: what committed while the page loaded arrives too."""
    found = await run_in_threadpool(_found, keel, who, ref)
    if found is None:
        return
    agent_id, _ = found
    head = (await run_in_threadpool(keel.client.agent_row, agent_id)).journal_seq
    start = head if after is None else min(after, head)
    async for message in sse_events(keel.listener, agent_id, start, allowed=await _live(keel, who)):
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
    try:
        if act == "approve":
            keel.client.approve(agent_id, expected_revision=drawn, actor=who.token.name)
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


@router.post("/agents/{ref}/approve")
async def approve(ref: str, request: Request, keel: Keel, who: Who) -> Response:
    return await _decide(request, ref, keel, who, "approve")


@router.post("/agents/{ref}/reject")
async def reject(ref: str, request: Request, keel: Keel, who: Who) -> Response:
    return await _decide(request, ref, keel, who, "reject")


# --- outbox ------------------------------------------------------------------------------------------------------

OUTBOX_STATUSES = ("pending", "sending", "dead")


def _outbox(keel: Ingress, who: Viewer) -> dict[tuple[str, str], dict[str, list[dict[str, Any]]]]:
    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for status in OUTBOX_STATUSES:
        rows = page_messages(
            keel.db, status=status, channel=None, before_seq=None, limit=200, name_prefix=who.token.agent_prefix
        )
        for row in rows:
            group = groups.setdefault((row["channel"], row["destination"]), {s: [] for s in OUTBOX_STATUSES})
            group[status].append(row)
    return dict(sorted(groups.items()))


@router.get("/outbox")
def outbox_page(keel: Keel, who: Who, notice: str | None = None) -> HTMLResponse:
    if not who.can(Permission.READ_OUTBOX):
        return _refused(who, f"Token {who.token.name!r} may not read the outbox.")
    return _page("outbox.html", who, groups=_outbox(keel, who), statuses=OUTBOX_STATUSES, notice=notice)


@router.post("/outbox/retry")
async def outbox_retry(request: Request, keel: Keel, who: Who) -> Response:
    form = await _form(request)
    refused = _checked(who, form, Permission.RETRY_OUTBOX)
    if refused is not None:
        return refused
    key = form.get("key", "")
    try:
        row = await run_in_threadpool(_retry, keel, who, key)
    except KeelError as exc:
        return _page(
            "outbox.html",
            who,
            status=kind_of(exc).status,
            groups=_outbox(keel, who),
            statuses=OUTBOX_STATUSES,
            error=str(exc),
        )
    if row is None:
        return _page("message.html", who, status=404, title="No such message", message=f"No message has key {key!r}.")
    return RedirectResponse(f"/outbox?notice={quote('retrying ' + key, safe='')}", status_code=303)


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

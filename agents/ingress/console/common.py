"""What every console page shares: the templates, the signed-in viewer (a dependency that also counts a POST against
the token's rate), the form and scope checks of a POST, and the links and refusals the lists make."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import parse_qs, quote, urlencode

from fastapi import Depends, Request
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, RedirectResponse, Response

from agents.core.errors import KeelError
from agents.ingress.console import sessions, views
from agents.ingress.console.paging import BadCursor
from agents.ingress.console.sessions import Session
from agents.ingress.ratelimit import headers as rate_headers
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.streams import Hold
from agents.ingress.tokens import ApiToken, Permission, live_token
from models import console_sql

Keel = Annotated[Ingress, Depends(ingress)]

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
    return HTMLResponse(render("message.html", None, title="Signed out", message="Sign in again."), status_code=401)


async def on_over_rate(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OverRate)
    return page(
        "message.html", exc.viewer, status=429, headers=exc.headers, title="Too many requests", message=str(exc)
    )


async def hold(keel: Keel, who: Who) -> AsyncIterator[Hold]:
    """A live stream's place among the process's open streams (a 429 past the caps), held until it ends."""
    with keel.streams.admit(who.token) as held:
        yield held


Held = Annotated[Hold, Depends(hold)]


def render(name: str, who: Viewer | None, **context: Any) -> str:
    return templates.get_template(name).render(who=who, now=datetime.now(UTC), views=views, **context)


def page(
    name: str, who: Viewer | None, *, status: int = 200, headers: dict[str, str] | None = None, **context: Any
) -> HTMLResponse:
    """A page (its security headers are added on the way out, as to every console answer: :class:`ConsoleHeaders`)."""
    return HTMLResponse(render(name, who, **context), status_code=status, headers=headers)


def refused(who: Viewer, message: str, status: int = 403) -> HTMLResponse:
    return page("message.html", who, status=status, title="Not allowed", message=message)


async def read_form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (the console's forms send nothing else): its first values."""
    body = await request.body()
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        return {}
    return {name: values[0] for name, values in fields.items()}


def checked(who: Viewer, form: dict[str, str], permission: Permission) -> HTMLResponse | None:
    """The refusal of a POST: a CSRF token that is not the session's, or a token without ``permission``."""
    if not sessions.csrf_ok(who.session, form.get("csrf")):
        return refused(who, "The form was not sent from this session's console (CSRF check): nothing was changed.")
    if not who.can(permission):
        scopes = ", ".join(sorted(who.token.scopes))
        action = permission.value.replace("_", " ")
        return refused(who, f"Token {who.token.name!r} (scopes: {scopes}) may not {action}: nothing was changed.")
    return None


def link(path: str, **query: str | int | None) -> str:
    """``path`` with the query parameters that have a value (a list's filter and cursor)."""
    given = {name: value for name, value in query.items() if value is not None and value != ""}
    return f"{path}?{urlencode(given)}" if given else path


def bad_cursor(who: Viewer, exc: BadCursor, first_page: str) -> HTMLResponse:
    return page(
        "message.html",
        who,
        status=400,
        title="Unknown page cursor",
        message=f"The page cursor {exc.cursor[:80]!r} is not one this list made (mistyped, cut short, or from"
        " another list or filter): start again from the first page.",
        back=first_page,
    )

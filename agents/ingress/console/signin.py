"""Signing in to the console with an API token, and out again: the session cookie is set on the way in and refused
from then on when the person signs out (a copy of it included)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, RedirectResponse, Response

from agents.ingress.console import sessions
from agents.ingress.console.common import Keel, Who, page, read_form, refused
from agents.ingress.runtime import Ingress
from models import console_sql

router = APIRouter(include_in_schema=False)


def _signin_page(
    keel: Ingress,
    next_url: str,
    *,
    error: str | None = None,
    status: int = 200,
    headers: dict[str, str] | None = None,
) -> HTMLResponse:
    nonce, cookie = sessions.new_signin_nonce(sessions.session_key(keel.settings))
    response = page("signin.html", None, status=status, headers=headers, csrf=nonce, next_url=next_url, error=error)
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
    form = await read_form(request)
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
    form = await read_form(request)
    if not sessions.csrf_ok(who.session, form.get("csrf")):
        return refused(who, "The form was not sent from this session's console (CSRF check).")
    # Ended here, not only in this browser: a copy of the cookie is refused from now on too.
    await run_in_threadpool(
        console_sql.sign_out, keel.db, sessions.session_id(who.session), sessions.expires_at(who.session)
    )
    response = RedirectResponse("/signin", status_code=303)
    sessions.clear_cookie(response, keel.settings, sessions.SESSION_COOKIE)
    return response

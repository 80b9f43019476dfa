"""Console sessions: a signed cookie naming the API token a person signed in with (never its secret), and its CSRF
token; before sign-in, a short-lived signed pre-session cookie guards the sign-in form. How sessions end (revoked token,
sign-out, restart) and what the cookie's flags are: docs/explanation/ingress-and-audit.md#sessions-and-csrf."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal
from uuid import UUID

from starlette.responses import Response

from agents.ingress.tokens import ApiToken, Scope
from models.settings import Settings

#: The session cookie and the sign-in form's pre-session cookie.
SESSION_COOKIE = "keel_session"
SIGNIN_COOKIE = "keel_signin"
#: Every cookie the console reads (a test sends each one hostile bytes).
COOKIES = (SESSION_COOKIE, SIGNIN_COOKIE)
#: How long a session lasts (seconds) from sign-in; then the person signs in again.
SESSION_SECONDS = 12 * 3600
SIGNIN_SECONDS = 600
#: The scopes that may sign in to the console: an auditor reads only; a producer token is for programs.
CONSOLE_SCOPES = frozenset({Scope.APPROVER, Scope.OPERATOR, Scope.AUDITOR})


@dataclass(frozen=True, slots=True)
class Session:
    """A signed-in console session: the API token's id, when it began, its CSRF token."""

    token_id: UUID
    issued_at: int
    csrf: str


def session_key(settings: Settings) -> bytes:
    """The key sessions are signed with: the configured one, or a random one for this process."""
    if settings.console_session_key is not None:
        return settings.console_session_key.get_secret_value().encode()
    return _PROCESS_KEY


_PROCESS_KEY = secrets.token_bytes(32)


def _sign(key: bytes, purpose: str, payload: bytes) -> str:
    body = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    mac = hmac.new(key, f"{purpose}.{body}".encode(), hashlib.sha256).hexdigest()
    return f"{body}.{mac}"


def _unsign(key: bytes, purpose: str, value: str) -> bytes | None:
    body, _, mac = value.rpartition(".")
    expected = hmac.new(key, f"{purpose}.{body}".encode(), hashlib.sha256).hexdigest()
    if not body or not _same(expected, mac):
        return None
    try:
        return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except ValueError:
        return None


def may_sign_in(token: ApiToken) -> bool:
    """Whether this token may use the console (approver, operator or auditor; not a producer-only token)."""
    return token.revoked_at is None and bool(CONSOLE_SCOPES.intersection(token.scopes))


def new_session(token: ApiToken) -> Session:
    return Session(token_id=token.id, issued_at=int(time.time()), csrf=secrets.token_urlsafe(24))


def session_id(session: Session) -> str:
    """What a signed-out session is recorded by: the sha256 of its random CSRF token (never the token itself)."""
    return hashlib.sha256(session.csrf.encode()).hexdigest()


def expires_at(session: Session) -> datetime:
    """When the session ends by itself."""
    return datetime.fromtimestamp(session.issued_at + SESSION_SECONDS, UTC)


def encode_session(key: bytes, session: Session) -> str:
    payload = json.dumps({"t": str(session.token_id), "i": session.issued_at, "c": session.csrf}).encode()
    return _sign(key, "session", payload)


def decode_session(key: bytes, value: str | None) -> Session | None:
    """The session the cookie holds, if its signature is good and it has not expired."""
    if not value:
        return None
    payload = _unsign(key, "session", value)
    if payload is None:
        return None
    try:
        fields = json.loads(payload)
        session = Session(token_id=UUID(fields["t"]), issued_at=int(fields["i"]), csrf=str(fields["c"]))
    except (ValueError, KeyError, TypeError):
        return None
    if not 0 <= time.time() - session.issued_at < SESSION_SECONDS:
        return None
    return session


def new_signin_nonce(key: bytes) -> tuple[str, str]:
    """A sign-in form's CSRF token and the pre-session cookie that vouches for it."""
    nonce = secrets.token_urlsafe(24)
    payload = json.dumps({"n": nonce, "i": int(time.time())}).encode()
    return nonce, _sign(key, "signin", payload)


def signin_nonce_ok(key: bytes, cookie: str | None, submitted: str | None) -> bool:
    if not cookie or not submitted:
        return False
    payload = _unsign(key, "signin", cookie)
    if payload is None:
        return False
    try:
        fields = json.loads(payload)
        nonce, issued = str(fields["n"]), int(fields["i"])
    except (ValueError, KeyError, TypeError):
        return False
    return 0 <= time.time() - issued < SIGNIN_SECONDS and _same(nonce, submitted)


def notice_proof(key: bytes, session: Session, notice: str) -> str:
    """What a redirect after a POST carries with the ``notice`` it asks the next page to show: a MAC over the notice
    and this session, so a link someone else made (or this one, in another session) shows nothing."""
    return hmac.new(key, f"notice.{session_id(session)}.{notice}".encode(), hashlib.sha256).hexdigest()


def notice_ok(key: bytes, session: Session, notice: str | None, proof: str | None) -> bool:
    return bool(notice) and proof is not None and _same(notice_proof(key, session, notice or ""), proof)


def csrf_ok(session: Session, submitted: str | None) -> bool:
    return submitted is not None and _same(session.csrf, submitted)


def _same(expected: str, submitted: str) -> bool:
    """A constant-time comparison of what was sent with what was expected. As bytes: ``hmac.compare_digest`` raises
    on text that is not ASCII, and a forged form must be a refusal, not an error."""
    return hmac.compare_digest(expected.encode(), submitted.encode("utf-8", "surrogatepass"))


def set_cookie(response: Response, settings: Settings, name: str, value: str, *, max_age: int) -> None:
    same_site: Literal["strict"] = "strict"
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        httponly=True,
        samesite=same_site,
        secure=settings.environment != "development",
        path="/",
    )


def clear_cookie(response: Response, settings: Settings, name: str) -> None:
    response.delete_cookie(
        name, httponly=True, samesite="strict", secure=settings.environment != "development", path="/"
    )

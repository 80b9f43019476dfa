"""Who is calling and what they may do: the bearer token, its scopes, its agent prefix, its rate. :class:`TokenGate`
decides on every ``/v1/`` path before anything reads the body (failed-token allowance 429, token 401, rate 429, scope
403), and each route declares the permission it needs with :func:`require`. The order and why:
docs/explanation/ingress-and-audit.md#who-is-calling-the-token-gate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated
from uuid import UUID

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, APIRouter
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agents.core.errors import AgentNotFound, KeelError, StaleRevision
from agents.core.observe import annotate
from agents.ingress import problems
from agents.ingress.etags import etag
from agents.ingress.problems import FORBIDDEN, RATE_LIMITED, UNAUTHORIZED, Problem, kind_of
from agents.ingress.ratelimit import headers as rate_headers
from agents.ingress.runtime import Ingress
from agents.ingress.tokens import ApiToken, Permission
from models.schemas import AgentRow

# Declared on current_token for the OpenAPI document (its security scheme); TokenGate does the checking.
_bearer = HTTPBearer(auto_error=False, description="An API token: `keel token create NAME --scope …`")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="keel"'}
#: What a request without a token is told. Worded so that no "Bearer <word>" in it looks like a credential to the
#: redaction every error text passes through (it read "as a Bearer *** in the Authorization header").
NO_TOKEN = "send an API token in the Authorization header (scheme: Bearer), as the API's docs show"
#: Where :class:`TokenGate` leaves the authenticated token in the request's ``scope["state"]``.
TOKEN_STATE = "token"
#: The paths that need a token.
GATED_PREFIX = "/v1/"


def refusal(token: ApiToken, permission: Permission) -> Problem | None:
    """The 403 for ``token`` asking for ``permission``, naming the scopes it has; None when it may."""
    if token.can(permission):
        return None
    scopes = ", ".join(sorted(token.scopes))
    action = permission.value.replace("_", " ")
    return Problem(
        FORBIDDEN, f"token {token.name!r} (scopes: {scopes}) may not {action}", extra={"permission": permission.value}
    )


async def current_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> ApiToken:
    """The token the request carries, as :class:`TokenGate` authenticated it (no second lookup)."""
    token = getattr(request.state, TOKEN_STATE, None)
    if not isinstance(token, ApiToken):  # a route outside the gate's paths: never let it through unauthenticated
        raise Problem(UNAUTHORIZED, NO_TOKEN, headers=_CHALLENGE)
    return token


@dataclass(frozen=True)
class Require:
    """The dependency :func:`require` makes: the calling token, if it grants ``permission``. :class:`TokenGate`
    finds it among a route's dependencies to refuse (403) before the body is read."""

    permission: Permission

    async def __call__(self, token: Annotated[ApiToken, Depends(current_token)]) -> ApiToken:
        problem = refusal(token, self.permission)
        if problem is not None:
            raise problem
        return token


def require(permission: Permission) -> Require:
    """A dependency: the calling token, if it grants ``permission`` (else 403 naming the scopes that would)."""
    return Require(permission)


def required_permission(dependant: Dependant) -> Permission | None:
    """The permission a route (or a dependency of it) declares with :func:`require`, if any."""
    for dependency in dependant.dependencies:
        if isinstance(dependency.call, Require):
            return dependency.call.permission
        found = required_permission(dependency)
        if found is not None:
            return found
    return None


class TokenGate:
    """Authenticate (401), rate-limit (429) and check the scope (403) of every ``/v1/`` request before anything
    reads its body; then leave the token in ``scope["state"]`` for :func:`current_token`, and add the token's
    ``RateLimit`` headers to whatever the request is answered with. ``routers``: the API's routers, included
    without a prefix; the permission of the route a request matches is the one its :func:`require` declares."""

    def __init__(self, app: ASGIApp, routers: Sequence[APIRouter]) -> None:
        self.app = app
        self.routes = [
            (route, required_permission(route.dependant))
            for router in routers
            for route in router.routes
            if isinstance(route, APIRoute)
        ]

    def permission_for(self, scope: Scope) -> Permission | None:
        """What the route ``scope`` matches requires (None: no such route, or it requires only a token)."""
        for route, permission in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return permission
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATED_PREFIX):
            await self.app(scope, receive, send)
            return
        limits: dict[str, str] = {}

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start" and limits:
                headers = MutableHeaders(scope=message)
                for name, value in limits.items():
                    headers[name] = value
            await send(message)

        request = Request(scope)
        response: Response
        try:
            token = await self._admit(scope, limits)
        except Problem as exc:
            response = await problems.on_problem(request, exc)
        except KeelError as exc:  # the database could not be asked: 503
            response = await problems.on_keel_error(request, exc)
        except Exception as exc:  # outside the app's exception handlers: answered as they would
            response = await problems.on_unexpected(request, exc)
        else:
            scope.setdefault("state", {})[TOKEN_STATE] = token
            await self.app(scope, receive, send_with_limits)
            return
        await response(scope, receive, send_with_limits)

    async def _admit(self, scope: Scope, limits: dict[str, str]) -> ApiToken:
        """The request's token, if it may make this request now; fills ``limits`` with its rate headers."""
        keel: Ingress = scope["app"].state.ingress
        scheme, secret = get_authorization_scheme_param(Headers(scope=scope).get("authorization"))
        if scheme.lower() != "bearer" or not secret:
            raise Problem(UNAUTHORIZED, NO_TOKEN, headers=_CHALLENGE)
        client = scope.get("client")
        attempt = await run_in_threadpool(keel.try_token, client[0] if client else None, secret)
        if attempt.refused:
            raise Problem(
                RATE_LIMITED,
                f"too many failed tokens from your address: retry after {attempt.retry_after} s (the token was not"
                " checked)",
                headers=attempt.headers,
            )
        token = attempt.token
        if token is None:
            raise Problem(UNAUTHORIZED, "the API token is unknown or revoked", headers=_CHALLENGE)
        if keel.limiter is not None:
            policy = keel.policy_for(token)
            decision = await run_in_threadpool(keel.limiter.check, str(token.id), policy)
            limits.update(rate_headers(decision, policy))
            if not decision.allowed:
                raise Problem(
                    RATE_LIMITED,
                    f"token {token.name!r} is over its rate ({policy.rate_per_second:g}/s, burst {policy.burst}):"
                    f" retry after {limits['Retry-After']} s",
                    headers=limits,
                )
        annotate(actor=token.name)
        permission = self.permission_for(scope)
        problem = None if permission is None else refusal(token, permission)
        if problem is not None:
            raise problem
        return token


@dataclass(frozen=True, slots=True)
class Found:
    """An agent a token may see: its id and name, its row (None for a deleted agent), and the head of its journal
    (a deleted agent's: its delete event)."""

    id: UUID
    name: str
    row: AgentRow | None
    journal_seq: int

    @property
    def revision(self) -> int:
        assert self.row is not None
        return self.row.revision


def resolve(keel: Ingress, token: ApiToken, ref: str, *, deleted_ok: bool = False) -> Found:
    """The agent ``ref`` (id or name) names, if the token may see it. An agent outside the token's prefix gets the
    very 404 an agent that does not exist gets, so a token learns nothing of other tenants' agents. With
    ``deleted_ok`` a deleted agent is found too (its journal is kept)."""
    try:
        row = keel.client.agent_row(ref)
    except AgentNotFound as exc:
        gone = exc.deleted
        if gone is None or not token.sees(gone.name):
            raise AgentNotFound(ref) from None
        if not deleted_ok:
            raise
        return Found(gone.id, gone.name, None, gone.journal_seq)
    if not token.sees(row.name):
        raise AgentNotFound(ref)
    annotate(agent_id=row.id)
    return Found(row.id, row.name, row, row.journal_seq)


def sees_agent(keel: Ingress, token: ApiToken, agent_id: UUID) -> bool:
    """Whether the agent with this id (a deleted one too) is within the token's reach: for what belongs to an agent
    (a request, a job, an outbox message), found by its own key."""
    return bool(seen_agents(keel, token, [agent_id]))


def seen_agents(keel: Ingress, token: ApiToken, agent_ids: list[UUID]) -> list[UUID]:
    """Those of ``agent_ids`` (deleted ones too) within the token's reach, in their order: one read of their names."""
    if token.agent_prefix is None:
        return list(agent_ids)
    names = keel.client.agent_names(agent_ids)
    return [a for a in agent_ids if sees_named(token, names.get(a, ""))]


def sees_named(token: ApiToken, name: str) -> bool:
    """:meth:`ApiToken.sees` for a name as ``Client.agent_names`` gives it (a deleted agent's marked so): what the
    console's live list of agents is woken for (``JournalListener.subscribe(..., sees=...)``)."""
    return token.sees(name.removesuffix(" (deleted)"))


def stale(keel: Ingress, token: ApiToken, exc: StaleRevision, ref: str) -> Problem:
    """A 412 carrying the agent as it is now and its ETag, so the person sees what changed before deciding again."""
    state = keel.client.get_state(resolve(keel, token, ref).id)
    tag = etag(state.revision)
    return Problem(
        kind_of(exc),
        str(exc),
        headers={"ETag": tag},
        extra={
            "agent_id": str(state.id),
            "expected_revision": exc.expected_revision,
            "current_revision": exc.current_revision,
            "current_state": state.model_dump(mode="json"),
            "etag": tag,
        },
    )

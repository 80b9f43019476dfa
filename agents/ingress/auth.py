"""Who is calling and what they may do: the bearer token, its scopes, its agent prefix, its rate.

Every route depends on :func:`require` with the permission it needs. Refusals change nothing: a bad, revoked or
missing token is a 401, a missing scope a 403, an agent outside the token's prefix a 404 exactly like an agent that
does not exist, a token over its rate a 429 — all decided before the route touches anything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any
from uuid import UUID

from fastapi import Depends, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from agents.core.errors import AgentNotFound, StaleRevision
from agents.ingress.etags import etag
from agents.ingress.problems import FORBIDDEN, RATE_LIMITED, UNAUTHORIZED, Problem, kind_of
from agents.ingress.ratelimit import headers as rate_headers
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.tokens import ApiToken, Permission, authenticate
from models.schemas import AgentRow

_bearer = HTTPBearer(auto_error=False, description="An API token: `keel token create NAME --scope …`")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="keel"'}


async def current_token(
    request: Request,
    response: Response,
    keel: Annotated[Ingress, Depends(ingress)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> ApiToken:
    """The token the request carries, checked against the database and its rate."""
    if credentials is None:
        raise Problem(
            UNAUTHORIZED, "send an API token as a Bearer token in the Authorization header", headers=_CHALLENGE
        )
    token = await run_in_threadpool(authenticate, keel.db, credentials.credentials)
    if token is None:
        raise Problem(UNAUTHORIZED, "the API token is unknown or revoked", headers=_CHALLENGE)
    request.state.token = token
    if keel.limiter is not None:
        policy = keel.policy_for(token)
        decision = await run_in_threadpool(keel.limiter.check, str(token.id), policy)
        limits = rate_headers(decision, policy)
        if not decision.allowed:
            raise Problem(
                RATE_LIMITED,
                f"token {token.name!r} is over its rate ({policy.rate_per_second:g}/s, burst {policy.burst}):"
                f" retry after {limits['Retry-After']} s",
                headers=limits,
            )
        response.headers.update(limits)
    return token


def require(permission: Permission) -> Callable[..., Any]:
    """A dependency: the calling token, if it grants ``permission`` (else 403 naming the scopes that would)."""

    async def dependency(token: Annotated[ApiToken, Depends(current_token)]) -> ApiToken:
        if not token.can(permission):
            scopes = ", ".join(sorted(token.scopes))
            action = permission.value.replace("_", " ")
            raise Problem(
                FORBIDDEN,
                f"token {token.name!r} (scopes: {scopes}) may not {action}",
                extra={"permission": permission.value},
            )
        return token

    return dependency


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
    return Found(row.id, row.name, row, row.journal_seq)


def sees_agent(keel: Ingress, token: ApiToken, agent_id: UUID) -> bool:
    """Whether the agent with this id (a deleted one too) is within the token's reach: for what belongs to an agent
    (a request, a job, an outbox message), found by its own key."""
    if token.agent_prefix is None:
        return True
    name = keel.client.agent_names([agent_id]).get(agent_id, "")
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

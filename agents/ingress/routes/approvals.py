"""``/v1/approvals``: the inbox, every call waiting for approval across the agents the token sees, oldest first."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from agents.client import Client
from agents.core.commands import check_text
from agents.ingress.auth import require
from agents.ingress.bodies import JsonBodyRoute
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.tokens import ApiToken, Permission, covers
from models.schemas import ApprovalPage

router = APIRouter(prefix="/v1/approvals", tags=["approvals"], route_class=JsonBodyRoute)

Keel = Annotated[Ingress, Depends(ingress)]
MAX_PAGE = 1000


@router.get("", response_model=ApprovalPage, summary="Calls waiting for approval, oldest first")
def approvals(
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.READ_APPROVALS))],
    tool: Annotated[str | None, Query(min_length=1, max_length=200, description="Only calls to this tool")] = None,
    min_age_seconds: Annotated[
        float | None, Query(ge=0, le=10 * 365 * 86400, description="Only calls waiting at least this long")
    ] = None,
    agent_prefix: Annotated[
        str | None, Query(min_length=1, max_length=200, description="Only agents whose name starts with this")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[str | None, Query(max_length=512, description="The `next` of the previous page")] = None,
) -> ApprovalPage:
    """Each call names its agent and the revision an approval's ``If-Match`` carries. A token limited to an agent
    prefix sees its agents' calls only."""
    return approvals_for(
        keel.client,
        token,
        tool=tool,
        min_age=None if min_age_seconds is None else timedelta(seconds=min_age_seconds),
        agent_prefix=agent_prefix,
        limit=limit,
        cursor=cursor,
    )


def approvals_for(
    client: Client,
    token: ApiToken,
    *,
    tool: str | None,
    min_age: timedelta | None,
    agent_prefix: str | None,
    limit: int,
    cursor: str | None,
) -> ApprovalPage:
    """The inbox as ``token`` sees it (the API's and the console's): only its agents' calls if it is limited to an
    agent prefix. Bad filters raise :class:`~agents.core.errors.InvalidInput` naming the field."""
    if agent_prefix is not None:
        check_text("agent_prefix", agent_prefix, limit=200)  # checked whether or not the token's prefix overrides it
    prefix = _narrowest(token.agent_prefix, agent_prefix)
    if prefix is None and token.agent_prefix is not None:
        return ApprovalPage(approvals=())  # the two prefixes exclude each other: no agent has both
    return client.approvals(tool=tool, min_age=min_age, agent_prefix=prefix, limit=limit, after=cursor)


def _narrowest(granted: str | None, asked: str | None) -> str | None:
    """The prefix that satisfies both the token's and the query's (None: none does, or neither was given)."""
    if granted is None or asked is None:
        return asked if granted is None else granted
    if covers(granted, asked):  # every name starting with what was asked is the token's
        return asked
    return granted if granted.startswith(asked) else None  # what was asked is wider: the token's prefix

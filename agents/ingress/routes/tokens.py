"""``/v1/tokens/me``: the calling token as the API sees it (name, scopes, agent prefix)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from agents.ingress.auth import current_token
from agents.ingress.bodies import JsonBodyRoute
from agents.ingress.tokens import ApiToken

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], route_class=JsonBodyRoute)


@router.get("/me", response_model=ApiToken, summary="The calling token")
def me(token: Annotated[ApiToken, Depends(current_token)]) -> ApiToken:
    """Its name is the actor the journal records for every command made with it."""
    return token

"""The API's JSON bodies, parsed by the rule every door uses (:func:`~agents.core.json_input.parse_json`: bounded in
size and depth) before FastAPI reads them: a body nested too deep is a 422 naming the rule, never a
``RecursionError``. Every API router is made with ``route_class=JsonBodyRoute``."""

from __future__ import annotations

import email.message
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from agents.core.errors import InvalidInput
from agents.core.json_input import parse_json
from agents.ingress.runtime import Ingress


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI would read a body of this type as JSON (``application/json`` or ``application/…+json``)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class JsonBody(Request):
    """A request whose :meth:`json` is :func:`parse_json`'s reading of its body."""

    parsed: Any = None
    _parsed = False

    async def json(self) -> Any:
        if not self._parsed:
            keel: Ingress = self.app.state.ingress
            self.parsed = parse_json("body", await self.body(), limit=keel.settings.api_max_body_bytes)
            self._parsed = True
        return self.parsed


class JsonBodyRoute(APIRoute):
    """A route whose JSON body is parsed (and refused, 422) before FastAPI's own handling reads it, so a refusal
    reaches the app's handler for :class:`~agents.core.errors.InvalidInput` rather than FastAPI's generic 400."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            bounded = JsonBody(request.scope, request.receive)
            if await bounded.body():
                said = bounded.headers.get("content-type")
                if not is_json(said):  # FastAPI would refuse it with a 422 naming no rule ("body.13")
                    raise InvalidInput(
                        "body: send it as JSON, with the header Content-Type: application/json"
                        + (f" (it came as {said!r})" if said else " (it came without a Content-Type)")
                    )
                await bounded.json()
            return await handler(bounded)

        return handle

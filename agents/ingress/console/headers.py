"""The headers every answer of the console carries, whoever made it (a page, a redirect, the 401 a script gets, a
problem document, a static file, an internal error): nothing loaded from elsewhere and no inline script (CSP), never
framed by another site (CSP ``frame-ancestors`` and ``X-Frame-Options``), never read as another type than the one sent,
no address sent to another site, and, but for the static files, never cached."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agents.ingress import problems

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none';"
        " base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
#: Pages show what a token may see: no browser or proxy keeps a copy.
NOT_CACHED = {"Cache-Control": "no-store"}
#: Where the console's static files are served (cacheable: they are the package's own).
STATIC_PATH = "/static"


class ConsoleHeaders:
    """ASGI middleware: the console's headers on every answer under its paths (``sections``: the first segments of
    its routes, e.g. ``agents`` for ``/agents/…``; ``/`` itself; ``/static/…``), added where the answer did not set
    them. The API's paths (``/v1/…``, ``/docs``, the health checks) are left as they are.

    An error nothing else answered (a 500) would be answered outside every middleware, without them: it is answered
    here instead, as the app's own handler answers it (logged with an incident id, which the answer names)."""

    def __init__(self, app: ASGIApp, sections: Iterable[str]) -> None:
        self.app = app
        self.sections = frozenset(sections) | {STATIC_PATH.strip("/")}

    def covers(self, path: str) -> bool:
        return path == "/" or path.split("/")[1] in self.sections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.covers(scope["path"]):
            await self.app(scope, receive, send)
            return
        wanted = dict(SECURITY_HEADERS)
        if not scope["path"].startswith(STATIC_PATH + "/"):
            wanted.update(NOT_CACHED)
        started = False

        async def send_secured(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                for name, value in wanted.items():
                    headers.setdefault(name, value)
            await send(message)

        try:
            await self.app(scope, receive, send_secured)
        except Exception as exc:
            if started:
                raise
            response = await problems.on_unexpected(Request(scope), exc)  # logs it with its incident id
            await response(scope, receive, send_secured)

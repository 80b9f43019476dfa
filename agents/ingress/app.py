"""The HTTP API: ``create_app(settings)`` builds it; ``keel serve`` runs it under uvicorn. Keel's semantics in HTTP's
own words: revisions are ETags (``"r<revision>"``), stale writes are 412s, a submit's ``Idempotency-Key`` is its request
id, errors are RFC 9457 problem details."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import version
from types import FrameType

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agents.client import Publisher
from agents.core.errors import KeelError
from agents.core.observe import current_traceparent, observe
from agents.core.redaction import register_settings
from agents.ingress import problems
from agents.ingress.auth import TokenGate
from agents.ingress.console import routes as console
from agents.ingress.events import JournalListener
from agents.ingress.routes import agents, approvals, health, records, requests, tokens
from agents.ingress.runtime import Ingress
from agents.ingress.schemas import ERRORS
from models.db import check_route
from models.roles import refuse_privileged
from models.settings import Settings

DESCRIPTION = """\
Keel's front door for producers and people: create agents, submit requests, approve or reject tool calls, read the
journal and each request's story, and follow an agent live.

* **Authentication**: `Authorization: Bearer <token>` (`keel token create NAME --scope …`). Scopes: producer,
  approver, operator, auditor; a token may be limited to agents whose name starts with a prefix.
* **Revisions are ETags** (`"r<revision>"`): `If-None-Match` on reads, `If-Match` on writes; approve and reject
  require it (428 without it) and a stale one is a 412 with the current state.
* **Submits are idempotent**: the `Idempotency-Key` header is the request id; the same key with the same body gives
  the original response again, with a different body a 409.
* **Errors** are `application/problem+json` (RFC 9457) with a stable `type` per kind of problem.
"""


class Observed:
    """Each HTTP request is one observed unit of work (``observe("http", method)``): its route template and status
    are named when it ends; the W3C ``traceparent`` it came with is named from the start. Its request id is not
    taken from a header here, before anything is authenticated or checked: the routes name it (``annotate``) once
    they know it — the submit after the token and the ``Idempotency-Key`` passed, a decision from the request in
    flight. When traces are on, the answer carries a ``traceresponse`` header (W3C Trace Context level 2): the trace
    the request is part of, to look it up by."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        status = 500  # what the client sees if the app fails before answering

        async def answered(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                traced = current_traceparent()
                if traced is not None:
                    message = {**message, "headers": [*message.get("headers", ()), (b"traceresponse", traced.encode())]}
            await send(message)

        traceparent = headers.get(b"traceparent")
        with observe(
            "http", scope["method"], traceparent=None if traceparent is None else traceparent.decode("latin-1")[:128]
        ) as op:
            try:
                await self.app(scope, receive, answered)
            finally:
                route = scope.get("route")
                op.add(route=getattr(route, "path", None) or "unmatched", status=status)
                op.outcome = str(status)


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with a 413 before any route reads them — by ``Content-Length``
    when it is given, by counting as the body streams in when it is not (chunked): then the 413 goes out at once,
    the route sees the client gone, and whatever it would answer is dropped."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        seen = 0
        refused = False

        async def counted() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    await self._refuse(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, guarded)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problems.problem_response(
            problems.TOO_LARGE,
            f"the request body is over {self.limit:,} bytes (KEEL_API_MAX_BODY_BYTES)",
            instance=scope.get("path"),
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


#: The signals a server (uvicorn) shuts down on.
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _end_streams_on_shutdown_signal(listener: JournalListener) -> Callable[[], None]:
    """End the live event streams as soon as a shutdown signal arrives, then hand the signal to the server's own
    handler (uvicorn's, installed before the app starts): the server waits for every response to complete before
    it stops, and a stream never completes by itself. Returns what puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in SHUTDOWN_SIGNALS}

    def on_signal(sig: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(listener.end_streams)
        handler = previous[signal.Signals(sig)]
        if callable(handler):
            handler(sig, frame)
        elif handler == signal.SIG_DFL:  # no server handler: what the signal would have done
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)

    for sig in SHUTDOWN_SIGNALS:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is on_signal:
                signal.signal(sig, handler)

    return restore


def create_app(
    settings: Settings | None = None,
    *,
    publisher: Publisher | None = None,
    on_close: Sequence[Callable[[], None]] = (),
) -> FastAPI:
    """The API app. ``publisher`` sends a submit's first job to the broker at once (``tasks.api`` passes Celery's);
    without it the beat dispatcher picks the job up on its next pass. ``on_close`` runs when the app stops."""
    settings = settings or Settings()
    register_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        keel = Ingress.open(settings, publisher=publisher)
        try:
            # Whoever starts the app (keel serve, or a bare uvicorn/gunicorn): in production, not as a database role
            # that could rewrite the journal (models/roles.py), nor on a route where the statement timeout would
            # not hold or the direct URL is a pooler.
            refuse_privileged(keel.db.engine, settings)
            check_route(keel.db, production=settings.environment == "production")
        except BaseException:
            keel.close()
            raise
        app.state.ingress = keel
        await keel.listener.start()
        await keel.streams.start()
        restore = _end_streams_on_shutdown_signal(keel.listener)
        try:
            yield
        finally:
            restore()
            await keel.listener.stop()
            await keel.streams.stop()
            keel.close()
            for close in on_close:
                close()

    app = FastAPI(
        title="Keel",
        version=version("keel"),
        description=DESCRIPTION,
        lifespan=lifespan,
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
    )
    app.add_exception_handler(problems.Problem, problems.on_problem)
    app.add_exception_handler(KeelError, problems.on_keel_error)
    app.add_exception_handler(RequestValidationError, problems.on_validation)
    app.add_exception_handler(StarletteHTTPException, problems.on_http)
    app.add_exception_handler(Exception, problems.on_unexpected)
    app.add_middleware(BodyLimit, limit=settings.api_max_body_bytes)
    api = (tokens.router, agents.router, approvals.router, requests.router, requests.by_id, records.router)
    # Added last, so it runs first: token (401), rate (429) and scope (403) before BodyLimit or a route reads a body.
    app.add_middleware(TokenGate, routers=api)
    # Outermost: every request is observed, the refused ones too.
    app.add_middleware(Observed)
    app.include_router(health.router)
    for router in api:
        app.include_router(router, responses=ERRORS)
    console.install(app)  # the operator console's pages, under /
    return app

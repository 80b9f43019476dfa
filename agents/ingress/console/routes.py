"""The operator console's pages, served by the API's app under ``/``: rendered on the server, readable without
JavaScript, with a small script that follows the journal's live events to redraw what changed. One module per page
(:mod:`.signin`, :mod:`.agents`, :mod:`.agent`, :mod:`.inbox`, :mod:`.outbox`, :mod:`.kpis`); this one installs
them."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.staticfiles import StaticFiles

from agents.ingress.console import agent, agents, inbox, kpis, outbox, signin
from agents.ingress.console.common import OverRate, SignInRequired, on_over_rate, on_sign_in_required
from agents.ingress.console.headers import STATIC_PATH, ConsoleHeaders

STATIC = Path(__file__).parent / "static"

#: The pages' routers, in the order their paths are tried: the agents list's /agents/rows and /agents/live come
#: before the agent page's /agents/{ref}.
ROUTERS = (signin.router, agents.router, agent.router, inbox.router, outbox.router, kpis.router)


def console_routes() -> list[APIRoute]:
    """Every route of the console's pages."""
    return [route for router in ROUTERS for route in router.routes if isinstance(route, APIRoute)]


def install(app: FastAPI) -> None:
    """Serve the console from ``app``: its pages, its static files, its sign-in redirect, and its headers on every
    answer under its paths."""
    app.add_exception_handler(SignInRequired, on_sign_in_required)
    app.add_exception_handler(OverRate, on_over_rate)
    app.mount(STATIC_PATH, StaticFiles(directory=STATIC), name="static")
    for router in ROUTERS:
        app.include_router(router)
    sections = {route.path.split("/")[1] for route in console_routes()} - {""}
    app.add_middleware(ConsoleHeaders, sections=sections)

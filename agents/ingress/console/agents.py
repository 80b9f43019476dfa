"""The agents list: the agents the signed-in token sees, those waiting for approval first, a page at a time with
a phase filter; its first page is redrawn live when their journals move."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.responses import HTMLResponse

from agents.core.phases import Phase
from agents.ingress.auth import sees_named
from agents.ingress.console import paging
from agents.ingress.console.common import Held, Keel, Viewer, Who, bad_cursor, link, page
from agents.ingress.console.paging import BadCursor
from agents.ingress.events import ANY_AGENT
from agents.ingress.runtime import Ingress
from models import console_sql
from models.schemas import AgentState

router = APIRouter(include_in_schema=False)

#: How often the live list of agents redraws at most (seconds): a burst of transitions is one redraw.
LIST_REDRAW_SECONDS = 0.5
PHASES = [p.value for p in Phase]


def _agents(keel: Ingress, who: Viewer, phase: str | None, cursor: str | None) -> tuple[list[AgentState], str | None]:
    """A page of the agents the viewer sees, in the order people handle them, and the next page's cursor."""
    after = None if cursor is None else paging.agents_key(cursor)
    try:
        rows, next_key = console_sql.agents_page(
            keel.db,
            phases=[phase] if phase else [],
            after=after,
            limit=keel.settings.console_page_size,
            name_prefix=who.token.agent_prefix,
        )
    except ValueError:  # a cursor from another filter's list
        assert cursor is not None
        raise BadCursor(cursor) from None
    return [AgentState.of(row) for row in rows], None if next_key is None else paging.agents_cursor(next_key)


def _unknown_phase(who: Viewer, phase: str | None) -> HTMLResponse | None:
    if not phase or phase in PHASES:
        return None
    message = f"There is no phase {phase[:60]!r}: the phases are {', '.join(PHASES)}."
    return page("message.html", who, status=400, title="Unknown phase", message=message)


def _agents_list(keel: Ingress, who: Viewer, phase: str | None, cursor: str | None) -> dict[str, Any]:
    agents, next_cursor = _agents(keel, who, phase, cursor)
    return {
        "agents": agents,
        "phase": phase,
        "cursor": cursor,
        "next_url": next_cursor and link("/agents", phase=phase, cursor=next_cursor),
        "first_url": link("/agents", phase=phase),
    }


@router.get("/agents")
def agents_page(
    keel: Keel,
    who: Who,
    phase: Annotated[str | None, Query()] = None,
    cursor: Annotated[str | None, Query()] = None,
) -> HTMLResponse:
    refusal = _unknown_phase(who, phase)
    if refusal is not None:
        return refusal
    try:
        listed = _agents_list(keel, who, phase or None, cursor or None)
    except BadCursor as exc:
        return bad_cursor(who, exc, link("/agents", phase=phase))
    return page("agents.html", who, phases=PHASES, **listed)


@router.get("/agents/rows")
def agents_rows(keel: Keel, who: Who, phase: Annotated[str | None, Query()] = None) -> HTMLResponse:
    """The list of the first page alone (its rows and its link to the next page): what the live script swaps in.
    Later pages are not redrawn live."""
    return _unknown_phase(who, phase) or page("agents_rows.html", who, **_agents_list(keel, who, phase or None, None))


@router.get("/agents/live", response_class=EventSourceResponse)
async def agents_live(keel: Keel, who: Who, hold: Held) -> AsyncIterator[ServerSentEvent]:
    """A ``changed`` event whenever the journal of an agent the session's token sees moves (at most every half
    second): the script then fetches the rows again. Ends when the session's token is revoked."""
    with keel.listener.subscribe(ANY_AGENT, sees=partial(sees_named, who.token)) as sub:
        while True:
            await sub.wait(or_=hold.ended)
            if keel.listener.stopped or hold.ended.is_set():
                return
            sub.clear()  # at once: what commits while the event goes out or the redraw pause lasts wakes it again
            if not await hold.allowed():
                return
            yield ServerSentEvent(event="changed", data={})
            await asyncio.sleep(LIST_REDRAW_SECONDS)

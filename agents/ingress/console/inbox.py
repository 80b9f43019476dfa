"""The inbox: every call waiting for approval across the agents the signed-in token sees, oldest first, through
the API's own query (its filters, page size and keyset cursor); redrawn live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Query
from starlette.responses import HTMLResponse

from agents.core.errors import InvalidInput
from agents.ingress.console import views
from agents.ingress.console.common import Keel, Viewer, Who, page, refused
from agents.ingress.routes.approvals import approvals_for
from agents.ingress.runtime import Ingress
from agents.ingress.tokens import Permission

router = APIRouter(include_in_schema=False)

#: How many waiting calls one page of the inbox shows (``?limit=``: up to ``INBOX_MAX_PAGE``); a link pages on with
#: the API's keyset cursor.
INBOX_PAGE = 50
INBOX_MAX_PAGE = 200


@dataclass(frozen=True, slots=True)
class InboxQuery:
    """The inbox's filters as given in the page's address (the GET form's fields), unparsed."""

    tool: str = ""
    min_age: str = ""
    agent_prefix: str = ""
    limit: str = ""
    cursor: str = ""

    def url(self, path: str, *, cursor: str | None = None) -> str:
        """``path`` with these filters (and ``cursor``) as its query."""
        fields = {
            "tool": self.tool,
            "min_age": self.min_age,
            "agent_prefix": self.agent_prefix,
            "limit": self.limit,
            "cursor": cursor,
        }
        query = urlencode({name: value for name, value in fields.items() if value})
        return f"{path}?{query}" if query else path

    def page_size(self) -> int:
        if not self.limit:
            return INBOX_PAGE
        size = int(self.limit) if self.limit.isdecimal() and len(self.limit) <= 6 else 0
        if not 1 <= size <= INBOX_MAX_PAGE:
            shown = self.limit if len(self.limit) <= 20 else self.limit[:19] + "…"
            raise ValueError(f"limit must be a whole number from 1 to {INBOX_MAX_PAGE}, got {shown!r}")
        return size


def inbox_query(
    tool: Annotated[str | None, Query()] = None,
    min_age: Annotated[str | None, Query()] = None,
    agent_prefix: Annotated[str | None, Query()] = None,
    limit: Annotated[str | None, Query()] = None,
    cursor: Annotated[str | None, Query()] = None,
) -> InboxQuery:
    """A dependency: the inbox's filters, taken as text (checked by :func:`_inbox`, which names a bad one)."""
    given = (tool, min_age, agent_prefix, limit, cursor)
    return InboxQuery(*((value or "").strip() for value in given))


Filters = Annotated[InboxQuery, Depends(inbox_query)]
#: The inbox's filters by name: a refusal's message begins with the one it refuses.
INBOX_FIELDS = ("tool", "min_age", "agent_prefix", "limit", "cursor")


def _inbox(keel: Ingress, who: Viewer, q: InboxQuery) -> dict[str, Any]:
    """One page of the calls waiting, through the API's own query; a bad filter is an ``error`` naming it."""
    try:
        found = approvals_for(
            keel.client,
            who.token,
            tool=q.tool or None,
            min_age=views.parse_age(q.min_age),
            agent_prefix=q.agent_prefix or None,
            limit=q.page_size(),
            cursor=q.cursor or None,
        )
    except (InvalidInput, ValueError) as exc:
        error = str(exc)
        field = next((name for name in INBOX_FIELDS if error.startswith(name + " ")), None)
        return {"q": q, "calls": (), "error": error, "error_field": field, "next_url": None, "first_url": None}
    return {
        "q": q,
        "calls": found.approvals,
        "error": None,
        "error_field": None,
        "next_url": q.url("/inbox", cursor=found.next) if found.next else None,
        "first_url": q.url("/inbox") if q.cursor else None,
    }


@router.get("/inbox")
def inbox_page(keel: Keel, who: Who, q: Filters) -> HTMLResponse:
    """Every call waiting for approval across the agents the token sees, oldest first; live."""
    if not who.can(Permission.READ_APPROVALS):
        return refused(who, f"Token {who.token.name!r} may not read the approvals inbox.")
    context = _inbox(keel, who, q)
    status = 400 if context["error"] else 200
    return page("inbox.html", who, status=status, rows_url=q.url("/inbox/rows", cursor=q.cursor), **context)


@router.get("/inbox/rows")
def inbox_rows(keel: Keel, who: Who, q: Filters) -> HTMLResponse:
    """The inbox's list alone: what the live script swaps in."""
    if not who.can(Permission.READ_APPROVALS):
        return refused(who, f"Token {who.token.name!r} may not read the approvals inbox.")
    context = _inbox(keel, who, q)
    return page("inbox_list.html", who, status=400 if context["error"] else 200, **context)

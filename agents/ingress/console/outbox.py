"""The outbox: the messages not sent yet, grouped per channel and destination, a page at a time with a status
filter, and the Retry button that puts one back in line."""

from __future__ import annotations

from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, RedirectResponse, Response

from agents.core.commands import check_text
from agents.core.errors import InvalidInput, KeelError
from agents.ingress.console import paging, sessions
from agents.ingress.console.common import Keel, Viewer, Who, bad_cursor, checked, link, page, read_form, refused
from agents.ingress.console.paging import BadCursor
from agents.ingress.problems import kind_of
from agents.ingress.runtime import Ingress
from agents.ingress.tokens import Permission
from models.outbox_sql import UNSENT, message_row, unsent_page

router = APIRouter(include_in_schema=False)

OUTBOX_STATUSES = UNSENT
#: The longest message key a Retry form may name (a key is far shorter; the limit only bounds the lookup).
MAX_KEY_CHARS = 2000


def _outbox(keel: Ingress, who: Viewer, status: str | None = None, before: int | None = None) -> dict[str, Any]:
    """A page of the messages not sent (newest first; only ``status`` if given; created before ``before`` if given),
    grouped per channel and destination, and the link to the next page."""
    size = keel.settings.console_page_size
    rows = unsent_page(keel.db, status=status, before_seq=before, limit=size + 1, name_prefix=who.token.agent_prefix)
    more = len(rows) > size
    rows = rows[:size]
    statuses = (status,) if status else OUTBOX_STATUSES
    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for row in rows:
        group = groups.setdefault((row["channel"], row["destination"]), {s: [] for s in statuses})
        group[row["status"]].append(row)
    return {
        "groups": dict(sorted(groups.items())),
        "statuses": statuses,
        "all_statuses": OUTBOX_STATUSES,
        "status_filter": status,
        "cursor": before,
        "paged": more or before is not None,
        "next_url": link("/outbox", status=status, cursor=rows[-1]["seq"]) if more else None,
        "first_url": link("/outbox", status=status),
    }


@router.get("/outbox")
def outbox_page(
    keel: Keel,
    who: Who,
    status: Annotated[str | None, Query()] = None,
    cursor: Annotated[str | None, Query()] = None,
    retried: Annotated[str | None, Query()] = None,
    proof: Annotated[str | None, Query()] = None,
) -> HTMLResponse:
    """The messages not sent yet; after a Retry, a notice naming the message — only for the session that retried it
    (``proof``, see :func:`sessions.notice_proof`): a crafted link shows no text of its own."""
    if not who.can(Permission.READ_OUTBOX):
        return refused(who, f"Token {who.token.name!r} may not read the outbox.")
    if status and status not in OUTBOX_STATUSES:
        message = f"There is no status {status[:60]!r} here: the Outbox page lists {', '.join(OUTBOX_STATUSES)}."
        return page("message.html", who, status=400, title="Unknown status", message=message, back="/outbox")
    try:
        before = paging.seq_cursor(cursor, low=1) if cursor else None
    except BadCursor as exc:
        return bad_cursor(who, exc, link("/outbox", status=status))
    notice = None
    if sessions.notice_ok(sessions.session_key(keel.settings), who.session, retried, proof):
        notice = f"Retrying {retried}: it is back in line to be sent."
    return page("outbox.html", who, notice=notice, **_outbox(keel, who, status or None, before))


@router.post("/outbox/retry")
async def outbox_retry(request: Request, keel: Keel, who: Who) -> Response:
    form = await read_form(request)
    refusal = checked(who, form, Permission.RETRY_OUTBOX)
    if refusal is not None:
        return refusal
    key = form.get("key", "")
    try:
        check_text("key", key, limit=MAX_KEY_CHARS)
    except InvalidInput as exc:
        return page("message.html", who, status=400, title="Bad form", message=f"{exc}: nothing was changed.")
    try:
        row = await run_in_threadpool(_retry, keel, who, key)
    except KeelError as exc:
        return page("outbox.html", who, status=kind_of(exc).status, error=str(exc), **_outbox(keel, who))
    if row is None:
        return page("message.html", who, status=404, title="No such message", message=f"No message has key {key!r}.")
    proof = sessions.notice_proof(sessions.session_key(keel.settings), who.session, key)
    return RedirectResponse(link("/outbox", retried=key, proof=proof), status_code=303)


def _retry(keel: Ingress, who: Viewer, key: str) -> dict[str, Any] | None:
    row = message_row(keel.db, key)
    if row is None or not _sees(keel, who, row.get("agent_id")):
        return None
    keel.client.retry_outbox(key, actor=who.token.name)
    return row


def _sees(keel: Ingress, who: Viewer, agent_id: object) -> bool:
    if who.token.agent_prefix is None:
        return True
    if not isinstance(agent_id, UUID):
        return False
    name = keel.client.agent_names([agent_id]).get(agent_id, "")
    return who.token.sees(name.removesuffix(" (deleted)"))

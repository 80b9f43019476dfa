"""``/v1/jobs`` and ``/v1/outbox``: one job by key; outbox messages by status; an operator's retry of a dead one."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query

from agents.core.errors import InvalidInput, quoted
from agents.ingress.auth import require, resolve, sees_agent
from agents.ingress.bodies import JsonBodyRoute
from agents.ingress.problems import NOT_FOUND, Problem
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.schemas import MAX_BIGINT, JobOut, OutboxMessage, OutboxPage
from agents.ingress.tokens import ApiToken, Permission
from models.jobs_sql import job_row
from models.outbox_sql import message_row, page_messages

router = APIRouter(prefix="/v1", tags=["records"], route_class=JsonBodyRoute)

Keel = Annotated[Ingress, Depends(ingress)]
MAX_PAGE = 1000


def _owned(keel: Keel, token: ApiToken, what: str, key: str, row: dict[str, object] | None) -> dict[str, object]:
    """``row`` if it exists and belongs to an agent the token sees; otherwise the same 404 either way."""
    if row is not None and not _sees(keel, token, row["agent_id"]):
        row = None
    if row is None:
        raise Problem(NOT_FOUND, f"no {what} has the key {quoted(key)}")
    return row


def _sees(keel: Keel, token: ApiToken, agent_id: object) -> bool:
    """Keel's own messages (no agent) are seen by tokens that see every agent only."""
    if agent_id is None:
        return token.agent_prefix is None
    return sees_agent(keel, token, agent_id)  # type: ignore[arg-type]


@router.get("/jobs/{key}", response_model=JobOut, summary="One job by its key")
def get_job(key: str, keel: Keel, token: Annotated[ApiToken, Depends(require(Permission.READ_JOB))]) -> JobOut:
    """Status, attempts per error class, lease, usage, its payload and its stored result (the checkpoint)."""
    return JobOut(**_owned(keel, token, "job", key, job_row(keel.db, key)))  # type: ignore[arg-type]


@router.get("/outbox", response_model=OutboxPage, summary="Outbox messages, newest first")
def list_outbox(
    keel: Keel,
    token: Annotated[ApiToken, Depends(require(Permission.READ_OUTBOX))],
    status: Annotated[Literal["pending", "sending", "sent", "dead"] | None, Query()] = None,
    channel: Annotated[Literal["slack", "github"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[str | None, Query(max_length=32, description="The `next` of the previous page")] = None,
    agent: Annotated[
        str | None, Query(max_length=200, description="Only this agent's messages: its id or name")
    ] = None,
) -> OutboxPage:
    """Newest first; ``status=dead&agent=NAME`` lists the side effects of an agent that never arrived."""
    agent_id = None if agent is None else resolve(keel, token, agent, deleted_ok=True).id
    before = None
    if cursor is not None:
        # ASCII digits only: str.isdigit() also holds for '²' and '١٢', which int() refuses or reads as a number.
        if not (cursor.isascii() and cursor.isdigit()) or int(cursor) > MAX_BIGINT:
            raise InvalidInput(f"cursor {quoted(cursor)} is not a `next` value this API returned")
        before = int(cursor)
    rows = page_messages(
        keel.db,
        status=status,
        channel=channel,
        before_seq=before,
        limit=limit + 1,
        name_prefix=token.agent_prefix,
        agent_id=agent_id,
    )
    more = len(rows) > limit
    rows = rows[:limit]
    return OutboxPage(
        messages=[OutboxMessage(**{k: v for k, v in r.items() if k != "seq"}) for r in rows],
        next=str(rows[-1]["seq"]) if more else None,
    )


@router.get("/outbox/{key}", response_model=OutboxMessage, summary="One outbox message by its key")
def get_message(
    key: str, keel: Keel, token: Annotated[ApiToken, Depends(require(Permission.READ_OUTBOX))]
) -> OutboxMessage:
    row = _owned(keel, token, "outbox message", key, message_row(keel.db, key))
    return OutboxMessage(**{k: v for k, v in row.items() if k in OutboxMessage.model_fields})  # type: ignore[arg-type]


@router.post("/outbox/{key}/retry", response_model=OutboxMessage, summary="Retry a dead outbox message")
def retry_message(
    key: str, keel: Keel, token: Annotated[ApiToken, Depends(require(Permission.RETRY_OUTBOX))]
) -> OutboxMessage:
    """Back to pending; the relay reconciles with the receiver first if it may have arrived. Journaled on the
    message's agent with the token's name. Only dead messages can be retried (409 otherwise)."""
    _owned(keel, token, "outbox message", key, message_row(keel.db, key))
    keel.client.retry_outbox(key, actor=token.name)
    row = message_row(keel.db, key)
    assert row is not None
    return OutboxMessage(**{k: v for k, v in row.items() if k in OutboxMessage.model_fields})

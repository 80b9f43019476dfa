"""``/healthz`` (the process answers), ``/readyz`` (it can serve: database reachable and migrated, broker reachable)
and ``/problems/{type}`` (what each problem type means)."""

from __future__ import annotations

from typing import Annotated, Any

import redis
import sqlalchemy
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from agents.ingress import problems
from agents.ingress.runtime import Ingress, ingress
from agents.ingress.schemas import Health, problem_doc
from models.migrations import schema_problem

router = APIRouter(tags=["health"])

Keel = Annotated[Ingress, Depends(ingress)]


@router.get("/healthz", response_model=Health, summary="The process is up")
def healthz() -> Health:
    return Health(status="ok")


def _database(keel: Ingress) -> str:
    try:
        problem = schema_problem(keel.db.engine)
    except sqlalchemy.exc.SQLAlchemyError as exc:
        return f"unreachable: {type(exc.orig or exc).__name__}" if hasattr(exc, "orig") else "unreachable"
    return "ok" if problem is None else problem


def _broker(keel: Ingress) -> str:
    if not keel.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return "ok (not checked: not Redis)"
    connection = keel.redis or redis.Redis.from_url(keel.broker_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        connection.ping()
    except redis.RedisError as exc:
        return f"unreachable: {type(exc).__name__}"
    return "ok"


async def _checks(keel: Ingress) -> dict[str, str]:
    return {"database": await run_in_threadpool(_database, keel), "broker": await run_in_threadpool(_broker, keel)}


@router.get(
    "/readyz",
    response_model=Health,
    summary="The process can serve",
    responses={503: {"model": Health, "description": "A dependency is unreachable or the schema is not this code's"}},
)
async def readyz(keel: Keel) -> Any:
    """200 when the database is reachable and migrated to this code's head and the broker answers; else 503 naming
    what is wrong (no secrets: URLs are never echoed). Checked at most once per process every second or two: probes
    that come meanwhile share that answer (agents/ingress/readiness.py)."""
    checks = await keel.readiness.get(lambda: _checks(keel))
    ready = all(value.startswith("ok") for value in checks.values())
    body = Health(status="ok" if ready else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get(
    "/problems/{slug}",
    summary="What a problem type means",
    responses={404: problem_doc("No such problem type")},
)
def problem_type(slug: str) -> dict[str, Any]:
    kinds = problems.all_kinds()
    if slug not in kinds:
        raise problems.Problem(problems.NOT_FOUND, f"no problem type is called {slug!r}: see /problems")
    kind = kinds[slug]
    return {"type": kind.type, "title": kind.title, "status": kind.status}


@router.get("/problems", summary="Every problem type the API answers with")
def problem_types() -> list[dict[str, Any]]:
    return [{"type": k.type, "title": k.title, "status": k.status} for k in problems.all_kinds().values()]

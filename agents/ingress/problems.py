"""Errors as RFC 9457 problem details: one stable ``type`` per Keel error, the facts in extension members
(``current_revision``, ``allowed``, ``differs``, ``errors``), the field path for bad input, never a stack trace or a
secret. Every refusal the API makes goes through here."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agents.core import errors
from agents.core.redaction import redact

log = logging.getLogger("keel.ingress")

MEDIA_TYPE = "application/problem+json"
#: The note :func:`on_unexpected` adds to an error it logged (``keel incident <id>``): the server need not log it again.
INCIDENT_NOTE = "keel incident "
#: Problem types are relative URIs under this path; ``GET /problems/{slug}`` describes each one.
TYPE_BASE = "/problems/"


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of problem: its HTTP status, its stable slug (the ``type``) and its title."""

    status: int
    slug: str
    title: str

    @property
    def type(self) -> str:
        return TYPE_BASE + self.slug


# Keel's errors, most specific first (the first class an error is an instance of decides).
_ERRORS: tuple[tuple[type[Exception], Kind], ...] = (
    (errors.MessageNotFound, Kind(404, "outbox-message-not-found", "Outbox message not found")),
    (errors.MessageNotDead, Kind(409, "outbox-message-not-dead", "Outbox message not dead")),
    (errors.UnknownOperation, Kind(422, "unknown-operation", "Unknown operation")),
    (errors.InvalidInput, Kind(422, "invalid-input", "Invalid input")),
    (errors.AgentNotFound, Kind(404, "agent-not-found", "Agent not found")),
    (errors.RequestNotFound, Kind(404, "request-not-found", "Request not found")),
    (errors.AgentExists, Kind(409, "agent-exists", "Agent name taken")),
    (errors.StaleRevision, Kind(412, "stale-revision", "Stale revision")),
    (errors.IllegalTransition, Kind(409, "illegal-transition", "Not allowed in this phase")),
    (errors.RequestConflict, Kind(409, "request-conflict", "Idempotency key reused with a different request")),
    (errors.AgentArchived, Kind(409, "agent-archived", "Agent archived")),
    (errors.AgentBusy, Kind(409, "agent-busy", "Agent busy")),
    (errors.AgentInUse, Kind(409, "agent-in-use", "Agent in use")),
    (errors.InvalidDeadlines, Kind(422, "invalid-deadlines", "Invalid deadlines")),
    (errors.HardDeadlinePassed, Kind(409, "hard-deadline-passed", "Hard deadline passed")),
    (errors.Rejected, Kind(409, "rejected", "Command rejected")),
    (errors.StoreError, Kind(503, "store-unavailable", "Database unavailable")),
)

# Problems of HTTP itself, and the ingress's own.
VALIDATION = Kind(422, "invalid-input", "Invalid input")
BAD_REQUEST = Kind(400, "bad-request", "Bad request")
UNAUTHORIZED = Kind(401, "unauthorized", "Missing or invalid token")
FORBIDDEN = Kind(403, "forbidden", "Token lacks the scope")
NOT_FOUND = Kind(404, "not-found", "Not found")
METHOD_NOT_ALLOWED = Kind(405, "method-not-allowed", "Method not allowed")
NOT_ACCEPTABLE = Kind(406, "not-acceptable", "Not acceptable")
TOO_LARGE = Kind(413, "payload-too-large", "Request body too large")
UNSUPPORTED_MEDIA = Kind(415, "unsupported-media-type", "Unsupported media type")
PRECONDITION_REQUIRED = Kind(428, "precondition-required", "If-Match required")
RATE_LIMITED = Kind(429, "rate-limited", "Too many requests")
TOO_MANY_STREAMS = Kind(429, "too-many-streams", "Too many live event streams")
INTERNAL = Kind(500, "internal-error", "Internal error")
UNAVAILABLE = Kind(503, "unavailable", "Service unavailable")

_BY_STATUS = {
    k.status: k for k in (BAD_REQUEST, NOT_FOUND, METHOD_NOT_ALLOWED, NOT_ACCEPTABLE, TOO_LARGE, UNSUPPORTED_MEDIA)
}


def error_kinds() -> tuple[tuple[type[Exception], Kind], ...]:
    """Keel's errors and the problem type each is answered with, most specific first (the docs' problem types)."""
    return _ERRORS


def all_kinds() -> dict[str, Kind]:
    """Every problem type the API answers with, by slug."""
    kinds = [kind for _, kind in _ERRORS]
    kinds += [VALIDATION, BAD_REQUEST, UNAUTHORIZED, FORBIDDEN, NOT_FOUND, METHOD_NOT_ALLOWED, NOT_ACCEPTABLE]
    kinds += [TOO_LARGE, UNSUPPORTED_MEDIA, PRECONDITION_REQUIRED, RATE_LIMITED, TOO_MANY_STREAMS, INTERNAL]
    kinds += [UNAVAILABLE]
    return {k.slug: k for k in kinds}


class Problem(errors.KeelError):
    """A refusal to answer with: raise it anywhere in a route or a dependency."""

    def __init__(
        self,
        kind: Kind,
        detail: str,
        *,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})


def problem_response(
    kind: Kind,
    detail: str,
    *,
    instance: str | None = None,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {"type": kind.type, "title": kind.title, "status": kind.status}
    # The text of an error may quote what the caller sent: secrets Keel knows are masked all the same.
    body["detail"] = redact(detail)
    if instance is not None:
        body["instance"] = redact(instance)  # the path: a secret pasted into a URL is masked there too
    body.update(extra or {})
    return JSONResponse(body, status_code=kind.status, headers=dict(headers or {}), media_type=MEDIA_TYPE)


def kind_for(error: type[errors.KeelError]) -> Kind:
    """The kind of problem an error of this class is answered with."""
    for cls, kind in _ERRORS:
        if issubclass(error, cls):
            return kind
    return INTERNAL


def kind_of(exc: errors.KeelError) -> Kind:
    return kind_for(type(exc))


def facts(exc: errors.KeelError) -> dict[str, Any]:
    """The extension members a client acts on, per error."""
    if isinstance(exc, errors.StaleRevision):
        return {
            "agent_id": str(exc.agent_id),
            "expected_revision": exc.expected_revision,
            "current_revision": exc.current_revision,
        }
    if isinstance(exc, errors.IllegalTransition):
        return {"agent_id": str(exc.agent_id), "phase": exc.phase, "event": exc.event, "allowed": list(exc.allowed)}
    if isinstance(exc, errors.RequestConflict):
        return {"request_id": exc.request_id, "differs": list(exc.differs)}
    if isinstance(exc, errors.UnknownOperation):
        return {"operation": exc.operation, "known": list(exc.known)}
    return {}


def field_facts(exc: errors.KeelError) -> dict[str, Any]:
    """Bad input refused by Keel itself (not by the body's schema) in the same shape: ``errors`` with a path."""
    if not isinstance(exc, errors.InvalidInput) or isinstance(exc, errors.UnknownOperation):
        return {}
    if exc.errors:
        return {"errors": [{"path": e["path"], "message": e["message"]} for e in exc.errors]}
    text = str(exc)
    head, _, rule = text.partition(": ")
    path = head.split()[-1] if rule and head and " " not in head.strip() else "body"
    return {"errors": [{"path": path, "message": rule if path != "body" else text}]}


def field_errors(raw: Sequence[Any]) -> list[dict[str, str]]:
    """Pydantic's errors as ``{"path": "body.input.prompt", "message": …}``: the field and the rule, never the value
    (it may be huge or hold a secret)."""
    out = []
    for err in raw:
        path = ".".join(str(p) for p in err.get("loc", ())) or "body"
        out.append({"path": path, "message": str(err.get("msg", "invalid"))})
    return out


async def on_keel_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.KeelError)
    kind = kind_of(exc)
    if kind is INTERNAL:
        return await on_unexpected(request, exc)
    if kind.status == 503:
        # The driver's text names hosts, ports and databases: the log gets it, the caller an incident id.
        incident = uuid.uuid4().hex[:12]
        log.warning("database unavailable (incident %s) on %s %s: %s", incident, request.method, request.url.path, exc)
        return problem_response(
            kind,
            f"the database is unavailable (incident {incident}, logged): retry shortly",
            instance=request.url.path,
            headers={"Retry-After": "1"},
            extra={"incident": incident},
        )
    return problem_response(kind, str(exc), instance=request.url.path, extra=facts(exc) | field_facts(exc))


async def on_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Problem)
    return problem_response(exc.kind, exc.detail, instance=request.url.path, headers=exc.headers, extra=exc.extra)


async def on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    found = field_errors(exc.errors())
    first = found[0] if found else {"path": "body", "message": "invalid"}
    detail = f"{first['path']}: {first['message']}"
    if len(found) > 1:
        detail += f" (and {len(found) - 1} more)"
    return problem_response(VALIDATION, detail, instance=request.url.path, extra={"errors": found})


async def on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = _BY_STATUS.get(exc.status_code, Kind(exc.status_code, "http-error", "HTTP error"))
    detail = exc.detail if isinstance(exc.detail, str) else kind.title
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"nothing is at {request.url.path}: see /docs for the API"
    return problem_response(kind, detail, instance=request.url.path, headers=exc.headers or {})


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # The trace goes to the log with an incident id; the caller gets the id, never the trace.
    incident = uuid.uuid4().hex[:12]
    exc.add_note(INCIDENT_NOTE + incident)
    log.error("unexpected error %s on %s %s", incident, request.method, request.url.path, exc_info=exc)
    return problem_response(
        INTERNAL,
        f"an unexpected error happened (incident {incident}, logged); a retry with the same Idempotency-Key is safe",
        instance=request.url.path,
        extra={"incident": incident},
    )

"""The HTTP API with Celery's publisher: a submit's first job goes to the broker at once, as ``Client`` with a
publisher does. ``keel serve`` runs :func:`create` under uvicorn (``factory=True``: each worker process builds its
own app, database pool and listener) with :func:`log_config` as its logging, and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import SecretStr

from agents.core.redaction import install_log_redaction, register_settings
from agents.ingress.app import create_app
from agents.ingress.problems import INCIDENT_NOTE, UNAUTHORIZED, Problem
from agents.observability.logs import choose_json, log_config_formatter, use_structlog
from agents.observability.metrics import Metrics, install_metrics
from agents.observability.tracing import API, configure_tracing
from models.settings import Settings
from tasks.app import submit_publisher
from tasks.metrics import domain_collectors

#: uvicorn's loggers: ``uvicorn.error`` (its own lines) and ``uvicorn.access`` (one line per request).
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class ReportedOnce(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" for an error the app's 500 handler already logged (with its
    incident id): Starlette hands every unexpected error to that handler, then raises it again for the server."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not any(str(note).startswith(INCIDENT_NOTE) for note in getattr(error, "__notes__", ()))


def log_config(level: str = "info", json: bool | None = None) -> dict[str, Any]:
    """uvicorn's ``log_config`` (``logging.config.dictConfig``): Keel's and uvicorn's lines (access lines included)
    on stderr as JSON lines or readable ones (``json``; None: :func:`~agents.observability.logs.choose_json` on
    stderr), with the request's context, every one redacted by Keel's formatter."""
    level = level.upper()
    json = choose_json(None) if json is None else json
    # Keel's formatter redacts every line it writes: no redaction filter on the handler (a line is redacted once).
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "keel"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"reported_once": {"()": "tasks.api.ReportedOnce"}},
        "formatters": {"keel": log_config_formatter("api", json)},
        "handlers": {"keel": handler},
        "loggers": {
            "uvicorn": {"handlers": ["keel"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level, "filters": ["reported_once"]},
            "uvicorn.access": {"handlers": ["keel"], "level": level, "propagate": False},
        },
        "root": {"handlers": ["keel"], "level": level},
    }


def create() -> FastAPI:
    settings = Settings()
    # Here too, not only in `keel serve`: this runs in every worker process, and under a plain `uvicorn
    # tasks.api:create --factory` with uvicorn's own logging.
    register_settings(settings)
    install_log_redaction([logging.getLogger(), *map(logging.getLogger, UVICORN_LOGGERS)])
    use_structlog()  # structlog's lines through uvicorn's handlers; the request's context on every line
    configure_tracing(settings, API)  # in each API process (uvicorn starts its workers afresh): off without an endpoint
    token = settings.api_metrics_token
    # Recorded in every API process (keel serve's exporter sums them), on the public port only behind their own
    # token; the collectors' pool closes with the app.
    domain = None if token is None else domain_collectors(settings)
    metrics = install_metrics("api", collectors=() if domain is None else domain.collectors)
    app = create_app(settings, publisher=submit_publisher(settings), on_close=() if domain is None else (domain.close,))
    if token is not None:
        app.add_api_route("/metrics", metrics_endpoint(metrics, token), methods=["GET"], include_in_schema=False)
    return app


def metrics_endpoint(metrics: Metrics, token: SecretStr) -> Callable[[Request], Response]:
    """``GET /metrics`` on the API's own port: what this API exports (every worker process's numbers with ``keel
    serve --workers N``), to a scrape that sends ``token`` (KEEL_API_METRICS_TOKEN) as a Bearer token."""
    expected = token.get_secret_value().encode()

    def scrape(request: Request) -> Response:  # a plain function: FastAPI runs it in its thread pool
        scheme, given = get_authorization_scheme_param(request.headers.get("authorization"))
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected):
            raise Problem(
                UNAUTHORIZED,
                "send KEEL_API_METRICS_TOKEN as a Bearer token to read /metrics",
                headers={"WWW-Authenticate": 'Bearer realm="keel-metrics"'},
            )
        body, content_type = metrics.exposition(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    return scrape

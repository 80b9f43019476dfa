"""Where spans go, if anywhere: decided without importing OpenTelemetry (its SDK and exporter take a good part of a
second to import), so a process with traces off — a ``keel`` command — pays nothing.
See :mod:`agents.observability.tracing` for the rules."""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

from models.settings import Settings

_TRACES_PATH = "/v1/traces"

#: The ``service.name`` of a ``keel`` command's spans.
CLI = "keel-cli"


def traces_endpoint(settings: Settings, environ: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP/HTTP URL spans are exported to, or None when traces are off (see
    :mod:`agents.observability.tracing`)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if settings.otlp_endpoint:
        return traces_url(settings.otlp_endpoint)
    full = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if full:
        return full
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return traces_url(base) if base else None


def traces_url(base: str) -> str:
    """``base`` with ``/v1/traces`` at the end of its path (unless there already); its query (a collector's key,
    say) and the rest kept as they are."""
    parts = urlsplit(base)
    path = parts.path.rstrip("/")
    return urlunsplit(parts._replace(path=path if path.endswith(_TRACES_PATH) else path + _TRACES_PATH))


def shown(url: str) -> str:
    """``url`` without what may be a credential (user info, query)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{'' if parts.port is None else f':{parts.port}'}{parts.path}"

"""OpenTelemetry traces: one span per observed unit of work, one trace per request across every process (the
``traceparent`` stored with jobs and outbox messages carries it). Off unless an OTLP endpoint is configured
(``KEEL_OTLP_ENDPOINT`` or the standard ``OTEL_EXPORTER_OTLP_*`` variables:
docs/explanation/runtime-outbox-and-workers.md#traces).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from contextvars import Token
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from agents.core import observe
from agents.observability.otlp import shown, traces_endpoint
from models.settings import Settings

log = logging.getLogger("keel.tracing")

#: The ``service.name`` of each process role (a ``keel`` command's: :data:`agents.observability.otlp.CLI`).
API, WORKER, BEAT = "keel-api", "keel-worker", "keel-beat"

_PROPAGATOR = TraceContextTextMapPropagator()

_SPAN_KINDS = {
    "http": SpanKind.SERVER,
    "job": SpanKind.CONSUMER,
    "model_call": SpanKind.CLIENT,
    "outbox_send": SpanKind.CLIENT,
}

#: Context keys and the span attributes they become (``traceparent`` is the span's parent, not an attribute).
_ATTRIBUTES = {
    "request_id": "keel.request_id",
    "agent_id": "keel.agent_id",
    "job_key": "keel.job_key",
    "outbox_key": "keel.outbox_key",
    "actor": "keel.actor",
    "route": "http.route",
    "status": "http.response.status_code",
}

#: Outcomes that mean the work failed although no exception left its block (the span's status is then an error).
_FAILED = {
    "job": frozenset({"retrying", "failed", "dead"}),
    "tool_call": frozenset({"timeout", "invalid"}),
    "outbox_send": frozenset({"transient", "ambiguous", "rate_limited", "permanent"}),
}


def span_name(op: observe.Op) -> str:
    """``keel.transition submit``, ``keel.job plan``, ``keel.model_call``, ``keel.tool_call search``,
    ``keel.outbox_send slack``, ``HTTP POST /v1/agents/{ref}/requests`` (the route template, once it is known)."""
    if op.kind == "http":
        route = op.context.get("route")
        return f"HTTP {op.name} {route}" if route else f"HTTP {op.name}"
    if op.kind == "model_call":  # its name is the provider's class: an attribute, not part of the name
        return "keel.model_call"
    return f"keel.{op.kind} {op.name}"


def _attributes(context: Mapping[str, Any]) -> dict[str, str | int]:
    found: dict[str, str | int] = {}
    for key, value in context.items():
        name = _ATTRIBUTES.get(key)
        if name is None or value is None:
            continue
        text = str(value)
        found[name] = int(text) if key == "status" and text.isascii() and text.isdigit() else text
    return found


def _links(context: Mapping[str, Any]) -> list[Link]:
    """The span link ``context`` names (:func:`agents.core.observe.link`), if it is a valid trace context."""
    carried = context.get("link")
    if not carried:
        return []
    linked = trace.get_current_span(_PROPAGATOR.extract({"traceparent": str(carried)})).get_span_context()
    return [Link(linked)] if linked.is_valid else []


class TracingObserver:
    """An :class:`agents.core.observe.Observer` that makes each unit of work a span (and the source of
    :func:`agents.core.observe.current_traceparent`)."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        # The span of each op in progress, by the op's id (an op is not hashable); ``added`` finds it here.
        self._spans: dict[int, Span] = {}

    def start(self, op: observe.Op) -> tuple[Span, Token[Context]]:
        parent = None
        carried = op.context.get("traceparent")
        if carried and not trace.get_current_span().get_span_context().is_valid:
            parent = _PROPAGATOR.extract({"traceparent": carried})  # malformed: a new trace, as if none were given
        attributes = _attributes(op.context)
        if op.kind == "http":
            attributes["http.request.method"] = op.name
        elif op.kind == "model_call":
            attributes["keel.provider"] = op.name
        span = self.tracer.start_span(
            span_name(op),
            context=parent,
            kind=_SPAN_KINDS.get(op.kind, SpanKind.INTERNAL),
            attributes=attributes,
            links=_links(op.context),
        )
        self._spans[id(op)] = span
        return span, otel_context.attach(trace.set_span_in_context(span))

    def added(self, op: observe.Op, context: dict[str, Any]) -> None:
        span = self._spans.get(id(op))
        if span is None:
            return
        span.set_attributes(_attributes(context))
        for found in _links(context):
            span.add_link(found.context)
        span.update_name(span_name(op))  # the route became known, or a transition was joined into another event

    def end(self, op: observe.Op, token: tuple[Span, Token[Context]]) -> None:
        span, attached = token
        self._spans.pop(id(op), None)
        try:
            if op.outcome is not None:
                span.set_attribute("keel.outcome", op.outcome)
            if op.error is not None:
                # The class only: an exception's text may quote what must not leave the process.
                span.set_status(Status(StatusCode.ERROR, type(op.error).__name__))
            elif op.kind == "http" and int(op.context.get("status", "0")) >= 500:
                span.set_status(Status(StatusCode.ERROR))
            elif op.outcome in _FAILED.get(op.kind, ()):
                span.set_status(Status(StatusCode.ERROR, op.outcome))
            span.end()
        finally:
            otel_context.detach(attached)

    def current_traceparent(self) -> str | None:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier.get("traceparent")


#: How long a process that stops waits, at most, for its last spans to reach the collector (its exit handler,
#: a prefork worker child's end): a collector that does not answer must not hold up a stop.
SHUTDOWN_SECONDS = 5.0


def _within(seconds: float, work: Callable[[], Any]) -> bool:
    """Run ``work`` on a daemon thread and wait for it ``seconds`` at most: True if it finished in time (and did not
    return False). The SDK's own flush ignores its timeout and waits for the exporter (its timeout, its retries);
    left behind, the thread goes on exporting and never keeps the process alive."""
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(work()), name="keel-trace-flush", daemon=True)
    thread.start()
    thread.join(max(seconds, 0.0))
    return bool(outcome) and outcome[0] is not False


@dataclass(frozen=True)
class Tracing:
    """Traces as configured in this process: :func:`configure_tracing` returns it."""

    provider: TracerProvider
    observer: TracingObserver
    endpoint: str
    pid: int

    def flush(self, timeout_millis: int = 5_000) -> bool:
        """Export the spans that ended so far (before a process ends without running its exit handlers), waiting
        ``timeout_millis`` at most: False if they were not all exported by then (the export goes on in the
        background)."""
        return _within(timeout_millis / 1000, self.provider.force_flush)

    def shutdown(self, timeout_millis: int = int(SHUTDOWN_SECONDS * 1000)) -> bool:
        """Stop tracing in this process: no more spans; those that ended are exported first, waiting
        ``timeout_millis`` at most. False if they were not all exported by then."""
        observe.unregister(self.observer)
        observe.set_trace_context(None)
        return _within(timeout_millis / 1000, self.provider.shutdown)


_installed: Tracing | None = None


def configure_tracing(settings: Settings, service_name: str, exporter: SpanExporter | None = None) -> Tracing | None:
    """Turn traces on in this process as ``service_name`` (:data:`API`, :data:`WORKER`, :data:`BEAT`) when an OTLP
    endpoint is configured, else return None. ``exporter`` replaces the OTLP/HTTP one (tests); configuring again
    replaces what this process configured, not what a forked parent had."""
    global _installed
    endpoint = traces_endpoint(settings)
    if endpoint is None:
        return None
    if _installed is not None:
        if _installed.pid == os.getpid():
            _installed.shutdown()
        else:  # inherited through a fork: its export thread is not this process's
            observe.unregister(_installed.observer)
        _installed = None
    resource = Resource.create(
        {
            "service.name": service_name,
            "service.version": version("keel"),
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
            "deployment.environment.name": settings.environment,
        }
    )
    # Its exit handler is this module's: the SDK's would wait for a collector that does not answer (its timeout,
    # then its retries) before the process could end.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=endpoint)))
    # Not OpenTelemetry's global provider, so libraries' own telemetry stays off; the current span is global all the
    # same, so spans a tool makes through a provider of its own join the trace.
    observer = TracingObserver(provider.get_tracer("keel", version("keel")))
    observe.register(observer)
    observe.set_trace_context(observer)
    _installed = Tracing(provider, observer, endpoint, os.getpid())
    log.info("traces: %s spans go to %s", service_name, shown(endpoint))
    return _installed


def installed() -> Tracing | None:
    """What :func:`configure_tracing` turned on in this process, if anything."""
    return _installed if _installed is not None and _installed.pid == os.getpid() else None


def flush_tracing(seconds: float = SHUTDOWN_SECONDS) -> bool:
    """Export what ended so far, if traces are on here, waiting ``seconds`` at most: before ``os._exit`` (a worker
    child that ends). False if something may be left unexported."""
    tracing = installed()
    if tracing is None:
        return True
    if tracing.flush(int(seconds * 1000)):
        return True
    _not_exported(tracing, seconds)
    return False


@atexit.register
def _shutdown_at_exit() -> None:
    tracing = installed()
    if tracing is not None and not tracing.shutdown():
        _not_exported(tracing, SHUTDOWN_SECONDS)


def _not_exported(tracing: Tracing, seconds: float) -> None:
    log.warning(
        "traces: the last spans were not exported within %g s (the collector at %s did not answer in time);"
        " this process ends without them",
        seconds,
        shown(tracing.endpoint),
    )

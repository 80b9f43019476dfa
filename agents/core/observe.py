"""Where Keel's units of work are observed, one hook for many observers: a transition, a job run, a model call, a
tool call, an outbox send and an HTTP request each run inside ``with observe(kind, name, **context):``, and the
observers :mod:`agents.observability` registers (metrics, traces, log context) see each start and end. Core,
runtime, jobs and outbox never import them (imports point down); with none registered ``observe`` costs a clock
read."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: The kinds of work observed (metric names and span names derive from them).
KINDS = ("transition", "job", "model_call", "tool_call", "outbox_send", "http")


@dataclass
class Op:
    """One unit of work being observed."""

    kind: str
    name: str
    context: dict[str, str] = field(default_factory=dict)
    outcome: str | None = None
    #: Set when the block ends.
    seconds: float | None = None
    error: BaseException | None = None

    def add(self, **context: Any) -> None:
        """Name more of what the work is about once it is known (e.g. the agent a job belongs to, after its claim)."""
        for key, value in context.items():
            if value is not None:
                self.context[key] = str(value)
        for observer in _observers:
            try:
                observer.added(self, context)
            except Exception:  # an observer must never fail the work
                log.debug("observer %r failed on added()", observer, exc_info=True)


class Observer(Protocol):
    def start(self, op: Op) -> Any:
        """Called when ``op`` starts; what it returns is handed back to :meth:`end`."""

    def added(self, op: Op, context: dict[str, Any]) -> None:
        """Called when the work names more of its context."""

    def end(self, op: Op, token: Any) -> None:
        """Called when ``op`` ends (``op.seconds``, ``op.outcome`` and ``op.error`` are set)."""


_observers: list[Observer] = []


def register(observer: Observer) -> None:
    """Add ``observer`` (once; registering the same object again does nothing)."""
    if all(o is not observer for o in _observers):
        _observers.append(observer)


def unregister(observer: Observer) -> None:
    _observers[:] = [o for o in _observers if o is not observer]


def observers() -> tuple[Observer, ...]:
    return tuple(_observers)


class TraceContext(Protocol):
    def current_traceparent(self) -> str | None: ...


_trace_context: TraceContext | None = None


def set_trace_context(source: TraceContext | None) -> None:
    """Where :func:`current_traceparent` reads from (set by the tracing observer when traces are on)."""
    global _trace_context
    _trace_context = source


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the work in progress, to store with the jobs and messages it causes; None when
    traces are off or nothing is being traced."""
    source = _trace_context
    if source is None:
        return None
    try:
        return source.current_traceparent()
    except Exception:
        log.debug("current_traceparent failed", exc_info=True)
        return None


_current: ContextVar[Op | None] = ContextVar("keel_observed_op", default=None)


def current() -> Op | None:
    """The innermost unit of work in progress in this context, if any."""
    return _current.get()


def annotate(**context: Any) -> None:
    """Name more of what the work in progress is about (e.g. the token's name once the ingress knows it)."""
    op = _current.get()
    if op is not None:
        op.add(**context)


def link(traceparent: str) -> None:
    """Relate the work in progress to the trace ``traceparent`` names without joining it (a span link, when traces
    are on): an approval, in its HTTP request's trace, acts on the request it approves, whose trace the jobs it
    schedules continue."""
    annotate(link=traceparent)


@contextmanager
def observe(kind: str, name: str, **context: Any) -> Iterator[Op]:
    """Run the block as one unit of work of ``kind`` named ``name``. ``context`` names what it is about
    (``request_id``, ``agent_id``, ``job_key``, ``outbox_key``, ``actor``, ``traceparent``: a stored W3C trace context
    to continue, ``link``: one it relates to without continuing it), as strings, ``None`` left out. The block may set
    ``op.outcome`` (``applied``, ``rejected``, …); an exception leaving it makes the outcome its class name unless one
    was set. An observer that fails never fails the work."""
    op = Op(kind, name, {k: str(v) for k, v in context.items() if v is not None})
    reset = _current.set(op)
    try:
        if not _observers:  # the common case in tests and tools: nothing to tell
            started = time.perf_counter()
            try:
                yield op
            finally:
                op.seconds = time.perf_counter() - started
            return
        with _observed(op):
            yield op
    finally:
        _current.reset(reset)


@contextmanager
def _observed(op: Op) -> Iterator[None]:
    tokens: list[tuple[Observer, Any]] = []
    for observer in tuple(_observers):
        try:
            tokens.append((observer, observer.start(op)))
        except Exception:
            log.debug("observer %r failed on start()", observer, exc_info=True)
    started = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        op.error = exc
        if op.outcome is None:
            op.outcome = type(exc).__name__
        raise
    finally:
        op.seconds = time.perf_counter() - started
        if op.outcome is None:
            op.outcome = "ok"
        for observer, token in reversed(tokens):
            try:
                observer.end(op, token)
            except Exception:
                log.debug("observer %r failed on end()", observer, exc_info=True)

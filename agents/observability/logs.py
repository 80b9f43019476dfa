"""Keel's log lines: one structlog formatter on the process's handlers writes every record (Keel's, Celery's,
uvicorn's) as a JSON or a readable line, with the context of the work in progress (request, agent, job, outbox key,
actor, trace) and every value redacted once (docs/explanation/runtime-outbox-and-workers.md#log-lines).
"""

from __future__ import annotations

import json as jsonlib
import logging
import os
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import IO, Any

import structlog
from opentelemetry import trace

from agents.core import observe
from agents.core.redaction import RedactingFilter, redact_value

#: What the work in progress is about, copied onto every line logged within it.
CONTEXT_KEYS = ("request_id", "agent_id", "job_key", "outbox_key", "actor")
#: The values of ``KEEL_LOG_FORMAT``.
FORMATS = ("json", "console")

EventDict = MutableMapping[str, Any]

_ops: ContextVar[tuple[observe.Op, ...]] = ContextVar("keel_logged_ops", default=())


class LogContext:
    """The observer that puts the context of the units of work in progress on every line logged within them; units
    nest (a job run → a model call → a transition), each adding to its enclosing units' context until it ends."""

    def start(self, op: observe.Op) -> None:
        _ops.set((*_ops.get(), op))

    def added(self, op: observe.Op, context: dict[str, Any]) -> None:
        """Nothing to do: lines read the op's context when they are written."""

    def end(self, op: observe.Op, token: Any) -> None:
        # Not ContextVar.reset(token): an op may end in a copy of the context it started in (an ASGI server's task).
        _ops.set(tuple(o for o in _ops.get() if o is not op))


#: The one observer (registering it again does nothing).
LOG_CONTEXT = LogContext()


def work_context() -> dict[str, str]:
    """The context of the work in progress here: the units' (outermost first, inner ones win), then what is bound
    with ``structlog.contextvars`` (which wins over both)."""
    found: dict[str, str] = {}
    for op in _ops.get():
        found.update((k, v) for k, v in op.context.items() if k in CONTEXT_KEYS)
    found.update((k, str(v)) for k, v in structlog.contextvars.get_contextvars().items() if k in CONTEXT_KEYS)
    return found


def log_context(**context: Any) -> AbstractContextManager[Any]:
    """Name what the lines logged in the block are about, outside any observed unit of work (``None`` values are
    left out): ``with log_context(job_key=key, agent_id=...):``."""
    return structlog.contextvars.bound_contextvars(**{k: str(v) for k, v in context.items() if v is not None})


def add_work_context(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    """Processor: the work's context (see :func:`work_context`), without overriding what the line itself names."""
    for key, value in work_context().items():
        event_dict.setdefault(key, value)
    return event_dict


def add_trace_context(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    """Processor: ``trace_id`` and ``span_id`` (hex, as W3C ``traceparent`` writes them) of the current
    OpenTelemetry span, when there is a valid one (traces are on and something is being traced)."""
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        event_dict.setdefault("trace_id", trace.format_trace_id(span.trace_id))
        event_dict.setdefault("span_id", trace.format_span_id(span.span_id))
    return event_dict


def redact_event(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    """Processor: every string on the line (event, values, the rendered traceback) with secrets masked."""
    return {key: redact_value(value) for key, value in event_dict.items()}


#: The first keys of a JSON line, in this order; the rest follow as they came.
_FIRST = ("timestamp", "level", "logger", "event")


class _Process:
    """Processor of JSON lines: the process's role and pid, and the keys in a fixed order."""

    def __init__(self, role: str) -> None:
        self.role = role

    def __call__(self, _logger: Any, _method: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("role", self.role)
        event_dict.setdefault("pid", os.getpid())
        first = {key: event_dict.pop(key) for key in _FIRST if key in event_dict}
        return {**first, **event_dict}


#: What every line gets, whether it came from ``logging`` or from structlog (when the line is written: these read
#: context variables, so they must not run later or elsewhere).
_SHARED: tuple[Any, ...] = (
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_logger_name,
    structlog.stdlib.add_log_level,
    add_work_context,
    add_trace_context,
)


#: Characters JSON leaves raw that ``str.splitlines()`` and other readers take for line ends (those below U+0020
#: are always escaped).
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _dumps(value: Any, **options: Any) -> str:
    """``json.dumps`` (UTF-8 kept readable) with the line-breaking characters escaped: one record, one line."""
    return jsonlib.dumps(value, **options).translate(_LINE_BREAKS)


class Formatter(structlog.stdlib.ProcessorFormatter):
    """Keel's formatter (see :func:`formatter`). It redacts every value of the lines it writes (``redacts``), so its
    handlers need no :class:`~agents.core.redaction.RedactingFilter` — each line is redacted once."""

    redacts = True


def formatter(role: str, json: bool) -> Formatter:
    """The formatter for a handler of a Keel process (``role``: api, worker, beat, cli …): JSON lines or readable
    ones, each with the work's context. Usable from ``dictConfig`` (:func:`log_config_formatter`)."""
    last: list[Any]
    if json:
        timestamps = structlog.processors.TimeStamper(fmt="iso", utc=True)
        last = [_Process(role), structlog.processors.JSONRenderer(_dumps, sort_keys=False, ensure_ascii=False)]
    else:
        timestamps = structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False)
        console = structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback, pad_event_to=0
        )
        last = [console]
    return Formatter(
        # A standard-library line may name its context itself: log.info(..., extra={"outbox_key": key}).
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(allow=CONTEXT_KEYS), *_SHARED],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            timestamps,
            structlog.processors.StackInfoRenderer(),
            # Tracebacks as text before redaction, so that a secret in one is masked like any other value.
            structlog.processors.format_exc_info,
            redact_event,
            *last,
        ],
    )


def choose_json(setting: str | None, stream: IO[str] | None = None) -> bool:
    """Whether to write JSON lines: ``setting`` (``KEEL_LOG_FORMAT``: ``json`` or ``console``) when given; else
    readable lines on a terminal (``stream``, stderr by default), JSON otherwise (a file, a pipe, a container's
    log)."""
    if setting is not None:
        if setting not in FORMATS:
            raise ValueError(f"unknown log format {setting!r}; known: {', '.join(FORMATS)}")
        return setting == "json"
    stream = stream if stream is not None else sys.stderr
    try:
        return not stream.isatty()
    except (AttributeError, ValueError, OSError):  # closed, or not a real stream
        return True


def use_structlog() -> None:
    """Route ``structlog.get_logger()`` lines through the standard library (to the formatter above) and register
    :data:`LOG_CONTEXT`. For a process whose handlers someone else sets up (uvicorn's ``log_config``, Celery);
    idempotent."""
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_SHARED,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    observe.register(LOG_CONTEXT)


def restyle(handlers: Iterable[logging.Handler], role: str, json: bool | None) -> None:
    """Give ``handlers`` (set up by someone else: Celery) Keel's formatter, which redacts their lines (a redaction
    filter put on them earlier goes: one redaction per line is enough). ``json`` None: chosen per handler from its
    stream (see :func:`choose_json`)."""
    for handler in handlers:
        stream = getattr(handler, "stream", None)
        handler.setFormatter(formatter(role, choose_json(None, stream) if json is None else json))
        for redacting in [f for f in handler.filters if isinstance(f, RedactingFilter)]:
            handler.removeFilter(redacting)


def configure_logging(
    role: str,
    json: bool | None = None,
    *,
    level: int | str = logging.INFO,
    stream: IO[str] | None = None,
    setting: str | None = None,
) -> bool:
    """Set up this process's logging: one root handler on ``stream`` (stderr) with :func:`formatter`, and structlog
    through it. ``json`` None: chosen by :func:`choose_json`. Returns whether lines are JSON."""
    stream = stream if stream is not None else sys.stderr
    as_json = choose_json(setting, stream) if json is None else json
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(role, as_json))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    use_structlog()
    return as_json


def log_config_formatter(role: str, json: bool) -> Mapping[str, Any]:
    """The ``dictConfig`` entry of :func:`formatter` (uvicorn's ``log_config``)."""
    return {"()": f"{__name__}.formatter", "role": role, "json": json}

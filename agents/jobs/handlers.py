"""Job handlers, registered by operation name.

A handler takes a :class:`JobContext` and returns a :class:`JobResult` (or raises a
:class:`~agents.core.errors.JobError` subclass to say how it failed). Modules listed in ``KEEL_IMPORTS`` and entry
points in the ``keel.handlers`` group are imported at worker start so their ``@handler`` decorators run.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from importlib.metadata import entry_points
from typing import Any
from uuid import UUID

from agents.core.commands import JobSpec, Join, MessageSpec, Usage
from agents.core.phases import Event
from models.db import Database
from models.jobs_sql import checkpoint


@dataclass(frozen=True, slots=True)
class JobContext:
    key: str
    agent_id: UUID
    request_id: str
    operation: str
    target: str
    payload: Mapping[str, Any]
    attempt: int  # 1 for the first run
    fencing_token: int
    db: Database
    #: Set when this worker lost the job (lease taken over, agent stopped): stop early, the outcome is discarded.
    lost: threading.Event = field(default_factory=threading.Event)
    #: What an earlier attempt of this step checkpointed (e.g. a model reply it paid for), or None.
    checkpointed: Mapping[str, Any] | None = None
    #: Set by a handler that left work running it could not stop (a tool past its timeout, on its own thread):
    #: once the outcome is recorded, the worker ends this process, so that work can have no effect afterwards.
    abandoned: threading.Event = field(default_factory=threading.Event)

    def checkpoint(self, data: Mapping[str, Any]) -> None:
        """Store ``data`` as this step's result now, so a retry after a crash reuses it instead of redoing it."""
        checkpoint(self.db, self.key, self.fencing_token, dict(data))


@dataclass(frozen=True, slots=True)
class JobResult:
    """What a step produced. ``event`` moves the agent (None: it stays in its phase); ``jobs`` are the next steps."""

    output: Mapping[str, Any] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)
    event: Event | None = None
    jobs: tuple[JobSpec, ...] = ()
    messages: tuple[MessageSpec, ...] = ()  # sent through the outbox once the result is recorded
    join: Join | None = None  # what to do instead of ``event`` if this was the agent's last live job

    def to_json(self) -> dict[str, Any]:
        """The whole result as JSON: what a checkpoint stores so a replay commits exactly this, once."""
        return {
            "output": dict(self.output),
            "usage": _usage_json(self.usage),
            "event": None if self.event is None else self.event.value,
            "jobs": [_spec_json(s) for s in self.jobs],
            "messages": [
                {"channel": m.channel, "destination": m.destination, "target": m.target, "payload": dict(m.payload)}
                for m in self.messages
            ],
            "join": None
            if self.join is None
            else {"event": self.join.event.value, "jobs": [_spec_json(s) for s in self.join.jobs]},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobResult:
        join = data.get("join")
        return cls(
            output=dict(data.get("output") or {}),
            usage=_usage(data.get("usage")),
            event=None if data.get("event") is None else Event(data["event"]),
            jobs=tuple(_spec(s) for s in data.get("jobs") or ()),
            messages=tuple(MessageSpec(**m) for m in data.get("messages") or ()),
            join=None if join is None else Join(Event(join["event"]), tuple(_spec(s) for s in join.get("jobs") or ())),
        )


def _usage_json(usage: Usage) -> dict[str, Any]:
    return {"tokens": usage.tokens, "cost": str(usage.cost)}


def _usage(data: Mapping[str, Any] | None) -> Usage:
    data = data or {}
    return Usage(int(data.get("tokens", 0)), Decimal(str(data.get("cost", "0"))))


def _spec_json(spec: JobSpec) -> dict[str, Any]:
    return {
        "operation": spec.operation,
        "target": spec.target,
        "payload": dict(spec.payload),
        "delay": None if spec.delay is None else spec.delay.total_seconds(),
        "priority": spec.priority,
    }


def _spec(data: Mapping[str, Any]) -> JobSpec:
    delay = data.get("delay")
    return JobSpec(
        data["operation"],
        data["target"],
        payload=dict(data.get("payload") or {}),
        delay=None if delay is None else timedelta(seconds=float(delay)),
        priority=int(data.get("priority", 5)),
    )


Handler = Callable[[JobContext], JobResult]


class Registry:
    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def register(self, operation: str, fn: Handler, *, replace: bool = False) -> None:
        if operation in self._handlers and self._handlers[operation] is not fn and not replace:
            raise ValueError(f"operation {operation!r} has a handler already")
        self._handlers[operation] = fn

    def get(self, operation: str) -> Handler | None:
        return self._handlers.get(operation)

    def operations(self) -> list[str]:
        return sorted(self._handlers)


#: The process-wide registry that ``@handler`` fills.
registry = Registry()


def handler(operation: str) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of ``operation``."""

    def register(fn: Handler) -> Handler:
        registry.register(operation, fn)
        return fn

    return register


def load(modules: Iterable[str]) -> Registry:
    """Import handler modules (``KEEL_IMPORTS``) and ``keel.handlers`` entry points; return the registry."""
    for name in modules:
        importlib.import_module(name)
    for point in entry_points(group="keel.handlers"):
        point.load()
    return registry

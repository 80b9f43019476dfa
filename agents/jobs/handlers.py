"""Job handlers, registered by operation name, each with the pydantic model of the input it reads (if declared). A
handler takes a :class:`JobContext` and returns a :class:`JobResult` (or raises a
:class:`~agents.core.errors.JobError` subclass to say how it failed). ``KEEL_IMPORTS`` modules and ``keel.handlers``
entry points are imported at worker start (and by the client, which checks a submit against the input model)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from importlib.metadata import entry_points
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ValidationError

from agents.core.commands import JobSpec, Join, MessageSpec, Usage
from agents.core.errors import FencedOff, InvalidInput, UnknownOperation
from agents.core.phases import Event
from models.db import Database
from models.jobs_sql import checkpoint
from models.settings import import_handler_module


class FencedDatabase:
    """The database as a job's handler sees it (``ctx.db``): once the job is lost to this run (its run limit passed,
    its lease taken over, its agent stopped), every new connection, transaction or session is refused with
    :class:`~agents.core.errors.FencedOff` (checked again once the connection is had, which may take a while, and
    before a transaction commits: it then rolls back), so a handler left running cannot act through Keel afterwards."""

    def __init__(self, db: Database, key: str, lost: threading.Event) -> None:
        self._db = db
        self._key = key
        self._lost = lost

    def _check(self) -> None:
        if self._lost.is_set():
            raise FencedOff(self._key)

    @contextmanager
    def _fenced(self, opened: Any) -> Iterator[Any]:
        self._check()
        with opened as handle:
            self._check()
            yield handle

    def connection(self) -> Any:
        return self._fenced(self._db.connection())

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        self._check()
        with self._db.transaction() as cur:
            self._check()
            yield cur
            self._check()  # raising here rolls the transaction back

    def autocommit(self) -> Any:
        return self._fenced(self._db.autocommit())

    def reading(self, **kwargs: Any) -> Any:
        return self._fenced(self._db.reading(**kwargs))

    def session(self, **kwargs: Any) -> Any:
        return self._fenced(self._db.session(**kwargs))

    @property
    def engine(self) -> Any:
        self._check()
        return self._db.engine

    def __getattr__(self, name: str) -> Any:  # its URL, audit keys and the like: read, not a way in
        return getattr(self._db, name)


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
    #: The journaled decision of the transition that records this result (None: ``accepted``), and facts for its
    #: details: what went wrong in a step that still succeeded (a tool call the model has to correct).
    decision: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    #: Fields of earlier steps' stored results (``(key, field)``, steps of the same request) that this result makes
    #: redundant: dropped in the transaction that records it, so what it supersedes is never stored twice.
    drops: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The whole result as JSON: what a checkpoint stores so a replay commits exactly this, once."""
        return {
            "output": dict(self.output),
            "usage": _usage_json(self.usage),
            "event": None if self.event is None else self.event.value,
            "jobs": [_spec_json(s) for s in self.jobs],
            "messages": [message_json(m) for m in self.messages],
            "join": None
            if self.join is None
            else {"event": self.join.event.value, "jobs": [_spec_json(s) for s in self.join.jobs]},
            "decision": self.decision,
            "details": dict(self.details),
            "drops": [list(drop) for drop in self.drops],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobResult:
        join = data.get("join")
        return cls(
            output=dict(data.get("output") or {}),
            usage=Usage.from_json(data.get("usage")),
            event=None if data.get("event") is None else Event(data["event"]),
            jobs=tuple(_spec(s) for s in data.get("jobs") or ()),
            messages=tuple(MessageSpec(**m) for m in data.get("messages") or ()),
            join=None if join is None else Join(Event(join["event"]), tuple(_spec(s) for s in join.get("jobs") or ())),
            decision=data.get("decision"),
            details=dict(data.get("details") or {}),
            drops=tuple((str(key), str(name)) for key, name in data.get("drops") or ()),
        )


def message_json(message: MessageSpec) -> dict[str, Any]:
    """A message as a step's stored result keeps it (what ``JobResult.from_json`` reads back)."""
    data: dict[str, Any] = {"channel": message.channel, "destination": message.destination, "target": message.target}
    data["payload"] = dict(message.payload)
    return data if message.step is None else {**data, "step": message.step}


def _usage_json(usage: Usage) -> dict[str, Any]:
    return {"tokens": usage.tokens, "cost": str(usage.cost)}


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
        self._inputs: dict[str, type[BaseModel] | None] = {}
        self._internal: set[str] = set()
        self._repeatable: set[str] = set()

    def register(
        self,
        operation: str,
        fn: Handler,
        *,
        input: type[BaseModel] | None = None,
        replace: bool = False,
        internal: bool = False,
        repeatable: bool = False,
    ) -> None:
        if operation in self._handlers and self._handlers[operation] is not fn and not replace:
            raise ValueError(f"operation {operation!r} has a handler already")
        self._handlers[operation] = fn
        self._inputs[operation] = input
        if internal:
            self._internal.add(operation)
        if repeatable:
            self._repeatable.add(operation)
        else:
            self._repeatable.discard(operation)

    def repeatable(self, operation: str) -> bool:
        """Whether ``operation``'s handler said a run of it may be repeated (``repeatable=True``): then an outcome of
        it that spent nothing and declared no messages is recorded without being staged first."""
        return operation in self._repeatable

    def declare(self, operation: str, *, input: type[BaseModel] | None = None) -> None:
        """Make ``operation`` known to producers without its handler (which runs in the workers' processes only):
        a submit to it is accepted, its input checked against ``input`` if given."""
        JobSpec(operation, "1")  # the name must be able to be part of a key
        if operation not in self._handlers:
            self._inputs[operation] = input

    def get(self, operation: str) -> Handler | None:
        return self._handlers.get(operation)

    def knows(self, operation: str) -> bool:
        return operation in self._inputs

    def operations(self) -> list[str]:
        return sorted(self._handlers)

    def public_operations(self) -> list[str]:
        """The operations a request may start with (every known one but the runtime's own steps)."""
        return sorted(set(self._inputs) - self._internal)

    def input_model(self, operation: str) -> type[BaseModel] | None:
        """The pydantic model ``operation`` reads its input with; None: any JSON is accepted."""
        return self._inputs.get(operation)

    def check_input(self, operation: str, value: Any) -> None:
        """Raise :class:`UnknownOperation` if nobody registered or declared ``operation``, and
        :class:`InvalidInput` naming the field path and the rule if ``value`` does not fit its input model."""
        if operation not in self._inputs:
            raise UnknownOperation(operation, self.public_operations())
        if operation in self._internal:
            raise InvalidInput(
                f"operation {operation!r} is one the runtime schedules itself; a request starts with one of: "
                + ", ".join(self.public_operations())
            )
        model = self._inputs[operation]
        if model is None:
            return
        try:
            model.model_validate(value)
        except ValidationError as exc:
            refused = InvalidInput(f"input of operation {operation!r}: {describe(exc, 'input')}")
            refused.errors = field_problems(exc, "input")
            raise refused from None


#: The process-wide registry that ``@handler`` fills.
registry = Registry()


def handler(
    operation: str, *, input: type[BaseModel] | None = None, internal: bool = False, repeatable: bool = False
) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of ``operation``. ``input`` is the pydantic model of the
    request input it reads (``payload["input"]`` of the request's first job): a submit that does not fit it is refused
    before anything is written; without it, any JSON is accepted. ``internal``: only scheduled by other steps (a submit
    naming it is refused). ``repeatable``: running it twice does no harm (it acts on nothing outside Keel), so an
    outcome that spent nothing and declared no messages skips its staged checkpoint
    (docs/explanation/storage-and-jobs.md#the-commits-of-one-job)."""

    def register(fn: Handler) -> Handler:
        registry.register(operation, fn, input=input, internal=internal, repeatable=repeatable)
        return fn

    return register


def load(modules: Iterable[str]) -> Registry:
    """Import handler modules (``KEEL_IMPORTS``, as :func:`models.settings.import_handler_module` finds them) and
    ``keel.handlers`` entry points; return the registry."""
    for name in modules:
        import_handler_module(name)
    for point in entry_points(group="keel.handlers"):
        point.load()
    return registry


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def json_kind(value: Any) -> str:
    """What a JSON value is, as a person says it: ``an object``, ``null``, ``a number`` …"""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return _JSON_KINDS.get(type(value), type(value).__name__)


def describe(exc: ValidationError, root: str) -> str:
    """The first problem pydantic found, as one line: the path from ``root`` (``input.script[0].tool_calls[1]
    .name``) and the rule, in JSON's words; ``(and N more)`` when there are more."""
    found = field_problems(exc, root)
    path, rule = found[0]["path"], found[0]["message"]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"{path}: {rule}{more}"


def field_problems(exc: ValidationError, root: str) -> list[dict[str, str]]:
    """Every problem pydantic found: ``{"path": "input.script[0].content", "message": the rule}``, in JSON's words."""
    found = []
    for err in exc.errors(include_url=False):
        path = root
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
        kind = err["type"]
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            rule = f"must be a JSON object, got {json_kind(err['input'])}"
        elif kind == "list_type":
            rule = f"must be a JSON array, got {json_kind(err['input'])}"
        elif kind == "string_type":
            rule = f"must be a string, got {json_kind(err['input'])}"
        elif kind == "missing":
            rule = "is required"
        elif kind == "extra_forbidden":
            rule = "is not a field here (a typo?)"
        elif kind == "value_error" and "error" in (err.get("ctx") or {}):
            rule = str(err["ctx"]["error"])
        else:
            rule = err["msg"][0].lower() + err["msg"][1:]
        found.append({"path": path, "message": rule})
    return found

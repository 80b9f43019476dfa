"""A framework's agent run as a chain of Keel steps: the one seam every integration goes through. An integration
registers an operation (:class:`StepChain`) with an adapter (:class:`Segment`) that runs the next piece of the
framework's run in each step (Pydantic AI one model request or tool call, LangGraph one super-step); the chain does the
rest the same way for every framework: the steps' keys, records and checkpoints, phase moves, approvals, :func:`send`,
charging and failures (docs/explanation/pydantic-ai.md#one-seam-for-every-framework)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from agents.core.commands import JobSpec, MessageSpec, Usage, check_json_text
from agents.core.errors import InvalidInput, InvalidJob, JobError
from agents.core.keys import derive, split_key
from agents.core.phases import Event, Phase
from agents.jobs.handlers import JobContext, JobResult, Registry, message_json, registry
from agents.runtime.inference import tool_call_key
from agents.runtime.loop import step_target
from agents.runtime.tools import ArgumentCheck, register_argument_check
from models.jobs_sql import request_steps, request_steps_by_key


class PromptInput(BaseModel):
    """The input of a framework agent's operation: the prompt, and whatever else the adapter reads (its deps)."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(min_length=1)


class NotReplayable(InvalidJob):
    """A step met something else than what was recorded at its place: the agent's code is not deterministic outside
    its model and tool calls (every durable engine requires it), or it changed between steps. Retrying cannot help:
    the step fails as ``invalid``."""


class NextStep(BaseException):
    """Raised by an adapter where the step ends and the next one begins (at a ``"model"`` request or a ``"tool"``
    call). Not an ``Exception``: a framework's own error hooks must not take it for a failure."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Held(BaseException):
    """Raised by an adapter at a call that waits for a person: the step ends, and a gate holds the call. ``at`` is
    where in the run it is held (the same on every replay): with ``call_id``, what a decision answers."""

    def __init__(self, tool: str, call_id: str, arguments: Mapping[str, Any], at: int) -> None:
        super().__init__(tool)
        self.tool, self.call_id, self.arguments, self.at = tool, call_id, dict(arguments), at


@dataclass(frozen=True, slots=True)
class Finished:
    """A run that ended: its answer (JSON) and its conversation (JSON), stored with the last step."""

    answer: Any
    conversation: Any = None


@dataclass
class StepState:
    """What one step of a run knows and records (the adapter reads and writes it)."""

    key: str
    operation: str
    number: int
    #: The request's input (a mapping with at least ``prompt``).
    given: Mapping[str, Any]
    #: An id of the run, the same in every step of the request.
    run_id: str
    #: What each earlier step of the run recorded, in order.
    records: list[Mapping[str, Any]]
    #: What this step records (JSON): an earlier attempt's checkpoint if there was one, else empty.
    record: dict[str, Any]
    #: Fields of earlier steps' results this step's makes redundant, dropped when it is recorded.
    drops: tuple[tuple[str, str], ...]
    #: People's decisions on held calls, by (where the run held the call, its id).
    decisions: Mapping[tuple[int, str], Mapping[str, Any]]
    #: The decision that scheduled this step (None: the step before scheduled it).
    decision: Mapping[str, Any] | None
    #: What this attempt spent; and of it, what is in paid work the step checkpointed (replayed, not bought again).
    usage: Usage = field(default_factory=Usage)
    checkpointed_usage: Usage = field(default_factory=Usage)
    #: Whether the step holds a paid call it checkpointed (however little it reported spending): a failure after it
    #: is ``invalid``, not retried (a retry would only replay it and fail alike).
    holds_paid: bool = False
    #: Messages to send with this step's outcome (:func:`send`; an adapter may collect them elsewhere and add them).
    sent: list[MessageSpec] = field(default_factory=list)
    #: Where :func:`send` puts messages now (None: not inside the framework's code).
    sending: list[MessageSpec] | None = None
    _checkpoint: Callable[[dict[str, Any]], None] = lambda record: None

    def checkpoint(self) -> None:
        """Store :attr:`record` on the job now (under its fencing token): a retry of this step starts from it."""
        self._checkpoint({"record": self.record})

    def spent(self, usage: Usage, *, checkpointed: bool) -> None:
        """Count ``usage`` to this step; ``checkpointed``: it paid for work the step has checkpointed."""
        self.usage = plus(self.usage, usage)
        if checkpointed:
            self.checkpointed_usage = plus(self.checkpointed_usage, usage)


class Segment(Protocol):
    """A framework's adapter: runs the next piece of the run in one Keel step."""

    async def run(self, state: StepState) -> Finished:
        """Run from the start or the last record, raise :class:`NextStep` or :class:`Held` where the step ends, or
        return how the run finished."""

    #: What a step reads of the steps before it: ``"all"`` their records (a run replayed from its start), or ``"last"``
    #: the previous one's alone (a run resumed from its latest checkpoint, which makes the earlier ones redundant:
    #: each step drops its predecessor's record when it is recorded, so a long run stores one).
    reads: str

    def classify(self, exc: Exception) -> JobError | None:
        """The framework's failure as Keel's retry policy sees it (a provider's 429 ``rate_limited`` …); None: not
        one of the framework's own (a JobError keeps its class, anything else is ``unknown``)."""


_current: ContextVar[StepState | None] = ContextVar("keel_integration_step", default=None)


def send(message: MessageSpec) -> None:
    """Inside an agent's tool (or graph node) while Keel runs it: send ``message`` (Slack or GitHub) through Keel's
    outbox. It leaves once the step is recorded, keyed from that step (``message.target`` names it within the step),
    so it is delivered once however often the step is retried or replayed; the relay reconciles with the receiver
    before any resend. Raises InvalidJob anywhere else."""
    state = _current.get()
    if state is None or state.sending is None:
        raise InvalidJob("send() is for an agent's tool while Keel runs it (a KeelAgent's, a KeelGraph's)")
    if not isinstance(message, MessageSpec):
        raise InvalidJob(f"send() takes a MessageSpec, got {type(message).__name__}")
    state.sending.append(message)


def plus(a: Usage, b: Usage) -> Usage:
    return Usage(a.tokens + b.tokens, a.cost + b.cost)


class StepChain:
    """Registers ``operation``: a request to it runs ``segment``'s framework run as Keel steps. ``check`` checks a
    person's edit of a held call's arguments (:data:`agents.runtime.tools.ArgumentCheck`)."""

    def __init__(
        self, operation: str, segment: Segment, *, check: ArgumentCheck | None = None, registry: Registry = registry
    ) -> None:
        JobSpec(operation, "1")  # the name must be able to be part of a key: refused here, naming the rule, if not
        self.operation = operation
        self.segment = segment
        self.reads_all = getattr(segment, "reads", "all") != "last"
        registry.register(operation, self.step, input=PromptInput)
        if check is not None:
            register_argument_check(operation, check)

    def step(self, ctx: JobContext) -> JobResult:
        """One step of the request's run."""
        number = int(ctx.target)
        previous = derive(ctx.key, self.operation, str(number - 1)) if number > 1 else None
        if self.reads_all:
            request_input, steps = request_steps(ctx.db, ctx.agent_id, ctx.request_id)
        else:  # the previous step only, by key (a read scoped to the agent, as every read of a request)
            request_input, found = request_steps_by_key(ctx.db, ctx.agent_id, ctx.request_id, [previous or ctx.key])
            steps = list(found.values())
        mine = {s["key"]: s for s in steps if s["operation"] == self.operation}
        given = request_input if isinstance(request_input, Mapping) else {"prompt": str(request_input)}
        state = StepState(
            key=ctx.key,
            operation=self.operation,
            number=number,
            given=given,
            run_id=f"{split_key(ctx.key)[0]}:{self.operation}",
            records=self._records(ctx.key, number, mine),
            drops=((previous, "record"),) if previous and not self.reads_all else (),
            record=dict((ctx.checkpointed or {}).get("record") or {}),
            decisions=_decisions(mine.values()),
            decision=_decision(ctx.payload),
            _checkpoint=ctx.checkpoint,
        )
        phase = self._phase_at(ctx.key, number, state.decision, mine)
        try:
            finished = asyncio.run(self._run(state))
        except NextStep as stop:
            following = Phase.EXECUTING if stop.kind == "tool" else Phase.PLANNING
            return self._result(state, stop.kind, _move(phase, following), (JobSpec(self.operation, str(number + 1)),))
        except Held as held:
            gate = self._gate(held, state)
            return self._result(state, "gate", _move(phase, Phase.EXECUTING), (gate,), held=held.call_id)
        except Exception as exc:
            raise self._failure(exc, state) from exc
        output = {"record": state.record, "answer": finished.answer, "messages": finished.conversation}
        try:
            check_json_text("the agent's answer", output)
        except InvalidInput as exc:
            raise InvalidJob(str(exc), usage=state.usage) from None
        return JobResult(
            output=output, usage=state.usage, event=Event.FINISH, messages=tuple(state.sent), drops=state.drops
        )

    async def _run(self, state: StepState) -> Finished:
        token = _current.set(state)
        try:
            return await self.segment.run(state)
        finally:
            _current.reset(token)

    def _gate(self, held: Held, state: StepState) -> JobSpec:
        """The gate that holds ``held`` for a person; a call that cannot be held (its arguments are not JSON, its
        names cannot be part of a key) fails the step as ``invalid``, charged with what it spent."""
        payload = {
            "arguments": held.arguments,
            "round": state.number,
            "call_id": held.call_id,
            "tool_call_id": held.call_id,
            "function": held.tool,
            "tool": held.tool,
            "resume": {"operation": self.operation, "step": state.number + 1, "at": held.at},
        }
        try:
            json.dumps(payload, allow_nan=False)  # what the gate's row will store
            check_json_text("the held call", payload)
            target = step_target(tool_call_key(held.tool), state.number, held.call_id)
            return JobSpec("gate", target, payload=payload)
        except (InvalidInput, TypeError, ValueError) as exc:
            why = f"the call to {held.tool!r} cannot be held for a person: {exc}"[:2000]
            raise InvalidJob(why, usage=state.usage) from None

    def _result(
        self, state: StepState, following: str, event: Event | None, jobs: tuple[JobSpec, ...], **extra: Any
    ) -> JobResult:
        output = {"record": state.record, "next": following, **extra}
        return JobResult(
            output=output, messages=tuple(state.sent), usage=state.usage, event=event, jobs=jobs, drops=state.drops
        )

    def _failure(self, exc: Exception, state: StepState) -> JobError:
        """The step's failure, charged exactly once (see the module's docstring)."""
        if state.holds_paid or state.checkpointed_usage:
            message = f"after paid work this step checkpointed: {type(exc).__name__}: {exc}"[:2000]
            return InvalidJob(message, usage=state.usage)
        found = self.segment.classify(exc)
        if found is None:
            found = exc if isinstance(exc, JobError) else JobError(f"{type(exc).__name__}: {exc}"[:2000])
        found.usage = state.usage  # what this attempt spent, charged with its failure
        return found

    def _records(self, key: str, number: int, mine: Mapping[str, Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        records: list[Mapping[str, Any]] = []
        for n in range(1 if self.reads_all else max(1, number - 1), number):
            step = mine.get(derive(key, self.operation, str(n)))
            result = None if step is None else step.get("result")
            if not isinstance(result, Mapping) or not isinstance(result.get("record"), Mapping):
                raise InvalidJob(f"step {n} of this run recorded nothing: the run cannot be replayed")
            records.append(result["record"])
        return records

    def _phase_at(
        self, key: str, number: int, decision: Mapping[str, Any] | None, mine: Mapping[str, Mapping[str, Any]]
    ) -> Phase:
        """The agent's phase as this step starts: planning before a model request, executing before a tool call
        (what the step before it, or the decision that scheduled it, moved it to)."""
        if decision is not None:
            return Phase.EXECUTING if decision.get("approved") else Phase.PLANNING
        if number == 1:
            return Phase.PLANNING
        before = mine.get(derive(key, self.operation, str(number - 1))) or {}
        said = (before.get("result") or {}).get("next")
        return Phase.EXECUTING if said == "tool" else Phase.PLANNING


def _decision(payload: Mapping[str, Any]) -> Mapping[str, Any] | None:
    found = payload.get("decision")
    return found if isinstance(found, Mapping) else None


def _decisions(steps: Any) -> dict[tuple[int, str], Mapping[str, Any]]:
    found: dict[tuple[int, str], Mapping[str, Any]] = {}
    for step in steps:
        decision = _decision(step.get("payload") or {})
        if decision is not None and isinstance(decision.get("at"), int):
            found[(int(decision["at"]), str(decision["tool_call_id"]))] = decision
    return found


def _move(now: Phase, to: Phase) -> Event | None:
    """The agent's move at the end of a step: to executing before a tool call (or a held one), to planning before a
    model request; None when it is there already."""
    if now is to:
        return None
    return Event.PLAN if to is Phase.EXECUTING else Event.OBSERVE


def messages_json(messages: list[MessageSpec]) -> list[dict[str, Any]]:
    return [message_json(m) for m in messages]


def messages_from(data: Any) -> list[MessageSpec]:
    return [MessageSpec(**m) for m in data or ()]

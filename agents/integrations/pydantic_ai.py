"""A Pydantic AI agent run as Keel steps, the agent unchanged (``keel[pydantic-ai]``).

::

    support = Agent("openai:gpt-4o-mini", instructions="…", tools=[lookup_order])   # the team's agent, as it is
    KeelAgent(support, name="support")                                               # registers operation "support"

A request to operation ``support`` (input ``{"prompt": "…"}``) runs the agent through Pydantic AI's public durable
execution seam (``pydantic_ai.durable_exec``: a durability capability given to each run, and its operation backend).
Every durable unit Pydantic AI dispatches (a model request, a tool call, a tool listing, an argument check) gets the
next ordinal of the request's run, and its result is recorded, as JSON, in the Keel step that ran it. A step runs the
agent from its start: each unit already recorded returns what was recorded (nothing is asked or run again), the first
unit not yet recorded runs, and at the next model request or tool call after it the step ends, scheduling the next
step (``{request}:support:{n+1}``, keyed from its own key). So each model request and each tool call is one Keel step:
deadlines, budgets, cancellation and the journal apply between them as between Keel's own plan and tool steps.

What a step spends is charged once: the usage of the model requests it ran (not of those it replayed) is its
outcome's usage. A model reply or tool result is checkpointed on the job as soon as it exists, so a step retried after
a crash replays it instead of asking or running again (what is paid for is paid once). A unit may still run twice if
the process dies between its effect and that checkpoint (a tool that acted, a model that answered): tools that act on
the world should be idempotent, or declare their effects through Keel's outbox.

A call of a tool named in ``approve`` (or marked ``requires_approval=True``) is held before it runs: the step hands it
to Keel's ``gate`` (the agent waits in ``waiting_approval``, its call listed with Keel's own), and a person's decision
(approve, approve with edited arguments, reject with a reason) schedules the next step, which answers the held call
with it. Not supported (refused with a clear error, or documented): streaming, tools executed outside the agent,
toolsets added at run time (Pydantic AI refuses them inside a durable run). Deps are rebuilt for every step from the
request's input by the ``deps`` function given (they are never serialised).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agents.core.commands import JobSpec, MessageSpec, Usage, check_json_text
from agents.core.errors import InvalidInput, InvalidJob, JobError, RateLimited, TransientError
from agents.core.keys import derive, split_key
from agents.core.phases import Event, Phase
from agents.jobs.handlers import JobContext, JobResult, Registry, describe, message_json, registry
from agents.runtime.loop import edit_summary, step_target
from agents.runtime.tools import register_argument_check
from models.jobs_sql import request_steps

try:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.durable_exec import (
        JSON_CODEC,
        BaseDurabilityCapability,
        DurabilityEngineSpec,
        DurableOperationBackend,
        DurableOperationId,
        JournalCallableOperationBackend,
        ModelCompactMessagesId,
        ModelCountTokensId,
        ModelRequestId,
        RoleBasedOperationConfig,
        ToolsetCallToolId,
        conversation_id_from_run_id,
        model_error_retry_after,
        record_durable_unit,
    )
    from pydantic_ai.exceptions import (
        ApprovalRequired,
        ModelAPIError,
        ModelHTTPError,
        ModelRateLimitError,
        UnexpectedModelBehavior,
        UsageLimitExceeded,
        UserError,
    )
    from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelResponse, ToolCallPart
    from pydantic_ai.tools import (
        DeferredToolRequests,
        DeferredToolResults,
        Tool,
        ToolApproved,
        ToolDefinition,
        ToolDenied,
    )
    from pydantic_ai.toolsets import FunctionToolset
except ImportError as exc:  # pragma: no cover - the extra is installed wherever the tests run
    raise ImportError("Keel's Pydantic AI integration needs its extra: pip install 'keel[pydantic-ai]'") from exc

#: The longest a provider's Retry-After is honoured before the step is retried anyway (seconds).
MAX_RETRY_AFTER_SECONDS = 3600.0


class PromptInput(BaseModel):
    """The input of a Pydantic AI agent's operation: the user prompt, and whatever else its ``deps`` function reads."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(min_length=1)


class NotReplayable(InvalidJob):
    """A step asked for a different unit than the one recorded at its place: the agent is not deterministic outside
    its model requests and tool calls (Pydantic AI's requirement for durable runs), or it changed between steps.
    Retrying cannot help: the step fails as ``invalid``."""


class _NextStep(BaseException):
    """Raised inside the run at the first model request or tool call after the one this step ran: the step ends.
    Not an ``Exception``: a capability's tool-error hook (``on_tool_execute_error``) must not take it for a failure."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class _AwaitApproval(BaseException):
    """Raised inside the run at a tool call that waits for a person: the step ends, and a gate holds the call.
    ``at`` is where in the run it is held (the number of units met before it): with the call's id, what a decision
    answers (a provider may reuse a call id in a later reply)."""

    def __init__(self, call: ToolCallPart, at: int) -> None:
        super().__init__(call.tool_name)
        self.call = call
        self.at = at


@dataclass
class _Run:
    """One step's view of the request's run: what earlier steps recorded, what this step records."""

    run_id: str
    recorded: list[Mapping[str, Any]]
    #: Units this step ran (and, after a retry, those its earlier attempt checkpointed): its result.
    ran: list[dict[str, Any]] = field(default_factory=list)
    next_unit: int = 0
    #: "model" or "tool": the kind of the one model request or tool call this step ran (None: none yet).
    ran_kind: str | None = None
    usage: Usage = field(default_factory=Usage)
    checkpoint: Callable[[list[dict[str, Any]]], None] = lambda ran: None
    cost: Callable[[ModelResponse], Decimal] | None = None
    #: People's decisions on held calls, by (where the run held the call, its id), as the steps they resumed carry them.
    decisions: Mapping[tuple[int, str], Mapping[str, Any]] = field(default_factory=dict)
    #: What the model is told about calls a person approved with edited arguments, by call id, until they run.
    edited: dict[str, str] = field(default_factory=dict)
    #: What the tool running now asked to :func:`send` (None: no tool of this step is running).
    sending: list[MessageSpec] | None = None


_current: ContextVar[_Run | None] = ContextVar("keel_pydantic_ai_run", default=None)


def _kind(operation_id: DurableOperationId) -> str | None:
    """A step's kind of unit: a call to the model (a request, a compaction of the history, a count of tokens: each
    may be paid for), or a tool call; None for the cheap ones a step runs along the way."""
    if isinstance(operation_id, ModelRequestId | ModelCompactMessagesId | ModelCountTokensId):
        return "model"
    if isinstance(operation_id, ToolsetCallToolId):
        return "tool"
    return None


class _Backend(JournalCallableOperationBackend[None]):
    async def execute(
        self,
        *,
        operation_id: DurableOperationId,
        name: str,
        body: Callable[[], Awaitable[object]],
        cache_key: tuple[object, ...],
        config: None,
    ) -> object:
        run = _current.get()
        if run is None:  # outside a Keel step (the agent run on its own): not durable
            return await body()
        ordinal = run.next_unit  # taken before any await: units are numbered in the order the run meets them
        run.next_unit += 1
        kind = _kind(operation_id)
        known = run.recorded[ordinal] if ordinal < len(run.recorded) else None
        if known is not None:
            if known.get("name") != name:
                raise NotReplayable(
                    f"unit {ordinal} of the run was {known.get('name')!r} when recorded, and is {name!r} now"
                )
            record_durable_unit(executed=False)
            return known["result"]
        if kind is not None and run.ran_kind is not None:
            raise _NextStep(kind)  # this step ran its model request or tool call: the next one is the next step's
        if kind == "tool":
            run.sending = []
        try:
            result = await body()
        finally:
            sent, run.sending = run.sending or [], None
        unit: dict[str, Any] = {"name": name, "result": result}
        if sent:  # recorded with the tool's result: a retry of this step replays them with it, under the same keys
            unit["messages"] = [message_json(m) for m in sent]
        if kind is not None:
            unit["kind"] = kind
            run.ran_kind = kind
        run.ran.append(unit)
        run.recorded.append(unit)
        record_durable_unit(executed=True)
        if kind is not None:
            # Paid for, or done: a retry of this step replays it instead of asking (or running) again. Checkpointed
            # before anything else can fail.
            run.checkpoint(run.ran)
        if kind == "model":
            run.usage = _plus(run.usage, _usage(result, run.cost))
        return result


def _plus(a: Usage, b: Usage) -> Usage:
    return Usage(a.tokens + b.tokens, a.cost + b.cost)


_RESPONSE: TypeAdapter[ModelResponse] = TypeAdapter(ModelResponse)


def _usage(result: object, cost: Callable[[ModelResponse], Decimal] | None) -> Usage:
    """What a recorded call to the model spent: its tokens, and for a response, its cost if ``cost`` prices it. A
    ``cost`` that fails is the step's failure (``invalid``), its tokens still charged."""
    data: Mapping[str, Any] = result if isinstance(result, Mapping) else {}
    found = data.get("usage")
    usage: Mapping[str, Any] = found if isinstance(found, Mapping) else data  # a count of tokens is a usage itself
    tokens = int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)
    if cost is None or data.get("kind") != "response":
        return Usage(tokens)
    try:
        price = Decimal(cost(_RESPONSE.validate_python(data)))
        return Usage(tokens, price)
    except Exception as exc:  # the user's pricing function: whatever it raises
        why = f"cost= could not price the model's response: {type(exc).__name__}: {exc}"
        raise _Priced(Usage(tokens), why) from exc


class _Priced(Exception):
    """The ``cost`` function failed on a response already checkpointed: its tokens are charged with the failure."""

    def __init__(self, usage: Usage, message: str) -> None:
        super().__init__(message)
        self.usage = usage


def send(message: MessageSpec) -> None:
    """Inside a tool of a :class:`KeelAgent`'s agent: send ``message`` (Slack or GitHub) through Keel's outbox. It
    leaves once the step that ran the tool is recorded, keyed from that step (``message.target`` names it within
    the step), so it is delivered once however often the step is retried or the tool's result replayed; the relay
    reconciles with the receiver before any resend. Raises InvalidJob outside such a tool."""
    run = _current.get()
    if run is None or run.sending is None:
        raise InvalidJob("send() is for a tool of a KeelAgent's agent, while Keel runs it")
    if not isinstance(message, MessageSpec):
        raise InvalidJob(f"send() takes a MessageSpec, got {type(message).__name__}")
    run.sending.append(message)


class KeelDurability(BaseDurabilityCapability[Any]):
    """Pydantic AI's durability capability for Keel: given to each run of a :class:`KeelAgent`'s agent."""

    engine_spec = DurabilityEngineSpec(
        engine_name="Keel",
        durable_unit_noun="unit",
        durable_container_noun="Keel request",
        codec=JSON_CODEC,
        serialization_failure=lambda e: UserError(f"a value Keel cannot store as JSON: {e}"),
        wrapped_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        toolset_lifecycles={"function": "enter-always", "mcp": "enter-in-durable-unit", "dynamic": "enter-never"},
        unsupported_runtime_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        tool_call_result_upgrade_lenient=False,
        journal_discovery=True,
        # One tool call per step, in the order the model made them: units keep their numbers on every replay.
        sequential_tools_in_durable_context=True,
        tool_config_key=None,
        nondeterminism_error_types=(NotReplayable,),
    )

    @property
    def in_durable_context(self) -> bool:
        return _current.get() is not None

    def get_durable_operation_backend(self) -> DurableOperationBackend[Any]:
        return _Backend(
            agent_name=self.name,
            default_model_id=self.default_model_id,
            config=RoleBasedOperationConfig(model=None, event=None, capability=None, tool=None),
        )

    def get_default_run_id(self) -> str | None:
        run = _current.get()
        return None if run is None else run.run_id

    def get_default_conversation_id(self, run_id: str) -> str | None:
        return conversation_id_from_run_id(run_id) if self.in_durable_context else None


@dataclass
class _KeelApprovals(AbstractCapability[Any]):
    """Holds a call to a tool named in ``approve`` for a person (before the tool runs), and answers each held call
    (these and Pydantic AI's ``requires_approval`` tools') with the decision a person made in Keel, if one was made;
    if not, the run stops there and the step hands the call to a gate (``waiting_approval``)."""

    approve: frozenset[str] = frozenset()

    async def after_tool_execute(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any, result: Any
    ) -> Any:
        run = _current.get()
        summary = None if run is None else run.edited.pop(call.tool_call_id, None)
        if summary is not None and isinstance(result, str):
            return f"{summary}\n{result}"
        return result

    async def before_tool_execute(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any
    ) -> Any:
        if call.tool_name in self.approve and not ctx.tool_call_approved and _current.get() is not None:
            raise ApprovalRequired()
        return args

    async def handle_deferred_tool_calls(
        self, ctx: RunContext[Any], *, requests: DeferredToolRequests
    ) -> DeferredToolResults | None:
        run = _current.get()
        if run is None:
            return None
        if requests.calls:
            names = ", ".join(sorted({c.tool_name for c in requests.calls}))
            raise InvalidJob(f"tools executed outside the agent ({names}) are not supported on Keel")
        answers: dict[str, bool | ToolApproved | ToolDenied] = {}
        at = run.next_unit  # the same on every replay: the units met before this point are the same
        for call in requests.approvals:
            decision = run.decisions.get((at, call.tool_call_id))
            if decision is None:
                raise _AwaitApproval(call, at)
            if not decision.get("approved"):
                answers[call.tool_call_id] = ToolDenied(str(decision.get("reason") or "A person rejected this call."))
            elif isinstance(decision.get("arguments"), Mapping):
                answers[call.tool_call_id] = ToolApproved(override_args=dict(decision["arguments"]))
                edited_from = decision.get("edited_from")
                if isinstance(edited_from, Mapping):  # the model must know it was not its own call that ran
                    run.edited[call.tool_call_id] = edit_summary(edited_from, decision["arguments"])
            else:
                answers[call.tool_call_id] = True
        return DeferredToolResults(approvals=answers)


class KeelAgent:
    """Register a Pydantic AI ``agent`` with Keel as operation ``name``: a request to it runs the agent, each model
    request and each tool call one Keel step. ``deps`` builds the run's dependencies from the request's input (called
    in every step: deterministic, no I/O); ``cost`` prices a model response (default: tokens only, no cost);
    ``registry`` is the worker's (``@handler``'s) unless given."""

    def __init__(
        self,
        agent: Agent[Any, Any],
        *,
        name: str,
        deps: Callable[[Mapping[str, Any]], Any] | None = None,
        cost: Callable[[ModelResponse], Decimal] | None = None,
        approve: tuple[str, ...] | list[str] = (),
        registry: Registry = registry,
    ) -> None:
        JobSpec(name, "1")  # the name must be able to be part of a key: refused here, naming the rule, if not
        self.tools = _function_tools(agent)
        unknown = sorted(set(approve) - set(self.tools))
        if unknown:
            known = ", ".join(sorted(self.tools)) or "none"
            raise InvalidInput(f"KeelAgent {name!r}: approve names no tool of the agent: {unknown} (tools: {known})")
        self.agent = agent
        self.name = name
        self.deps = deps
        self.cost = cost
        self.durability = KeelDurability(name=agent.name or name)
        self.approvals = _KeelApprovals(frozenset(approve))
        registry.register(name, self.step, input=PromptInput)
        register_argument_check(name, self.check_arguments)

    def check_arguments(self, tool_name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A person's edit of a held call's arguments, as the tool will check them (else InvalidJob naming why)."""
        tool = self.tools.get(tool_name)
        if tool is None:
            raise InvalidJob(f"the agent has no tool named {tool_name!r}")
        try:
            tool.function_schema.validator.validate_python(dict(arguments))
        except ValidationError as exc:
            raise InvalidJob(f"{tool_name}: {describe(exc, 'arguments')}") from None
        return dict(arguments)

    def step(self, ctx: JobContext) -> JobResult:
        """One step of the request's run: replay what earlier steps recorded, run the next unit, stop at the next."""
        number = int(ctx.target)
        request_input, steps = request_steps(ctx.db, ctx.agent_id, ctx.request_id)
        recorded = self._recorded(ctx.key, number, steps)
        ran = list((ctx.checkpointed or {}).get("units") or [])  # an earlier attempt of this step got these
        run = _Run(
            run_id=f"{split_key(ctx.key)[0]}:{self.name}",
            recorded=[*recorded, *ran],
            ran=ran,
            cost=self.cost,
            checkpoint=lambda units: ctx.checkpoint({"units": units}),
        )
        run.ran_kind = next((u["kind"] for u in ran if u.get("kind")), None)
        mine = [st for st in steps if st["operation"] == self.name]
        run.decisions = {
            (int(d["at"]), str(d["tool_call_id"])): d
            for st in mine
            if isinstance(d := (st.get("payload") or {}).get("decision"), Mapping) and isinstance(d.get("at"), int)
        }
        phase = self._phase_at(ctx, number, mine)
        for unit in ran:
            if unit.get("kind") == "model":
                run.usage = _plus(run.usage, _usage(unit["result"], self.cost))
        given = request_input if isinstance(request_input, Mapping) else {"prompt": str(request_input)}
        try:
            output, messages = asyncio.run(self._run(run, given))
        except _NextStep as stop:
            following = Phase.EXECUTING if stop.kind == "tool" else Phase.PLANNING
            return JobResult(
                output={"units": run.ran, "next": stop.kind},
                messages=_messages(run.ran),
                usage=run.usage,
                event=_move(phase, following),
                jobs=(JobSpec(self.name, str(number + 1)),),
            )
        except _AwaitApproval as held:
            call = held.call
            payload = {
                "arguments": call.args_as_dict(),
                "round": number,
                "call_id": call.tool_call_id,
                "tool_call_id": call.tool_call_id,
                "function": call.tool_name,
                "tool": call.tool_name,
                "resume": {"operation": self.name, "step": number + 1, "at": held.at},
            }
            gate = JobSpec("gate", step_target(call.tool_name, number, call.tool_call_id), payload=payload)
            return JobResult(
                output={"units": run.ran, "next": "gate", "held": call.tool_call_id},
                messages=_messages(run.ran),
                usage=run.usage,
                event=_move(phase, Phase.EXECUTING),
                jobs=(gate,),
            )
        except Exception as exc:
            raise _failure(exc, run) from exc
        answer = output.model_dump(mode="json") if isinstance(output, BaseModel) else output
        if isinstance(output, DeferredToolRequests):  # unanswered calls the agent's output type lets through
            raise InvalidJob("the agent's run ended with tool calls no one answered", usage=run.usage)
        result = {"units": run.ran, "answer": answer, "messages": messages}
        try:
            check_json_text("the agent's answer", result)
        except InvalidInput as exc:
            raise InvalidJob(str(exc), usage=run.usage) from None
        return JobResult(output=result, usage=run.usage, event=Event.FINISH, messages=_messages(run.ran))

    async def _run(self, run: _Run, given: Mapping[str, Any]) -> tuple[Any, Any]:
        token = _current.set(run)
        try:
            deps = self.deps(given) if self.deps is not None else None
            result = await self.agent.run(
                str(given["prompt"]), deps=deps, capabilities=[self.durability, self.approvals]
            )
        finally:
            _current.reset(token)
        return result.output, ModelMessagesTypeAdapter.dump_python(result.all_messages(), mode="json")

    def _phase_at(self, ctx: JobContext, number: int, mine: list[dict[str, Any]]) -> Phase:
        """The agent's phase as this step starts: planning before a model request, executing before a tool call
        (what the step before it, or the decision that scheduled it, moved it to)."""
        decision = ctx.payload.get("decision")
        if isinstance(decision, Mapping):
            return Phase.EXECUTING if decision.get("approved") else Phase.PLANNING
        if number == 1:
            return Phase.PLANNING
        before = next((st for st in mine if st["key"] == derive(ctx.key, self.name, str(number - 1))), None)
        said = ((before or {}).get("result") or {}).get("next")
        return Phase.EXECUTING if said == "tool" else Phase.PLANNING

    def _recorded(self, key: str, number: int, steps: list[dict[str, Any]]) -> list[Mapping[str, Any]]:
        """The units the request's earlier steps of this agent recorded, in order; a step missing one is a bug."""
        units: list[Mapping[str, Any]] = []
        by_key = {s["key"]: s for s in steps}
        for n in range(1, number):
            step = by_key.get(derive(key, self.name, str(n)))
            result = None if step is None else step.get("result")
            if not isinstance(result, Mapping) or not isinstance(result.get("units"), list):
                raise InvalidJob(f"step {n} of this run recorded no units: the run cannot be replayed")
            units.extend(result["units"])
        return units


def _messages(units: list[dict[str, Any]]) -> tuple[MessageSpec, ...]:
    """The messages the tools this step ran sent (:func:`send`), as their units recorded them."""
    return tuple(MessageSpec(**m) for unit in units for m in unit.get("messages") or ())


def _move(now: Phase, to: Phase) -> Event | None:
    """The agent's move at the end of a step: to executing before a tool call (or a held one), to planning before a
    model request; None when it is there already."""
    if now is to:
        return None
    return Event.PLAN if to is Phase.EXECUTING else Event.OBSERVE


def _function_tools(agent: Agent[Any, Any]) -> dict[str, Tool[Any]]:
    """The agent's own function tools by name (what ``approve`` may name, and what checks an edit's arguments)."""
    found: dict[str, Tool[Any]] = {}
    for toolset in agent.toolsets:
        if isinstance(toolset, FunctionToolset):
            found.update(toolset.tools)
    return found


def _failure(exc: Exception, run: _Run) -> JobError:
    """A failure of the step as Keel's retry policy sees it, charged exactly once.

    A step that already holds a paid call to the model (checkpointed) fails as ``invalid``, charged with what it
    spent: retried, it would replay that call and fail the same way, and a retry that ran out would leave the spend
    uncharged. Otherwise nothing was paid, and the failure is classified: a provider's 429 is ``rate_limited`` with
    its Retry-After; its 5xx, timeouts and dropped connections ``transient``; a Keel tool's own JobError keeps its
    class; Pydantic AI's usage limits and refusals, a model that broke its contract, a run that is not replayable,
    ``invalid``; anything else ``unknown`` (retried, like a worker that died)."""
    if isinstance(exc, _Priced):
        return InvalidJob(str(exc)[:2000], usage=_plus(run.usage, exc.usage))
    if run.usage:
        return InvalidJob(f"after a paid call to the model: {type(exc).__name__}: {exc}"[:2000], usage=run.usage)
    if isinstance(exc, JobError):
        exc.usage = Usage()
        return exc
    if isinstance(exc, ModelAPIError | UnexpectedModelBehavior | NotReplayable | UserError | UsageLimitExceeded):
        return _classified(exc, Usage())
    return JobError(f"{type(exc).__name__}: {exc}"[:2000])


def _classified(exc: Exception, usage: Usage) -> JobError:
    """A failure of a Pydantic AI run as Keel's retry policy sees it: a provider's 429 is ``rate_limited`` with its
    Retry-After; its 5xx, timeouts and dropped connections ``transient``; the rest ``invalid``."""
    message = f"{type(exc).__name__}: {exc}"[:2000]
    if isinstance(exc, ModelRateLimitError) or (isinstance(exc, ModelHTTPError) and exc.status_code == 429):
        after = model_error_retry_after(exc, maximum=MAX_RETRY_AFTER_SECONDS)
        return RateLimited(message, usage=usage, retry_after=after)
    if isinstance(exc, ModelHTTPError) and exc.status_code < 500 and exc.status_code not in (408, 409):
        return InvalidJob(message, usage=usage)
    if isinstance(exc, ModelAPIError):
        return TransientError(message, usage=usage)
    return InvalidJob(message, usage=usage)

"""A Pydantic AI agent run as Keel steps, the agent unchanged (``keel[pydantic-ai]``): ``KeelAgent(support,
name="support")`` registers operation ``support``, which runs the agent through Pydantic AI's public durable execution
seam (``pydantic_ai.durable_exec``), one model request or tool call per Keel step, so deadlines, budgets, cancellation,
approvals and the journal apply between them as between Keel's own plan and tool steps. This module is Pydantic AI's
adapter to Keel's one seam for every framework (:mod:`agents.integrations.steps`); how a run becomes steps and what
holds where: docs/explanation/pydantic-ai.md#how-a-run-becomes-keel-steps."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from agents.core.commands import Usage
from agents.core.errors import InvalidInput, InvalidJob, JobError, RateLimited, TransientError
from agents.integrations import steps
from agents.integrations.steps import Finished, Held, NextStep, NotReplayable, PromptInput, StepChain, StepState
from agents.jobs.handlers import Registry, describe, registry
from agents.runtime import conversations
from agents.runtime.loop import edit_summary

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

__all__ = ["KeelAgent", "KeelDurability", "NotReplayable", "PromptInput", "send"]

#: The longest a provider's Retry-After is honoured before the step is retried anyway (seconds).
MAX_RETRY_AFTER_SECONDS = 3600.0

#: Inside a tool of a KeelAgent's agent: send a Slack or GitHub message through Keel's outbox (:func:`steps.send`).
send = steps.send


@dataclass
class _Units:
    """One step's view of the run's durable units: what earlier steps recorded, what this step ran."""

    state: StepState
    recorded: list[Mapping[str, Any]]
    #: Units this step ran (and, after a retry, those its earlier attempt checkpointed): its record's ``units``.
    ran: list[dict[str, Any]]
    cost: Callable[[ModelResponse], Decimal] | None
    next_unit: int = 0
    #: "model" or "tool": the kind of the one model call or tool call this step ran (None: none yet).
    ran_kind: str | None = None
    #: What the model is told about calls a person approved with edited arguments, by call id, until they run.
    edited: dict[str, str] = field(default_factory=dict)


_units: ContextVar[_Units | None] = ContextVar("keel_pydantic_ai_units", default=None)


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
        run = _units.get()
        if run is None:  # outside a Keel step (the agent run on its own): not durable
            return await body()
        state = run.state
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
            raise NextStep(kind)  # this step ran its model call or tool call: the next one is the next step's
        if kind == "tool":
            state.sending = []
        try:
            result = await body()
        finally:
            sent, state.sending = state.sending or [], None
        unit: dict[str, Any] = {"name": name, "result": result}
        if sent:  # recorded with the tool's result: a retry of this step replays them with it, under the same keys
            unit["messages"] = steps.messages_json(sent)
            state.sent.extend(sent)
        if kind is not None:
            unit["kind"] = kind
            run.ran_kind = kind
        run.ran.append(unit)
        run.recorded.append(unit)
        record_durable_unit(executed=True)
        if kind is not None:
            # Paid for, or done: a retry of this step replays it instead of asking (or running) again. Checkpointed
            # before anything else can fail.
            state.checkpoint()
        if kind == "model":
            state.holds_paid = True
            state.spent(_usage(result, run.cost, state), checkpointed=True)
        return result


_RESPONSE: TypeAdapter[ModelResponse] = TypeAdapter(ModelResponse)


def _usage(result: object, cost: Callable[[ModelResponse], Decimal] | None, state: StepState | None = None) -> Usage:
    """What a recorded call to the model spent: its tokens, and for a response, its cost if ``cost`` prices it. A
    ``cost`` that fails fails the step (``invalid``), its tokens still charged (counted to ``state`` first)."""
    data: Mapping[str, Any] = result if isinstance(result, Mapping) else {}
    found = data.get("usage")
    usage: Mapping[str, Any] = found if isinstance(found, Mapping) else data  # a count of tokens is a usage itself
    tokens = int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)
    if cost is None or data.get("kind") != "response":
        return Usage(tokens)
    try:
        return Usage(tokens, Decimal(cost(_RESPONSE.validate_python(data))))
    except Exception as exc:  # the user's pricing function: whatever it raises
        if state is not None:
            state.spent(Usage(tokens), checkpointed=True)
        raise _Priced(f"cost= could not price the model's response: {type(exc).__name__}: {exc}") from exc


class _Priced(Exception):
    """The ``cost`` function failed on a response already checkpointed (its tokens are counted to the step)."""


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
        return _units.get() is not None

    def get_durable_operation_backend(self) -> DurableOperationBackend[Any]:
        return _Backend(
            agent_name=self.name,
            default_model_id=self.default_model_id,
            config=RoleBasedOperationConfig(model=None, event=None, capability=None, tool=None),
        )

    def get_default_run_id(self) -> str | None:
        run = _units.get()
        return None if run is None else run.state.run_id

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
        run = _units.get()
        summary = None if run is None else run.edited.pop(call.tool_call_id, None)
        if summary is not None and isinstance(result, str):
            return f"{summary}\n{result}"
        return result

    async def before_tool_execute(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: ToolDefinition, args: Any
    ) -> Any:
        if call.tool_name in self.approve and not ctx.tool_call_approved and _units.get() is not None:
            raise ApprovalRequired()
        return args

    async def handle_deferred_tool_calls(
        self, ctx: RunContext[Any], *, requests: DeferredToolRequests
    ) -> DeferredToolResults | None:
        run = _units.get()
        if run is None:
            return None
        if requests.calls:
            names = ", ".join(sorted({c.tool_name for c in requests.calls}))
            raise InvalidJob(f"tools executed outside the agent ({names}) are not supported on Keel")
        answers: dict[str, bool | ToolApproved | ToolDenied] = {}
        at = run.next_unit  # the same on every replay: the units met before this point are the same
        for call in requests.approvals:
            decision = run.state.decisions.get((at, call.tool_call_id))
            if decision is None:
                raise Held(call.tool_name, call.tool_call_id, call.args_as_dict(), at)
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
    request and each tool call one Keel step. ``approve`` names tools whose calls wait for a person; ``deps`` builds
    the run's dependencies from the request's input (called in every step: deterministic, no I/O); ``cost`` prices a
    model response (default: tokens only, no cost); ``registry`` is the worker's (``@handler``'s) unless given."""

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
        self.chain = StepChain(name, self, check=self.check_arguments, registry=registry)

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

    #: A step replays the run from its start: it reads every earlier step's units.
    reads = "all"

    async def run(self, state: StepState) -> Finished:
        """The run from its start: recorded units replayed, the next one run, the step ended at the one after."""
        recorded = [u for record in state.records for u in record.get("units") or ()]
        ran: list[dict[str, Any]] = list(state.record.get("units") or [])  # an earlier attempt checkpointed these
        state.record["units"] = ran
        run = _Units(state, [*recorded, *ran], ran, self.cost)
        for unit in ran:
            run.ran_kind = run.ran_kind or unit.get("kind")
            if unit.get("kind") == "model":  # (a cost= that fails on it counts its tokens first, then fails the step)
                state.holds_paid = True
                state.spent(_usage(unit["result"], self.cost, state), checkpointed=True)
            state.sent.extend(steps.messages_from(unit.get("messages")))
        token = _units.set(run)
        try:
            deps = self.deps(state.given) if self.deps is not None else None
            capabilities = [self.durability, self.approvals]
            result = await self.agent.run(str(state.given["prompt"]), deps=deps, capabilities=capabilities)
        finally:
            _units.reset(token)
        if isinstance(result.output, DeferredToolRequests):  # unanswered calls the agent's output type lets through
            raise InvalidJob("the agent's run ended with tool calls no one answered")
        answer = result.output.model_dump(mode="json") if isinstance(result.output, BaseModel) else result.output
        return Finished(answer, ModelMessagesTypeAdapter.dump_python(result.all_messages(), mode="json"))

    def classify(self, exc: Exception) -> JobError | None:
        """Pydantic AI's failures: a provider's 429 ``rate_limited`` with its Retry-After; its 5xx, timeouts and
        dropped connections ``transient``; other 4xx, usage limits, a model that broke its contract ``invalid``."""
        if not isinstance(exc, ModelAPIError | UnexpectedModelBehavior | UserError | UsageLimitExceeded | _Priced):
            return None
        message = f"{type(exc).__name__}: {exc}"[:2000]
        if isinstance(exc, ModelRateLimitError) or (isinstance(exc, ModelHTTPError) and exc.status_code == 429):
            return RateLimited(message, retry_after=model_error_retry_after(exc, maximum=MAX_RETRY_AFTER_SECONDS))
        if isinstance(exc, ModelHTTPError) and exc.status_code < 500 and exc.status_code not in (408, 409):
            return InvalidJob(message)
        if isinstance(exc, ModelAPIError):
            return TransientError(message)
        return InvalidJob(message)


def _conversation(request_input: Any, taken: list[Mapping[str, Any]]) -> list[conversations.Message]:
    """A Pydantic AI run's conversation from its steps' units: each model reply (its text, reasoning, calls) and each
    tool's result, in the order the run met them."""
    messages: list[conversations.Message] = [{"role": "user", "content": conversations.prompt_of(request_input)}]
    for step in taken:
        for unit in step["result"]["record"].get("units") or ():
            result = unit.get("result")
            if unit.get("kind") == "model" and isinstance(result, Mapping) and result.get("kind") == "response":
                said: conversations.Message = {"role": "assistant", "content": ""}
                text, reasoning, calls = [], [], []
                for part in result.get("parts") or ():
                    if part.get("part_kind") == "text":
                        text.append(str(part.get("content") or ""))
                    elif part.get("part_kind") == "thinking":
                        reasoning.append(str(part.get("content") or ""))
                    elif part.get("part_kind") == "tool-call":
                        arguments = conversations.arguments_of(part.get("args"))
                        calls.append({"tool": part.get("tool_name"), "arguments": arguments})
                said["content"] = "\n".join(text)
                if reasoning:
                    said["reasoning"] = "\n".join(reasoning)
                if calls:
                    said["calls"] = calls
                messages.append(said)
            elif unit.get("kind") == "tool":
                returned = result.get("result") if isinstance(result, Mapping) and "result" in result else result
                messages.append({"role": "tool", "content": conversations.text_of(returned)})
    return messages


conversations.register_reader("units", _conversation)


def _function_tools(agent: Agent[Any, Any]) -> dict[str, Tool[Any]]:
    """The agent's own function tools by name (what ``approve`` may name, and what checks an edit's arguments)."""
    found: dict[str, Tool[Any]] = {}
    for toolset in agent.toolsets:
        if isinstance(toolset, FunctionToolset):
            found.update(toolset.tools)
    return found

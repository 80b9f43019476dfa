"""A LangGraph graph run as Keel steps, the graph unchanged (``keel[langgraph]``): ``KeelGraph(builder,
name="support")`` registers operation ``support``, which runs the graph one super-step per Keel step through
LangGraph's public checkpointer seam, so a retried step resumes from the checkpoint recorded with the step before and
never runs a finished super-step again. This module is LangGraph's adapter to Keel's one seam for every framework
(:mod:`agents.integrations.steps`); what a run does (charging, ``interrupt()`` as an approval, phases, :func:`send`):
docs/how-to/langgraph.md#what-happens."""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Mapping
from typing import Any

from agents.core.commands import MessageSpec, Usage
from agents.core.errors import InvalidJob, JobError, RateLimited, TransientError
from agents.integrations import steps
from agents.integrations.steps import Finished, Held, NextStep, StepChain, StepState
from agents.jobs.handlers import Registry, registry
from agents.runtime import conversations
from agents.runtime.tools import ArgumentCheck

try:
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import BaseMessage, messages_to_dict
    from langchain_core.outputs import LLMResult
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.base import CheckpointTuple
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.config import get_config
    from langgraph.errors import EmptyInputError, GraphRecursionError, InvalidUpdateError
    from langgraph.graph import StateGraph
    from langgraph.types import Command
except ImportError as exc:  # pragma: no cover - the extra is installed wherever the tests run
    raise ImportError("Keel's LangGraph integration needs its extra: pip install 'keel[langgraph]'") from exc

__all__ = ["KeelGraph", "send"]

#: Inside a node or tool of a KeelGraph's graph: send a Slack or GitHub message through Keel's outbox.
send = steps.send

#: The channel of an interrupted task's pending write (what LangGraph's public ``interrupt()`` leaves behind).
INTERRUPT = "__interrupt__"

#: The longest a provider's Retry-After is honoured before the step is retried anyway (seconds).
MAX_RETRY_AFTER_SECONDS = 3600.0


def _prompt_input(given: Mapping[str, Any]) -> dict[str, Any]:
    return {"messages": [("user", str(given["prompt"]))]}


def _last_message(values: Mapping[str, Any]) -> Any:
    messages = values.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], BaseMessage):
        return messages[-1].content
    return {k: v for k, v in values.items() if isinstance(v, str | int | float | bool | type(None))}


class KeelGraph:
    """Register a LangGraph ``builder`` (a ``StateGraph``, not compiled: Keel compiles it with its checkpointer) as
    operation ``name``. ``input`` makes the graph's input from the request's (default: the prompt as a user message
    in ``messages``); ``answer`` the request's answer from the final state (default: the last message's content);
    ``tool_nodes`` names the nodes that run tools; ``check`` checks a person's edit of held arguments (default: any
    JSON object); ``recursion_limit`` is how many super-steps a run may take (LangGraph's default, counted over the
    whole run); ``registry`` is the worker's unless given."""

    def __init__(
        self,
        builder: StateGraph[Any],
        *,
        name: str,
        input: Callable[[Mapping[str, Any]], Any] = _prompt_input,
        answer: Callable[[Mapping[str, Any]], Any] = _last_message,
        tool_nodes: tuple[str, ...] | list[str] = ("tools",),
        check: ArgumentCheck | None = None,
        recursion_limit: int = 25,
        registry: Registry = registry,
    ) -> None:
        if not isinstance(builder, StateGraph):
            raise InvalidJob(f"KeelGraph {name!r} takes a StateGraph (not compiled), got {type(builder).__name__}")
        self.builder = builder
        self.input = input
        self.answer = answer
        self.tool_nodes = frozenset(tool_nodes)
        self.recursion_limit = recursion_limit
        self.chain = StepChain(name, self, check=check or _any_object, registry=registry)

    #: A step resumes from the previous step's checkpoint alone (and drops it once its own is recorded).
    reads = "last"

    async def run(self, state: StepState) -> Finished:
        """One super-step from the last recorded checkpoint (none if this step's earlier attempt recorded its own)."""
        saver = InMemorySaver()
        graph = self.builder.compile(checkpointer=saver)
        config: RunnableConfig = {"configurable": {"thread_id": state.run_id}, "callbacks": [_Counted(state)]}
        if "checkpoint" in state.record:  # an earlier attempt ran this super-step: its outcome, not a second run
            await _restore(saver, state.run_id, state.record["checkpoint"])
            state.spent(Usage.from_json(state.record.get("usage")), checkpointed=True)
        else:
            done = -1
            if state.records:
                done = await _restore(saver, state.run_id, state.records[-1]["checkpoint"])
            if done >= self.recursion_limit:  # LangGraph counts its limit per call: Keel counts it per run, as one call
                raise InvalidJob(
                    f"the graph has run {done} super-steps, its recursion limit (KeelGraph recursion_limit="
                    f"{self.recursion_limit}): a cycle that does not end?"
                )
            given: Any = None
            if state.number == 1:
                given = self.input(state.given)
            elif state.decision is not None:  # answers the interrupt it was given for (others may be pending too)
                said = {k: v for k, v in state.decision.items() if k not in ("at", "tool_call_id")}
                given = Command(resume={str(state.decision["tool_call_id"]): said})
            sending = state.sending = _Sends()
            try:
                async for _ in graph.astream(given, config, stream_mode="updates", interrupt_after="*", version="v1"):
                    pass
            finally:
                state.sending = None
            found = await saver.aget_tuple({"configurable": {"thread_id": state.run_id}})
            if found is None:  # pragma: no cover - a super-step always saves one
                raise InvalidJob("LangGraph saved no checkpoint after the super-step")
            # A node that was interrupted runs again from its start when resumed: what it sent before interrupt()
            # is sent by that run, not this one (else twice). Every other node of the super-step is done.
            interrupted = {task for task, channel, _ in found.pending_writes or () if channel == INTERRUPT}
            kept = [m for m, task in zip(sending, sending.tasks, strict=True) if task not in interrupted]
            state.record["checkpoint"] = _saved(saver, found)
            state.record["usage"] = {"tokens": state.usage.tokens, "cost": str(state.usage.cost)}
            if kept:
                state.record["messages"] = steps.messages_json(kept)
            state.checkpoint()  # the super-step is done: a retry of this step takes it from here
            state.checkpointed_usage = state.usage
        state.sent.extend(steps.messages_from(state.record.get("messages")))
        snapshot = await graph.aget_state(config)
        if snapshot.interrupts:
            held = snapshot.interrupts[0]  # one at a time: the others wait for the next step's turn
            value = held.value
            if isinstance(value, Mapping) and isinstance(value.get("arguments"), Mapping):
                tool, arguments = str(value.get("tool") or "interrupt"), dict(value["arguments"])
            else:
                tool, arguments = "interrupt", {"value": value}
            raise Held(tool, str(held.id), arguments, state.number)
        if not snapshot.next:
            values = dict(snapshot.values)
            messages = values.get("messages")
            said_all = messages_to_dict(messages) if isinstance(messages, list) else None
            return Finished(self.answer(values), said_all)
        raise NextStep("tool" if set(snapshot.next) <= self.tool_nodes else "model")

    def classify(self, exc: Exception) -> JobError | None:
        """A provider's HTTP error (its ``status_code``, as LangChain's model clients raise them): 429
        ``rate_limited`` after its Retry-After, 5xx ``transient``, other 4xx ``invalid``; a graph past its recursion
        limit ``invalid``."""
        message = f"{type(exc).__name__}: {exc}"[:2000]
        if isinstance(exc, GraphRecursionError | InvalidUpdateError | EmptyInputError | InvalidJob):
            return InvalidJob(message)  # the graph's own refusals: running it again does the same
        status = getattr(exc, "status_code", None) or getattr(getattr(exc, "response", None), "status_code", None)
        if not isinstance(status, int):
            return None
        if status == 429:
            return RateLimited(message, retry_after=_retry_after(exc))
        if status >= 500 or status in (408, 409):
            return TransientError(message)
        return InvalidJob(message)


class _Counted(BaseCallbackHandler):
    """Counts each chat model call's tokens to the step (``usage_metadata``, else the provider's ``token_usage``):
    under a lock, as parallel nodes' sync calls end on threads of their own."""

    def __init__(self, state: StepState) -> None:
        self.state = state
        self.lock = threading.Lock()

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        tokens = 0
        for generations in response.generations:
            for generation in generations:
                usage = getattr(getattr(generation, "message", None), "usage_metadata", None) or {}
                tokens += int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)
        if not tokens and isinstance(response.llm_output, Mapping):
            usage = response.llm_output.get("token_usage") or {}
            tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        with self.lock:
            self.state.spent(Usage(tokens), checkpointed=False)


def _saved(saver: InMemorySaver, found: CheckpointTuple) -> dict[str, str]:
    """A checkpoint, its metadata and pending writes, as LangGraph's serializer writes them."""
    kind, data = saver.serde.dumps_typed((found.checkpoint, found.metadata, found.pending_writes or []))
    return {"type": kind, "data": base64.b64encode(data).decode("ascii")}


async def _restore(saver: InMemorySaver, thread: str, saved: Mapping[str, str]) -> int:
    """Put a checkpoint :func:`_saved` wrote (with its pending writes: an interrupt's) back into ``saver``; the
    number of its super-step (LangGraph's ``step``)."""
    checkpoint, metadata, writes = saver.serde.loads_typed((saved["type"], base64.b64decode(saved["data"])))
    root: RunnableConfig = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    at = await saver.aput(root, checkpoint, metadata, checkpoint["channel_versions"])
    by_task: dict[str, list[tuple[str, Any]]] = {}
    for task, channel, value in writes:
        by_task.setdefault(task, []).append((channel, value))
    for task, pending in by_task.items():
        await saver.aput_writes(at, pending, task)
    step = metadata.get("step") if isinstance(metadata, Mapping) else None
    return step if isinstance(step, int) else -1


class _Sends(list[MessageSpec]):
    """What :func:`send` puts out during a super-step, with the LangGraph task (node run) that sent each."""

    def __init__(self) -> None:
        super().__init__()
        self.tasks: list[str] = []

    def append(self, message: MessageSpec) -> None:
        super().append(message)
        self.tasks.append(_current_task())


def _current_task() -> str:
    """The id of the LangGraph task running this code (its checkpoint namespace is ``node:task_id``)."""
    try:
        namespace = str(get_config().get("configurable", {}).get("checkpoint_ns", ""))
    except RuntimeError:  # outside a runnable context
        return ""
    return namespace.split("|")[0].rpartition(":")[2]


_ROLES = {"human": "user", "ai": "assistant", "tool": "tool", "system": "system"}


def _conversation(request_input: Any, taken: list[Mapping[str, Any]]) -> list[conversations.Message]:
    """A graph's conversation: the ``messages`` of the latest checkpoint its steps recorded (none: the prompt)."""
    saved = taken[-1]["result"]["record"]["checkpoint"]
    checkpoint, _, _ = InMemorySaver().serde.loads_typed((saved["type"], base64.b64decode(saved["data"])))
    found = (checkpoint.get("channel_values") or {}).get("messages")
    if not isinstance(found, list):
        return [{"role": "user", "content": conversations.prompt_of(request_input)}]
    messages: list[conversations.Message] = []
    for message in found:
        if not isinstance(message, BaseMessage):
            continue
        said: conversations.Message = {
            "role": _ROLES.get(message.type, message.type),
            "content": conversations.text_of(message.content),
        }
        calls = [{"tool": c["name"], "arguments": c["args"]} for c in getattr(message, "tool_calls", None) or ()]
        if calls:
            said["calls"] = calls
        messages.append(said)
    return messages


conversations.register_reader("checkpoint", _conversation)


def _retry_after(exc: Exception) -> float | None:
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    said = headers.get("retry-after")
    try:
        return None if said is None else min(float(said), MAX_RETRY_AFTER_SECONDS)
    except (TypeError, ValueError):  # an HTTP date, or nonsense: the retry policy's backoff
        return None


def _any_object(tool: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    return dict(arguments)

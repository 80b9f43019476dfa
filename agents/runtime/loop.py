"""The agent loop as job handlers: ``plan`` (a model call), ``tool`` (one tool call), ``gate`` (wait for a person).
Each step's keys derive from its own key, and its result is stored in the transition that schedules the next step,
so after a crash a request resumes at its first unfinished step and never repeats a model or tool call (the whole
loop: docs/explanation/runtime-outbox-and-workers.md#the-agent-loop).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextvars import copy_context
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from agents.core import approval_notices
from agents.core.commands import JobSpec, Join, MessageSpec
from agents.core.errors import InvalidInput, InvalidJob, UnknownTool
from agents.core.keys import derive, split_key
from agents.core.observe import observe
from agents.core.phases import Event
from agents.core.transition import STAGED_SPEND
from agents.jobs.handler_threads import STUCK
from agents.jobs.handlers import JobContext, JobResult, handler
from agents.runtime.inference import (
    OpenAICompatible,
    Provider,
    Reply,
    ScriptedCall,
    ScriptedProvider,
    ScriptEntry,
    StandInProvider,
    parse_script,
    tool_call_key,
)
from agents.runtime.notices import console_link, decided_notice, waiting_notice
from agents.runtime.tools import ToolContext, by_name, registered, stored_tool
from models.db import Database
from models.jobs_sql import cancel_request_steps_txn, request_gates, request_steps, request_steps_by_key
from models.outbox_sql import message_row
from models.settings import Settings
from models.sql import agent_name


@cache
def _settings() -> Settings:
    return Settings()


_openai_lock = threading.Lock()


def _openai() -> OpenAICompatible:
    """The process's one client (its connection pool): made once, however many steps ask at once."""
    with _openai_lock:
        return _openai_client()


@cache
def _openai_client() -> OpenAICompatible:
    settings = _settings()
    key = settings.llm_api_key.get_secret_value() if settings.llm_api_key else None
    return OpenAICompatible(
        settings.llm_base_url,
        settings.llm_model,
        key,
        timeout=settings.llm_timeout_seconds,
        prices=settings.llm_prices,
        connections=settings.worker_slots,  # a call per step in flight, none waiting for a connection
    )


def provider_for(request_input: Any) -> Provider:
    """The configured provider; with ``scripted``, the conversation the request carries in ``input["script"]``, or
    without one the stand-in model (:class:`~agents.runtime.inference.StandInProvider`)."""
    if _settings().llm_provider == "openai":
        return _openai()
    script = request_input.get("script") if isinstance(request_input, Mapping) else None
    if script is None:
        if _settings().environment == "production":  # a stand-in's answer must never pass for a model's there
            raise InvalidJob(
                "no model is configured: KEEL_LLM_PROVIDER is scripted and the request carries no script, and the"
                " stand-in model does not answer in production: set KEEL_LLM_PROVIDER=openai, KEEL_LLM_BASE_URL and"
                " KEEL_LLM_API_KEY"
            )
        return StandInProvider()
    return ScriptedProvider(parse_script(script))


class PlannedCall(ScriptedCall):
    """A scripted tool call as a submit checks it: the tool exists, and its arguments fit the tool's argument model
    (the error's path goes on into them: ``….arguments.channel``)."""

    @field_validator("name")
    @classmethod
    def _is_a_tool(cls, name: str) -> str:
        if by_name(name) is None:
            known = ", ".join(sorted(registered())) or "none"
            raise ValueError(f"there is no tool named {name!r} (tools: {known})")
        return name

    @field_validator("arguments")
    @classmethod
    def _fit_the_tool(cls, arguments: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        tool = by_name(info.data.get("name", ""))
        if tool is not None:  # (an unknown name is reported on its own field)
            # pydantic puts this model's errors under this field's path: ….tool_calls[0].arguments.channel
            tool.input_model.model_validate(arguments)
        return arguments


class PlannedReply(ScriptEntry):
    tool_calls: list[PlannedCall] = Field(default_factory=list)  # type: ignore[assignment]


class PlanInput(BaseModel):
    """The input of the ``plan`` operation (a request to the agent loop): the prompt, and for
    ``KEEL_LLM_PROVIDER=scripted`` the model's replies (see :class:`~agents.runtime.inference.ScriptEntry`), whose
    tool calls must name tools that exist."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    script: list[PlannedReply] | None = None


def prompt_of(request_input: Any) -> str:
    if isinstance(request_input, Mapping):
        return str(request_input.get("prompt", ""))
    return str(request_input)


def step_target(tool_name: str, round_: int, call_id: str) -> str:
    """The target of a tool (or gate) step: qualified by the round, since providers may reuse call ids; the id is
    mapped to a key-safe one (the model's own, or the mapped one: both give the same target)."""
    return f"{tool_name}:{round_}.{tool_call_key(call_id)}"


def conversation(db: Database, agent_id: UUID, request_id: str, plan_key: str) -> tuple[Any, list[dict[str, Any]]]:
    """The messages plan step ``plan_key`` sends: the previous plan step's stored conversation, its reply and its
    calls' results, a few rows read by key (rebuilt from every step when that step holds none). The agent and
    ``request_id`` scope the read."""
    previous = int(split_key(plan_key)[2]) - 1
    previous_key = derive(plan_key, "plan", str(previous))
    request_input, found = request_steps_by_key(db, agent_id, request_id, [plan_key, previous_key])
    if previous < 1:
        return request_input, _opening(request_input)
    prior = (found.get(previous_key) or {}).get("result")
    if not (isinstance(prior, Mapping) and isinstance(prior.get("conversation"), list) and "reply" in prior):
        return rebuild_conversation(db, agent_id, request_id, plan_key)
    reply = prior["reply"]
    calls = reply.get("tool_calls") or []
    keys = [_tool_key(plan_key, previous, call) for call in calls]
    _, steps = request_steps_by_key(db, agent_id, request_id, keys)
    # This step's own payload says which calls of the round before it a person (or a timeout) rejected.
    rejected = _rejections([found[plan_key]] if plan_key in found else [])
    messages = [*prior["conversation"], reply, *_results(plan_key, previous, calls, steps, rejected)]
    return request_input, messages


def rebuild_conversation(
    db: Database, agent_id: UUID, request_id: str, plan_key: str
) -> tuple[Any, list[dict[str, Any]]]:
    """The messages the plan step ``plan_key`` sends, rebuilt from every stored step result of the request."""
    request_input, steps = request_steps(db, agent_id, request_id)
    messages = _opening(request_input)
    by_key = {s["key"]: s for s in steps}
    rejected = _rejections(steps)
    for n in range(1, int(split_key(plan_key)[2])):
        plan_step = by_key.get(derive(plan_key, "plan", str(n)))
        if plan_step is None or plan_step["result"] is None:
            break
        reply = plan_step["result"]["reply"]
        messages.append(reply)
        messages.extend(_results(plan_key, n, reply.get("tool_calls") or [], by_key, rejected))
    return request_input, messages


def _opening(request_input: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": _settings().llm_system_prompt},
        {"role": "user", "content": prompt_of(request_input)},
    ]


def _rejections(steps: list[dict[str, Any]]) -> dict[tuple[int, str], str]:
    """What the model is told about each rejected call, by (round, call key): a plan step's payload names the calls
    of the round before it that were rejected."""
    rejected: dict[tuple[int, str], str] = {}
    for step in steps:
        if step["operation"] == "plan":
            for entry in (step["payload"] or {}).get("rejected", []):
                said = "This call was rejected" if entry.get("timed_out") else "A person rejected this call"
                rejected[(int(step["target"]) - 1, tool_call_key(entry["tool_call_id"]))] = f"{said}: {entry['reason']}"
    return rejected


def _tool_key(step_key: str, round_: int, call: Mapping[str, Any]) -> str:
    """The key of the tool step that ran ``call`` of round ``round_``, in the request of the step ``step_key``."""
    tool = by_name(call["function"]["name"])
    return derive(step_key, "tool", step_target(tool.name if tool else "unknown", round_, call["id"]))


def _results(
    step_key: str,
    round_: int,
    calls: list[dict[str, Any]],
    steps: Mapping[str, dict[str, Any]],
    rejected: Mapping[tuple[int, str], str],
) -> list[dict[str, Any]]:
    """The tool messages answering a round's calls, in the order the model made them."""
    messages: list[dict[str, Any]] = []
    for call in calls:
        done = steps.get(_tool_key(step_key, round_, call))
        key = (round_, tool_call_key(call["id"]))
        if done is not None and done["status"] == "succeeded" and done["result"] is not None:
            content = done["result"]["content"]
            edited = (done["payload"] or {}).get("edited_from")
            if isinstance(edited, Mapping):  # the model must know it was not its own call that ran
                content = f"{edit_summary(edited, done['payload'].get('arguments') or {})}\n{content}"
        elif key in rejected:
            content = rejected[key]
        else:
            content = "This call was not run."
        # The model's own id, whatever its key is: that is how it pairs the result with its call.
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return messages


@handler("plan", input=PlanInput)
def plan(ctx: JobContext) -> JobResult:
    round_ = int(ctx.target)
    request_input, messages = conversation(ctx.db, ctx.agent_id, ctx.request_id, ctx.key)
    tools = registered()
    if ctx.checkpointed and "reply" in ctx.checkpointed:  # an earlier attempt got (and paid for) the reply
        reply = Reply.from_checkpoint(ctx.checkpointed)
    else:
        provider = provider_for(request_input)
        with observe("model_call", type(provider).__name__, request_id=ctx.request_id, job_key=ctx.key):
            reply = provider.complete(messages, [t.schema() for t in tools.values()], attempt=ctx.attempt)
        ctx.checkpoint(reply.checkpoint())
    message = reply.as_message()
    # Stored with the reply, so the next step reads this one row; the previous step's copy is dropped (its reply
    # stays), so a request stores its conversation once, not once per round.
    sent = {"reply": message, "conversation": messages}
    drops = ((derive(ctx.key, "plan", str(round_ - 1)), "conversation"),) if round_ > 1 else ()
    if not reply.tool_calls:
        output = {**sent, "answer": reply.content}
        return JobResult(output=output, usage=reply.usage, event=Event.FINISH, drops=drops)
    ids = [call.id for call in reply.tool_calls]
    keys = [tool_call_key(call_id) for call_id in ids]
    if len(set(ids)) != len(ids) or len(set(keys)) != len(keys):
        raise InvalidJob(f"the model used a tool call id twice in one reply: {ascii(ids)[:500]}", usage=reply.usage)
    for call in reply.tool_calls:
        if call.name not in tools:  # the model names tools by their one name only: no other spelling runs
            raise UnknownTool(call.name, sorted(tools), usage=reply.usage)
    jobs: list[JobSpec] = []
    gated = False
    for call in reply.tool_calls:
        tool = tools[call.name]
        payload = {
            "arguments": dict(call.arguments),
            "round": round_,
            "call_id": tool_call_key(call.id),
            "tool_call_id": call.id,
            "function": call.name,
            "tool": tool.name,
        }
        if tool.needs_approval and not gated:
            gated = True
            gate_payload = dict(payload)
            if tool.approval_timeout is not None:  # carried by the step: the beat that enforces it has no tools
                gate_payload["approval_timeout_seconds"] = tool.approval_timeout.total_seconds()
                gate_payload["on_timeout"] = tool.on_timeout
            jobs.append(JobSpec("gate", step_target(tool.name, round_, call.id), payload=gate_payload))
        else:
            deferred = tool.needs_approval  # one approval at a time
            target = step_target(tool.name, round_, call.id)
            jobs.append(JobSpec("tool", target, payload={**payload, "deferred": deferred}))
    return JobResult(output=sent, usage=reply.usage, event=Event.PLAN, jobs=tuple(jobs), drops=drops)


def _next_round(payload: Mapping[str, Any]) -> Join:
    return Join(Event.OBSERVE, (JobSpec("plan", str(int(payload["round"]) + 1)),))


@handler("tool", internal=True)
def run_tool(ctx: JobContext) -> JobResult:
    payload = ctx.payload
    call_id = str(payload["call_id"])
    join = _next_round(payload)

    def said(content: str, **extra: Any) -> JobResult:
        return JobResult(output={"tool_call_id": call_id, "content": content}, join=join, **extra)

    tool = stored_tool(payload.get("tool") or "")
    if tool is None:  # a step recorded before its tool was removed (or, from older versions, an unknown name)
        return said(f"error: there is no tool named {payload.get('function')!r}")
    if payload.get("deferred"):
        return said("not run: another call is waiting for approval; ask again after it")
    if tool.needs_approval and not payload.get("approved"):
        return said("not run: this tool needs a person's approval")
    try:
        args = tool.validate(payload.get("arguments", {}))
    except InvalidJob as exc:  # the model can fix its own arguments: tell it, do not fail the request
        # ... and say so on the request's record, not only inside this step's result.
        return said(f"error: {exc}", decision="tool_arguments_invalid", details={"tool_error": str(exc)})
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tool-{tool.name}")
    with observe("tool_call", tool.name, request_id=ctx.request_id, job_key=ctx.key) as op:
        # The tool's thread runs in this context: its log lines and spans belong to this call.
        future = pool.submit(copy_context().run, tool.fn, args, ToolContext(ctx.key, ctx.request_id, call_id))
        try:
            output = future.result(timeout=tool.timeout)
        except FutureTimeout:
            # It may have had its effect, so it never runs again. Its thread cannot be stopped: what it returns is
            # dropped, the database refuses it (ctx.db), and it counts as this process's stuck work.
            op.outcome = "timeout"
            STUCK.add(lambda: not future.done())
            ctx.abandoned.set()
            return said(f"error: {tool.name} did not finish within {tool.timeout:g}s; its outcome is unknown")
        except InvalidInput as exc:
            op.outcome = "invalid"
            return said(f"error: {exc}")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    # The runner checkpoints this whole result (content, messages, usage) before recording it: a replay after a
    # crash emits the same messages under the same keys and charges the same usage, without running the tool again.
    return said(output.content, usage=output.usage, messages=output.messages)


@handler("gate", internal=True)
def gate(ctx: JobContext) -> JobResult:
    """Hold a call for a person: the agent waits; its state shows the call. With ``KEEL_APPROVAL_SLACK_CHANNEL``
    that channel is told, in the transition that starts the wait (keyed by this step: never twice)."""
    settings = _settings()
    channel = settings.approval_slack_channel
    messages: tuple[MessageSpec, ...] = ()
    if channel:
        name = agent_name(ctx.db, ctx.agent_id) or str(ctx.agent_id)
        notice = waiting_notice(
            channel,
            ctx.key,
            agent=name,
            tool=str(ctx.payload.get("tool")),
            arguments=ctx.payload.get("arguments") or {},
            link=console_link(settings, name),
        )
        messages = (notice,)
    output = {"call": dict(ctx.payload), "notice_channel": channel}
    return JobResult(output=output, event=Event.REQUEST_APPROVAL, messages=messages)


@dataclass(frozen=True, slots=True)
class PendingApproval:
    tool: str
    call_id: str
    arguments: Mapping[str, Any]
    round: int
    #: The gate step's target (``{tool}:{round}.{call_key}``).
    target: str = ""
    #: The gate step's key: what the approval's messages are keyed from.
    gate: str = ""
    #: When the call started waiting (the database's clock).
    since: datetime | None = None
    #: The channel told that the call waits (None: nobody was): the decision is followed up there.
    notice_channel: str | None = None
    #: The channel told that the call was escalated (None: it was not, or nobody was): followed up there too.
    escalation_channel: str | None = None
    #: For a gate a framework integration scheduled (agents/integrations): the step its decision resumes, as
    #: ``{"operation": …, "step": n}``; None for Keel's own loop (an approval runs the tool, a rejection plans again).
    resume: Mapping[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"tool": self.tool, "call_id": self.call_id, "arguments": dict(self.arguments), "round": self.round}

    def decided_messages(self, agent: str, outcome: str, by: str) -> tuple[MessageSpec, ...]:
        """The follow-ups of the waiting notice and of the escalation notice, for those that were sent."""
        if not self.gate:
            return ()
        told = ((self.notice_channel, False), (self.escalation_channel, True))
        return tuple(
            decided_notice(
                channel, self.gate, agent=agent, tool=self.tool, outcome=outcome, by=by, escalation=escalation
            )
            for channel, escalation in told
            if channel
        )


def pending_approval(db: Database, agent_id: UUID, request_id: str | None) -> PendingApproval | None:
    """The call the agent waits on: the latest gate of its request whose tool was neither scheduled nor rejected."""
    if request_id is None:
        return None
    gates = request_gates(db, agent_id, request_id)
    # What answered each gate, if anything did: its call scheduled as a tool step (approved), or the next round's
    # plan step naming it rejected. Read by key: a waiting agent's view costs its gates, not its whole request.
    answers = [_approved_key(g) for g in gates]
    answers += [derive(g["key"], "plan", str(int(g["payload"]["round"]) + 1)) for g in gates]
    answers += [k for k in map(_resumed_key, gates) if k is not None]
    _, found = request_steps_by_key(db, agent_id, request_id, answers) if gates else (None, {})
    rejected = _rejections([s for s in found.values() if s["operation"] == "plan"])
    for step in gates:
        payload = step["payload"]
        round_, call_id = int(payload["round"]), str(payload.get("tool_call_id", payload["call_id"]))
        if _approved_key(step) in found or (round_, tool_call_key(call_id)) in rejected:
            continue
        if _resumed_key(step) in found:  # an integration's gate: its decision scheduled the step it resumes
            continue
        output = (step["result"] or {}) if isinstance(step["result"], Mapping) else {}
        channel = output.get("notice_channel")
        escalated = message_row(db, approval_notices.key(step["key"], approval_notices.ESCALATED))
        return PendingApproval(
            str(payload["tool"]),
            call_id,
            payload.get("arguments", {}),
            round_,
            target=str(step["target"]),
            gate=str(step["key"]),
            since=step["finished_at"],
            notice_channel=channel if isinstance(channel, str) else None,
            escalation_channel=None if escalated is None else str(escalated["destination"]),
            resume=_resume_of(payload),
        )
    return None


def _resume_of(payload: Mapping[str, Any]) -> Mapping[str, Any] | None:
    resume = payload.get("resume")
    return resume if isinstance(resume, Mapping) else None


def _resumed_key(gate: Mapping[str, Any]) -> str | None:
    """The key of the step an integration's gate resumes once decided (None: a gate of Keel's own loop)."""
    resume = _resume_of(gate["payload"] or {})
    if resume is None:
        return None
    return derive(gate["key"], str(resume["operation"]), str(resume["step"]))


def _approved_key(gate: Mapping[str, Any]) -> str:
    """The key of the tool step an approval of ``gate`` schedules (it shares the gate's target)."""
    return derive(gate["key"], "tool", gate["target"])


def edit_summary(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """What the model reads about a person's edit of its call: each argument changed, from → to."""
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    parts = [f"{k}: {_shown(before.get(k))} → {_shown(after.get(k))}" for k in changed]
    return "A person edited this call's arguments before approving it (" + "; ".join(parts) + ")."


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 300 else text[:299] + "…"


def approval_jobs(pending: PendingApproval, arguments: Mapping[str, Any] | None = None) -> tuple[JobSpec, ...]:
    """What an approval schedules: the held call itself, marked approved; with ``arguments`` (a person's edit,
    already validated), the call runs with those, and its result tells the model what was changed."""
    edited = arguments is not None and dict(arguments) != dict(pending.arguments)
    if pending.resume is not None:
        decision: dict[str, Any] = {"tool_call_id": pending.call_id, "approved": True}
        if edited:
            decision["arguments"] = dict(arguments or {})
            decision["edited_from"] = dict(pending.arguments)
        return (_resumed(pending.resume, decision),)
    payload: dict[str, Any] = {
        "arguments": dict(arguments if arguments is not None else pending.arguments),
        "round": pending.round,
        "call_id": tool_call_key(pending.call_id),
        "tool_call_id": pending.call_id,
        "tool": pending.tool,
        "approved": True,
    }
    if edited:
        payload["edited_from"] = dict(pending.arguments)
    return (JobSpec("tool", step_target(pending.tool, pending.round, pending.call_id), payload=payload),)


def rejection_jobs(pending: PendingApproval, reason: str, *, timed_out: bool = False) -> tuple[JobSpec, ...]:
    """What a rejection schedules: the model's next round, told why (a person's reason, or that it timed out)."""
    entry: dict[str, Any] = {"tool_call_id": pending.call_id, "reason": reason}
    if timed_out:
        entry["timed_out"] = True
    if pending.resume is not None:
        return (_resumed(pending.resume, {**entry, "approved": False}),)
    rejected = [entry]
    return (JobSpec("plan", str(pending.round + 1), payload={"rejected": rejected}),)


def _resumed(resume: Mapping[str, Any], decision: Mapping[str, Any]) -> JobSpec:
    """The step an integration's gate resumes, carrying the person's (or the timeout's) decision."""
    held = {"at": resume["at"]} if "at" in resume else {}  # where the run held the call: what the decision answers
    return JobSpec(str(resume["operation"]), str(resume["step"]), payload={"decision": {**decision, **held}})


def cancel_round_txn(cur: Any, before: Any, after: Any) -> dict[str, Any]:
    """A rejection's effect: the rest of the round is superseded (running calls are fenced off, never recorded); the
    spend of outcomes they staged is charged by the rejection (:data:`agents.core.transition.STAGED_SPEND`)."""
    swept = cancel_request_steps_txn(cur, after.id, after.request_id, ("tool", "gate"), after.updated_at)
    summary: dict[str, Any] = {"superseded": swept.keys} if swept.keys else {}
    if swept.staged:
        summary[STAGED_SPEND] = swept.staged
    return summary

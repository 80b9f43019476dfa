"""The agent loop as job handlers: plan (a model call), tool (one tool call), gate (wait for a person).

planning: job ``{request_id}:plan:{n}`` asks the model. A final answer finishes the request; tool calls move the
agent to executing and schedule one job per call, ``{request_id}:tool:{name}:{call_id}``. The last tool result of
a round sends the conversation back to the model (``plan:{n+1}``). A call to a tool that needs approval is a
``gate`` job that moves the agent to waiting_approval; ``approve`` schedules the tool, ``reject`` asks the model to
revise. Every step's result is stored on its job, in the transition that schedules the next step, and the
conversation is rebuilt from those results: after a crash the request resumes at the first unfinished step, and a
finished model call or tool call is never made again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import cache
from typing import Any

from agents.commands import JobSpec, Join
from agents.errors import InvalidJob, KeelError, TransientError
from agents.handlers import JobContext, JobResult, handler
from agents.inference import OpenAICompatible, Provider, ScriptedProvider
from agents.phases import Event
from agents.tools import ToolContext, by_function_name, registered
from models.db import Database
from models.jobs_sql import request_steps
from models.settings import Settings


@cache
def _settings() -> Settings:
    return Settings()


@cache
def _openai() -> OpenAICompatible:
    settings = _settings()
    key = settings.llm_api_key.get_secret_value() if settings.llm_api_key else None
    return OpenAICompatible(
        settings.llm_base_url, settings.llm_model, key, timeout=settings.llm_timeout_seconds, prices=settings.llm_prices
    )


def provider_for(request_input: Any) -> Provider:
    """The configured provider; with ``scripted``, the conversation the request carries in ``input["script"]``."""
    if _settings().llm_provider == "openai":
        return _openai()
    script = request_input.get("script") if isinstance(request_input, Mapping) else None
    if not isinstance(script, list):
        raise InvalidJob("KEEL_LLM_PROVIDER=scripted needs the request input to carry a 'script' list")
    return ScriptedProvider(script)


def prompt_of(request_input: Any) -> str:
    if isinstance(request_input, Mapping):
        return str(request_input.get("prompt", ""))
    return str(request_input)


def conversation(db: Database, request_id: str, upto_round: int) -> tuple[Any, list[dict[str, Any]]]:
    """The messages of rounds 1..upto_round-1, rebuilt from the stored step results."""
    request_input, steps = request_steps(db, request_id)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _settings().llm_system_prompt},
        {"role": "user", "content": prompt_of(request_input)},
    ]
    by_key = {s["key"]: s for s in steps}
    rejected: dict[str, str] = {}
    for step in steps:
        if step["operation"] == "plan":
            for entry in (step["payload"] or {}).get("rejected", []):
                rejected[entry["tool_call_id"]] = entry["reason"]
    for n in range(1, upto_round):
        plan = by_key.get(f"{request_id}:plan:{n}")
        if plan is None or plan["result"] is None:
            break
        reply = plan["result"]["reply"]
        messages.append(reply)
        for call in reply.get("tool_calls", []):
            name = call["function"]["name"]
            tool = by_function_name(name)
            target = f"{tool.name if tool else name}:{call['id']}"
            done = by_key.get(f"{request_id}:tool:{target}")
            if done is not None and done["result"] is not None:
                content = done["result"]["content"]
            elif call["id"] in rejected:
                content = f"A person rejected this call: {rejected[call['id']]}"
            else:
                content = "This call did not run."
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return request_input, messages


@handler("plan")
def plan(ctx: JobContext) -> JobResult:
    round_ = int(ctx.target)
    request_input, messages = conversation(ctx.db, ctx.request_id, round_)
    tools = registered()
    reply = provider_for(request_input).complete(messages, [t.schema() for t in tools.values()], attempt=ctx.attempt)
    message = reply.as_message()
    if not reply.tool_calls:
        return JobResult(output={"reply": message, "answer": reply.content}, usage=reply.usage, event=Event.FINISH)
    jobs: list[JobSpec] = []
    gated = False
    for call in reply.tool_calls:
        tool = by_function_name(call.name)
        name = tool.name if tool else call.name
        payload = {"arguments": dict(call.arguments), "round": round_, "call_id": call.id, "function": call.name}
        if tool is not None and tool.needs_approval and not gated:
            gated = True
            jobs.append(JobSpec("gate", f"{name}:{call.id}", payload=payload))
        else:
            deferred = tool is not None and tool.needs_approval  # one approval at a time
            jobs.append(JobSpec("tool", f"{name}:{call.id}", payload={**payload, "deferred": deferred}))
    return JobResult(output={"reply": message}, usage=reply.usage, event=Event.PLAN, jobs=tuple(jobs))


def _next_round(payload: Mapping[str, Any]) -> Join:
    return Join(Event.OBSERVE, (JobSpec("plan", str(int(payload["round"]) + 1)),))


@handler("tool")
def run_tool(ctx: JobContext) -> JobResult:
    name, call_id = ctx.target.rsplit(":", 1)
    payload = ctx.payload
    join = _next_round(payload)
    tool = registered().get(name)
    if tool is None:
        content = f"error: there is no tool named {payload.get('function', name)!r}"
        return JobResult(output={"tool_call_id": call_id, "content": content}, join=join)
    if payload.get("deferred"):
        content = "not run: another call is waiting for approval; ask again after it"
        return JobResult(output={"tool_call_id": call_id, "content": content}, join=join)
    try:
        args = tool.validate(payload.get("arguments", {}))
    except InvalidJob as exc:  # the model can fix its own arguments: tell it, do not fail the request
        return JobResult(output={"tool_call_id": call_id, "content": f"error: {exc}"}, join=join)
    context = ToolContext(ctx.key, ctx.request_id, call_id)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(tool.fn, args, context)
        try:
            output = future.result(timeout=tool.timeout)
        except FutureTimeout:
            raise TransientError(f"tool {name} did not finish within {tool.timeout:g}s") from None
        except KeelError:
            raise
    return JobResult(
        output={"tool_call_id": call_id, "content": output.content},
        usage=output.usage,
        messages=output.messages,
        join=join,
    )


@handler("gate")
def gate(ctx: JobContext) -> JobResult:
    """Hold a call for a person: the agent waits; its state shows the call."""
    return JobResult(output={"call": dict(ctx.payload)}, event=Event.REQUEST_APPROVAL)


@dataclass(frozen=True, slots=True)
class PendingApproval:
    tool: str
    call_id: str
    arguments: Mapping[str, Any]
    round: int

    def as_dict(self) -> dict[str, Any]:
        return {"tool": self.tool, "call_id": self.call_id, "arguments": dict(self.arguments), "round": self.round}


def pending_approval(db: Database, request_id: str | None) -> PendingApproval | None:
    """The call the agent waits on: the latest gate of the request whose tool was neither scheduled nor rejected."""
    if request_id is None:
        return None
    _, steps = request_steps(db, request_id)
    keys = {s["key"] for s in steps}
    rejected = {
        e["tool_call_id"] for s in steps if s["operation"] == "plan" for e in (s["payload"] or {}).get("rejected", [])
    }
    for step in reversed(steps):
        if step["operation"] != "gate" or step["status"] != "succeeded":
            continue
        name, call_id = step["target"].rsplit(":", 1)
        if f"{request_id}:tool:{step['target']}" in keys or call_id in rejected:
            continue
        payload = step["payload"]
        return PendingApproval(name, call_id, payload.get("arguments", {}), int(payload["round"]))
    return None


def approval_jobs(pending: PendingApproval) -> tuple[JobSpec, ...]:
    """What an approval schedules: the held call itself."""
    payload = {"arguments": dict(pending.arguments), "round": pending.round, "call_id": pending.call_id}
    return (JobSpec("tool", f"{pending.tool}:{pending.call_id}", payload=payload),)


def rejection_jobs(pending: PendingApproval, reason: str) -> tuple[JobSpec, ...]:
    """What a rejection schedules: the model's next round, told why."""
    rejected = [{"tool_call_id": pending.call_id, "reason": reason}]
    return (JobSpec("plan", str(pending.round + 1), payload={"rejected": rejected}),)


def transcript(messages: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(json.dumps(m, sort_keys=True) for m in messages)

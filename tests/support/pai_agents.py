"""A Pydantic AI agent registered with Keel for the chaos tests (``KEEL_IMPORTS``): its model (a ``FunctionModel``: no
network) and its tool write each call to the ``executions`` table, and the call the request's prompt names
(``block:model1``, ``block:tool`` or ``block:model2``) waits until the test releases it (``Stack.release(RELEASE)``),
so the test can kill the worker right there."""

from __future__ import annotations

import os

import psycopg
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from agents.integrations.pydantic_ai import KeelAgent
from models.urls import libpq_url
from tests.support.handlers import wait_for_release

#: The key the test releases (``Stack.release``) to let the blocked call finish.
RELEASE = "pai-release"


def _executed(key: str, phase: str) -> None:
    with psycopg.connect(libpq_url(os.environ["KEEL_DATABASE_URL"]), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO executions (key, attempt, pid, token, phase) VALUES (%s, 0, %s, 0, %s)",
            (key, os.getpid(), phase),
        )


def _blocked_at(messages: list[ModelMessage]) -> str:
    prompts = [str(p.content) for m in messages for p in getattr(m, "parts", []) if isinstance(p, UserPromptPart)]
    return prompts[0].removeprefix("block:") if prompts and prompts[0].startswith("block:") else ""


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    answered = any(getattr(p, "part_kind", "") == "tool-return" for m in messages for p in getattr(m, "parts", []))
    which = "model2" if answered else "model1"
    _executed("pai_model", f"{which}_start")
    if _blocked_at(messages) == which:
        wait_for_release(RELEASE)
    _executed("pai_model", f"{which}_done")
    usage = RequestUsage(input_tokens=100, output_tokens=10)
    if not answered:
        return ModelResponse(parts=[ToolCallPart("ship", {"order": "A-1"}, tool_call_id="s1")], usage=usage)
    return ModelResponse(parts=[TextPart("A-1 is on its way.")], usage=usage)


agent: Agent[None, str] = Agent(FunctionModel(_model), name="shipper")


@agent.tool
def ship(ctx: RunContext[None], order: str) -> str:
    _executed("pai_ship", "start")
    if _blocked_at(ctx.messages) == "tool":
        wait_for_release(RELEASE)
    _executed("pai_ship", "done")
    return f"{order} shipped"


SHIPPER = KeelAgent(agent, name="pai_ship")

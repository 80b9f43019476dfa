"""The demo's Pydantic AI agent (with ``keel[pydantic-ai]``): a concierge written with Pydantic AI, unchanged, run by
Keel — it looks the runbook up, then pages the on-call team, a call a person approves first. Its model is Pydantic
AI's ``FunctionModel`` giving scripted replies (no network); each reply and each tool call it makes is written to
``demo-pai.log`` (in the worker's directory, the demo's log directory), so the demo checks none was repeated."""

from __future__ import annotations

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from agents.integrations.pydantic_ai import KeelAgent

PAI_LOG = "demo-pai.log"


def _logged(line: str) -> None:
    with open(PAI_LOG, "a") as log:
        log.write(f"{line}\n")


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    answered = [p for m in messages for p in getattr(m, "parts", []) if getattr(p, "part_kind", "") == "tool-return"]
    _logged(f"model reply {len(answered) + 1}")
    usage = RequestUsage(input_tokens=80, output_tokens=20)
    if not answered:
        return ModelResponse(parts=[ToolCallPart("runbook", {"topic": "failover"}, tool_call_id="rb1")], usage=usage)
    if len(answered) == 1:
        return ModelResponse(parts=[ToolCallPart("page_oncall", {"team": "database"}, tool_call_id="pg1")], usage=usage)
    return ModelResponse(parts=[TextPart("The database on-call is paged; the runbook says: fail over.")], usage=usage)


concierge: Agent[None, str] = Agent(FunctionModel(_model), name="concierge", instructions="Help the on-call.")


@concierge.tool_plain
def runbook(topic: str) -> str:
    """Look a topic up in the runbook."""
    _logged(f"runbook {topic}")
    return f"Runbook on {topic}: fail over to the replica, then page the owning team."


@concierge.tool_plain
def page_oncall(team: str) -> str:
    """Page a team's on-call engineer."""
    _logged(f"page_oncall {team}")
    return f"paged the {team} on-call"


CONCIERGE = KeelAgent(concierge, name="concierge", approve=["page_oncall"])

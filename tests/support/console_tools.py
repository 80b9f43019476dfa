"""Two tools whose calls wait for approval (one rejected after four hours, one escalated after a second), and an
agent run up to such a call: for the console's tests of the inbox, the agents list and the agent page."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, Field

from agents.client import Client
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.db import Database
from models.schemas import AgentState
from tests.support.api import script
from tests.support.runs import run_all


class Release(BaseModel):
    service: str = Field(min_length=1)


@tool("console_release", needs_approval=True, approval_timeout=timedelta(hours=4))
def console_release(args: Release, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"released {args.service}")


@tool("console_page", needs_approval=True, approval_timeout=timedelta(seconds=1), on_timeout="escalate")
def console_page(args: Release, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"paged for {args.service}")


def to_approval(client: Client, db: Database, name: str, tool_name: str) -> AgentState:
    """An agent whose scripted model calls ``tool_name`` (a tool of this module) and waits for approval, run here."""
    agent = client.create_agent(name)
    call = {"name": tool_name, "arguments": {"service": "api"}}
    client.submit(agent.id, f"{name}-r1", script({"tool_calls": [call]}, {"content": "Done."}))
    run_all(db)
    state = client.get_state(agent.id)
    assert state.phase == "waiting_approval", state
    return state

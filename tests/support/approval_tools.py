"""A tool with an approval timeout, for the console's browser tests (their worker and API import it): its calls
show in the inbox with the time left before they are rejected."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, Field

from agents.runtime.tools import ToolContext, ToolOutput, tool


class Train(BaseModel):
    service: str = Field(min_length=1)


@tool("release_train", needs_approval=True, approval_timeout=timedelta(hours=1))
def release_train(args: Train, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"released {args.service}")

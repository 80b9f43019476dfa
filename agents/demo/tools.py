"""The demo's own tool: a knowledge-base search that takes a moment (long enough to be killed in the middle)."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from agents.core.commands import Usage
from agents.runtime.tools import ToolContext, ToolOutput, tool

SEARCHES_LOG = "demo-searches.log"


class Search(BaseModel):
    query: str = Field(min_length=1, max_length=200)


@tool("kb_search", description="Search the incident knowledge base.")
def kb_search(args: Search, ctx: ToolContext) -> ToolOutput:
    time.sleep(0.6)
    with open(SEARCHES_LOG, "a") as log:  # one line per finished call: the demo checks none is repeated
        log.write(f"{ctx.key}\n")
    return ToolOutput(f"2 incidents match {args.query!r}: INC-101 (db failover), INC-107 (cache)", usage=Usage(12))

"""A tool for the chaos tests: it blocks until the test sets ``release:{job key}`` on the broker's Redis, and
records each finished call in the test database's ``executions`` table."""

from __future__ import annotations

import os
import time
from decimal import Decimal

import psycopg
from pydantic import BaseModel

from agents.core.commands import MessageSpec, Usage
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.urls import libpq_url
from tests.support.handlers import wait_for_release


class Wait(BaseModel):
    topic: str


def _record(key: str, phase: str) -> None:
    with psycopg.connect(libpq_url(os.environ["KEEL_DATABASE_URL"]), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO executions (key, attempt, pid, token, phase) VALUES (%s, 0, %s, 0, %s)",
            (key, os.getpid(), phase),
        )


@tool("test_wait", description="Look something up, slowly.", timeout=120)
def wait(args: Wait, ctx: ToolContext) -> ToolOutput:
    wait_for_release(ctx.key)
    _record(ctx.key, "tool")
    return ToolOutput(f"found 2 notes about {args.topic}")


class Post(BaseModel):
    channel: str
    text: str


@tool("test_post", description="Post to Slack once released, and pay for it.", timeout=120)
def post(args: Post, ctx: ToolContext) -> ToolOutput:
    _record(ctx.key, "tool")
    wait_for_release(ctx.key)
    message = MessageSpec("slack", args.channel, ctx.call_id, {"text": args.text})
    return ToolOutput(f"posted to {args.channel}", messages=(message,), usage=Usage(40, Decimal("0.04")))


@tool("test_stall", description="Post, but only after far too long.", timeout=1)
def stall(args: Post, ctx: ToolContext) -> ToolOutput:
    _record(ctx.key, "tool")
    time.sleep(4)
    _record(ctx.key, "late")  # past its timeout: its process must be gone before this line
    return ToolOutput("posted late", messages=(MessageSpec("slack", args.channel, ctx.call_id, {"text": args.text}),))

"""A tool for the chaos tests: it blocks until the test sets ``release:{job key}`` on the broker's Redis, and
records each finished call in the test database's ``executions`` table."""

from __future__ import annotations

import os
import time

import redis
from pydantic import BaseModel

from agents.tools import ToolContext, ToolOutput, tool


class Wait(BaseModel):
    topic: str


@tool("test.wait", description="Look something up, slowly.", timeout=120)
def wait(args: Wait, ctx: ToolContext) -> ToolOutput:
    client = redis.Redis.from_url(os.environ["KEEL_BROKER_URL"])
    try:
        while not client.exists(f"release:{ctx.key}"):
            time.sleep(0.05)
    finally:
        client.close()
    import psycopg

    from models.urls import libpq_url

    with psycopg.connect(libpq_url(os.environ["KEEL_DATABASE_URL"]), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO executions (key, attempt, pid, token, phase) VALUES (%s, 0, %s, 0, 'tool')",
            (ctx.key, os.getpid()),
        )
    return ToolOutput(f"found 2 notes about {args.topic}")

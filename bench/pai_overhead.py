"""Benchmark: what running a Pydantic AI agent through Keel's integration (agents/integrations/pydantic_ai.py) costs
per step over Keel's own loop, in the same run (``python -m bench.pai_overhead``).

Both sides run the same request shape, ``--requests`` times, one agent per request: a model reply that calls one
tool, the tool, and a final reply — three steps each. Keel's own loop uses its scripted provider (the replies are in
the request's input) and a Keel tool; the integration runs a Pydantic AI ``Agent`` with a ``FunctionModel`` giving
the same replies and a Pydantic AI tool. Neither waits on anything: what is measured is each side's own work. Steps
run in this process, one after another, through Keel's runner (claim, handler, outcome), as a worker runs them;
sides alternate for ``--rounds`` rounds, and the median of each is printed: CPU (this process) and wall time per step,
and their ratio. Needs the ``pydantic-ai`` extra. Uses KEEL_DATABASE_URL's server, else the embedded one, in a
database of its own that it drops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from datetime import timedelta

import psycopg
from pydantic import BaseModel

from agents.client import Client
from agents.core.policies import DEFAULT_RULES
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models import migrations
from models.audit_keys import audit_keys_for
from models.db import Database
from models.embedded import database_url_for
from models.settings import Settings
from models.urls import libpq_url, with_database

try:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.usage import RequestUsage

    from agents.integrations.pydantic_ai import KeelAgent
except ImportError as exc:  # pragma: no cover - the bench extra's absence is reported by main
    MISSING: str | None = str(exc)
else:
    MISSING = None

import agents.runtime.loop  # noqa: F401 - registers plan, tool and gate


class Lookup(BaseModel):
    order: str


@tool("bench_lookup", description="Look an order up.")
def bench_lookup(args: Lookup, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"{args.order} shipped")


SCRIPT = [
    {"tool_calls": [{"name": "bench_lookup", "arguments": {"order": "A-1"}}], "tokens": 10, "cost": "0"},
    {"content": "A-1 shipped.", "tokens": 5, "cost": "0"},
]


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    answered = any(getattr(p, "part_kind", "") == "tool-return" for m in messages for p in getattr(m, "parts", []))
    if not answered:
        call = ToolCallPart("lookup", {"order": "A-1"}, tool_call_id="c1")
        return ModelResponse(parts=[call], usage=RequestUsage(input_tokens=5, output_tokens=5))
    return ModelResponse(parts=[TextPart("A-1 shipped.")], usage=RequestUsage(input_tokens=3, output_tokens=2))


def register() -> None:
    agent: Agent[None, str] = Agent(FunctionModel(_model), name="bench_pai")

    @agent.tool_plain
    def lookup(order: str) -> str:
        return f"{order} shipped"

    KeelAgent(agent, name="bench_pai")


def run_side(db: Database, client: Client, runner: Runner, side: str, requests: int) -> tuple[float, float, int]:
    """(CPU ms per step, wall ms per step, steps) of ``requests`` requests of one side, run to their end."""
    tag = uuid.uuid4().hex[:6]
    for i in range(requests):
        agent = client.create_agent(f"{side}-{tag}-{i}")
        if side == "keel":
            client.submit(agent.id, "r", {"prompt": "where is A-1?", "script": SCRIPT}, operation="plan")
        else:
            client.submit(agent.id, "r", {"prompt": "where is A-1?"}, operation="bench_pai")
    steps = 0
    cpu, wall = time.process_time(), time.perf_counter()
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:
        while True:
            due = [
                r[0]
                for r in conn.execute(
                    "SELECT key FROM jobs WHERE status IN ('pending', 'enqueued') ORDER BY created_at, key"
                ).fetchall()
            ]
            if not due:
                break
            for key in due:
                outcome = runner.run(key)
                if outcome.status != "succeeded":
                    raise RuntimeError(f"{side}: step {key} ended {outcome.status}: {outcome.detail}")
                steps += 1
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu * 1000 / steps, wall * 1000 / steps, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="requests per side and round (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be at least 1")
    if MISSING is not None:
        print(f"bench.pai_overhead needs the pydantic-ai extra: pip install -e '.[pydantic-ai]' ({MISSING})")
        return 2
    register()
    settings = Settings()
    server = database_url_for(settings)
    name = f"keel_bench_pai_{uuid.uuid4().hex[:8]}"
    admin = libpq_url(with_database(server, "postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = with_database(server, name)
        migrations.upgrade(url)
        db = Database(url, pool_size=4, audit_keys=audit_keys_for(settings))
        client = Client(db)
        runner = Runner(db, registry, worker="bench", lease=timedelta(seconds=60), rules=dict(DEFAULT_RULES))
        results: dict[str, list[tuple[float, float, int]]] = {"keel": [], "pai": []}
        run_side(db, client, runner, "keel", 10)  # warm both paths (imports, prepared statements) before measuring
        run_side(db, client, runner, "pai", 10)
        for r in range(args.rounds):
            for side in ("keel", "pai") if r % 2 == 0 else ("pai", "keel"):
                results[side].append(run_side(db, client, runner, side, args.requests))
                cpu, wall, steps = results[side][-1]
                print(f"round {r + 1}, {side}: {steps} steps, {cpu:.2f} ms CPU and {wall:.2f} ms wall per step")
        db.dispose()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    keel_cpu = statistics.median(c for c, _, _ in results["keel"])
    pai_cpu = statistics.median(c for c, _, _ in results["pai"])
    keel_wall = statistics.median(w for _, w, _ in results["keel"])
    pai_wall = statistics.median(w for _, w, _ in results["pai"])
    print(f"\nper step, median of {args.rounds} ({args.requests} requests of 3 steps a side):")
    print(f"  Keel's own loop      {keel_cpu:6.2f} ms CPU  {keel_wall:6.2f} ms wall")
    print(f"  Pydantic AI on Keel  {pai_cpu:6.2f} ms CPU  {pai_wall:6.2f} ms wall")
    print(
        f"  overhead: {pai_cpu - keel_cpu:+.2f} ms CPU per step ({pai_cpu / keel_cpu:.2f}x),"
        f" {pai_wall - keel_wall:+.2f} ms wall ({pai_wall / keel_wall:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``keel agent`` and the request commands: create and show agents; submit, run, approve, reject, cancel; state."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import click

from agents.cli.common import actor_option, emit, friendly, json_option, open_client, settings_or_exit


def state_text(state: Any) -> str:
    """An agent's state as the text ``keel agent show`` and ``keel state`` print."""
    budget_tokens = "unlimited" if state.budget_tokens is None else state.budget_tokens
    budget_cost = "unlimited" if state.budget_cost is None else state.budget_cost
    return "\n".join(
        [
            f"agent      {state.name} ({state.id})",
            f"phase      {state.phase}",
            f"revision   {state.revision}",
            f"request    {state.request_id or '-'}",
            f"deadlines  soft {state.soft_deadline or '-'}  hard {state.hard_deadline or '-'}",
            f"tokens     {state.spent_tokens} spent of {budget_tokens}",
            f"cost       {state.spent_cost} spent of {budget_cost}",
            f"priority   {state.priority}",
            f"updated    {state.updated_at}",
            *(
                [
                    f"approval   {state.pending_approval['tool']} {json.dumps(state.pending_approval['arguments'])}"
                    f" (approve with --revision {state.revision})"
                ]
                if state.pending_approval
                else []
            ),
            f"jobs       {len(state.pending_jobs) or 'none'} pending",
            *(
                f"  {j.key:<48} {j.status:<9} {j.queue:<14} attempts {j.attempts}"
                + (f"  last error: {j.last_error[:60]}" if j.last_error else "")
                for j in state.pending_jobs
            ),
        ]
    )


@click.group()
def agent() -> None:
    """Create and inspect agents."""


@agent.command("create")
@click.argument("name")
@click.option("--budget-tokens", type=click.IntRange(min=0), help="Token budget (default: unlimited).")
@click.option("--budget-cost", type=str, help="Cost budget, e.g. 2.50 (default: unlimited).")
@actor_option
@json_option
@friendly
def agent_create(name: str, budget_tokens: int | None, budget_cost: str | None, actor: str, as_json: bool) -> None:
    """Create an idle agent called NAME."""
    cost = None
    if budget_cost is not None:
        try:
            cost = Decimal(budget_cost)
        except ArithmeticError:
            raise click.BadParameter(f"{budget_cost!r} is not a number", param_hint="--budget-cost") from None
    with open_client() as client:
        state = client.create_agent(name, budget_tokens=budget_tokens, budget_cost=cost, actor=actor)
    emit(state, as_json, state_text(state))


@agent.command("show")
@click.argument("agent_ref", metavar="AGENT")
@json_option
@friendly
def agent_show(agent_ref: str, as_json: bool) -> None:
    """Show AGENT (id or name)."""
    with open_client() as client:
        state = client.get_state(agent_ref)
    emit(state, as_json, state_text(state))


@agent.command("list")
@json_option
@friendly
def agent_list(as_json: bool) -> None:
    """List all agents."""
    with open_client() as client:
        states = client.list_agents()
    lines = [f"{s.name:<24} {s.phase:<17} rev {s.revision:<6} {s.request_id or '-'}" for s in states]
    emit(states, as_json, "\n".join(lines) or "no agents")


@click.command("submit")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("request_id")
@click.option(
    "--input",
    "input_text",
    default="null",
    help='The request\'s input as JSON (plan: {"prompt": "...", "script": [...]}).',
)
@click.option("--revision", type=click.IntRange(min=0), help="Expected revision (rejected if stale).")
@actor_option
@json_option
@friendly
def submit(agent_ref: str, request_id: str, input_text: str, revision: int | None, actor: str, as_json: bool) -> None:
    """Start request REQUEST_ID on AGENT (idempotent on REQUEST_ID)."""
    try:
        value = json.loads(input_text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--input") from None
    with open_client() as client:
        state = client.submit(agent_ref, request_id, value, expected_revision=revision, actor=actor)
    emit(state, as_json, state_text(state))


@click.command("run")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("prompt")
@click.option("--request-id", help="Request id (default: a new one). Submitting the same id twice is a no-op.")
@click.option(
    "--script",
    "script_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSON array of scripted model replies (KEEL_LLM_PROVIDER=scripted; README: Scripted replies).",
)
@actor_option
@json_option
@friendly
def run(
    agent_ref: str, prompt: str, request_id: str | None, script_path: Path | None, actor: str, as_json: bool
) -> None:
    """Ask AGENT to work on PROMPT; workers and beat take it from there (see `keel state`)."""
    import uuid

    value: dict[str, Any] = {"prompt": prompt}
    if script_path is None and settings_or_exit().llm_provider == "scripted":
        raise click.UsageError("KEEL_LLM_PROVIDER is scripted: give the replies with --script, or use openai")
    if script_path is not None:
        try:
            value["script"] = json.loads(script_path.read_text())
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--script") from None
    with open_client() as client:
        state = client.submit(agent_ref, request_id or f"run-{uuid.uuid4().hex[:12]}", value, actor=actor)
    emit(state, as_json, state_text(state))


@click.command("state")
@click.argument("agent_ref", metavar="AGENT")
@json_option
@friendly
def state_cmd(agent_ref: str, as_json: bool) -> None:
    """Show AGENT's state: phase, revision, pending jobs and any call waiting for approval."""
    with open_client() as client:
        state = client.get_state(agent_ref)
    emit(state, as_json, state_text(state))


def _decision_command(name: str, help_text: str) -> click.Command:
    @click.command(name, help=help_text)
    @click.argument("agent_ref", metavar="AGENT")
    @click.option("--revision", type=click.IntRange(min=0), required=name != "cancel", help="Expected revision.")
    @click.option("--reason", help="Why (journaled).")
    @actor_option
    @json_option
    @friendly
    def command(agent_ref: str, revision: int | None, reason: str | None, actor: str, as_json: bool) -> None:
        with open_client() as client:
            if name == "approve":
                assert revision is not None
                state = client.approve(agent_ref, expected_revision=revision, actor=actor)
            elif name == "reject":
                assert revision is not None
                state = client.reject(agent_ref, expected_revision=revision, actor=actor, reason=reason)
            else:
                state = client.cancel(agent_ref, expected_revision=revision, actor=actor, reason=reason)
        emit(state, as_json, state_text(state))

    return command


approve = _decision_command("approve", "Approve AGENT's pending tool call (needs --revision).")
reject = _decision_command("reject", "Decline AGENT's pending tool call; it goes back to planning (needs --revision).")
cancel = _decision_command("cancel", "Stop AGENT's request in flight: it moves to failed.")

COMMANDS = (agent, submit, run, state_cmd, approve, reject, cancel)

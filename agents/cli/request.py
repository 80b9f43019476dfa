"""``keel request``: one request's outcome (answer, failure, spend, side effects) and its conversation."""

from __future__ import annotations

import json
import re
from typing import Any

import click

from agents.cli.common import decimal_text, emit, friendly, json_option, open_client
from agents.core.errors import quoted
from models.schemas import RequestOutcome

#: Control characters but tab and newline: a model's or a handler's text must not move the terminal's cursor.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """Text from a model, a handler or a receiver as a terminal may print it: control characters escaped, every line
    after the first indented under the value column."""
    safe = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
    return safe.replace("\n", "\n" + " " * 11)


def outcome_lines(outcome: RequestOutcome) -> list[str]:
    """A request's outcome as the CLI prints it, one fact a line (``keel request show``, ``keel run --wait``,
    ``keel wait``, ``keel state``)."""
    lines = [f"outcome    {outcome.request_id}: {outcome.phase} at revision {outcome.revision}"]
    if outcome.answer is not None:
        text = outcome.answer if isinstance(outcome.answer, str) else json.dumps(outcome.answer, default=str)
        lines.append(f"answer     {shown(text)}")
    if outcome.failure is not None:
        failed = outcome.failure
        lines.append(f"failure    {shown(failed.reason)}")
        if failed.job is not None:
            said = shown(failed.error or "-")
            lines.append(f"           step {failed.job} ({failed.error_class or '-'}): {said}")
    if outcome.pruned:
        lines.append("spent      not known: its steps were pruned by retention (KEEL_JOBS_RETENTION_DAYS)")
    else:
        lines.append(f"spent      {outcome.tokens} tokens, cost {decimal_text(outcome.cost)}")
    if outcome.failed_attempts:
        said = ", ".join(f"{kind} {n}" for kind, n in outcome.failed_attempts.items())
        lines.append(f"failed     {said} (attempts that failed, by error class: `keel job KEY` for each step)")
    for effect in outcome.side_effects:
        where = effect.external_url or effect.destination
        if effect.status == "dead":
            why = shown(effect.last_error or "no error recorded")
            lines.append(f"effect     {effect.channel} {where}: DEAD ({why})")
        elif effect.last_error and effect.status != "sent":  # not through yet: what the last attempt met
            why = shown(effect.last_error)
            lines.append(f"effect     {effect.channel} {where}: {effect.status} (attempt {effect.attempts}: {why})")
        else:
            lines.append(f"effect     {effect.channel} {where}: {effect.status}")
    if outcome.dead:
        keys = " ".join(e.key for e in outcome.dead)
        lines.append(f"           {len(outcome.dead)} side effect(s) never arrived: `keel outbox retry KEY` ({keys})")
    return lines


def _request_of(client: Any, agent_ref: str, request_id: str | None) -> tuple[Any, str]:
    """The agent to read for (a deleted one too, given a request id: its journal and requests stay) and the request:
    the one given, or the agent's current or last one."""
    if request_id is not None:
        return agent_ref, request_id
    state = client.get_state(agent_ref)
    if state.request_id is None:
        raise click.ClickException(f"agent {quoted(state.name)} has had no request yet")
    return state.id, state.request_id


@click.group("request")
def request() -> None:
    """One request: how it stands or ended, and its conversation."""


@request.command("show")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("request_id", required=False)
@json_option
@friendly
def request_show(agent_ref: str, request_id: str | None, as_json: bool) -> None:
    """AGENT's request REQUEST_ID (default: its current or last one): phase, the answer when done, why it failed
    when failed, what its steps spent, and its Slack/GitHub side effects with their delivery (dead ones flagged)."""
    with open_client(writes=False) as client:
        agent, request_id = _request_of(client, agent_ref, request_id)
        outcome = client.outcome(agent, request_id)
    emit(outcome, as_json, "\n".join(outcome_lines(outcome)))


@request.command("conversation")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("request_id", required=False)
@json_option
@friendly
def request_conversation(agent_ref: str, request_id: str | None, as_json: bool) -> None:
    """The conversation of AGENT's request REQUEST_ID (default: its current or last one) as a person reads it: the
    prompt, the model's replies (and reasoning) with the tools they called, and the tools' results."""
    with open_client(writes=False) as client:
        agent, request_id = _request_of(client, agent_ref, request_id)
        said = client.conversation(agent, request_id)
    lines: list[str] = []
    for message in said:
        if message.get("reasoning"):
            lines.append(f"{message['role']:<10} (reasoning) {shown(message['reasoning'])}")
        if message.get("content"):
            lines.append(f"{message['role']:<10} {shown(message['content'])}")
        for call in message.get("calls") or ():
            lines.append(
                f"{message['role']:<10} calls {call.get('tool')} {json.dumps(call.get('arguments'), sort_keys=True)}"
            )
    emit({"request_id": request_id, "messages": said}, as_json, "\n".join(lines) or "(no conversation recorded)")


COMMANDS = (request,)

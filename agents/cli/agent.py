"""``keel agent`` and the request commands: create and show agents; submit, run, approve, reject, cancel; state."""

from __future__ import annotations

import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import click

from agents.cli.common import (
    MAX_WAIT_SECONDS,
    Seconds,
    actor_option,
    command_line,
    count,
    decimal_text,
    emit,
    friendly,
    json_option,
    json_value,
    open_client,
    text_value,
    timestamp,
)
from agents.cli.request import outcome_lines
from agents.cli.watch import EXIT_TIMEOUT, outcome_json, outcome_text, wait_for_rest
from agents.core.commands import MAX_BIGINT
from agents.core.errors import BadCursor, RequestNotFound, StaleRevision, quoted
from agents.core.phases import RESTING, Phase

#: The most agents one page of ``keel agent list`` shows (``--after`` pages on).
MAX_PAGE = 1000
#: A revision, a budget: what a bigint column holds.
REVISION = click.IntRange(0, MAX_BIGINT)


def state_text(state: Any) -> str:
    """An agent's state as the text ``keel agent show`` and ``keel state`` print."""
    budget_tokens = "unlimited" if state.budget_tokens is None else count(state.budget_tokens)
    budget_cost = "unlimited" if state.budget_cost is None else decimal_text(state.budget_cost)
    return "\n".join(
        [
            f"agent      {state.name} ({state.id})" + ("  ARCHIVED" if state.archived_at else ""),
            f"phase      {state.phase}",
            f"revision   {state.revision}",
            f"request    {state.request_id or '-'}",
            f"deadlines  soft {text_value(state.soft_deadline)}  hard {text_value(state.hard_deadline)}",
            f"tokens     {count(state.spent_tokens)} spent of {budget_tokens}",
            f"cost       {decimal_text(state.spent_cost)} spent of {budget_cost}",
            f"priority   {state.priority}",
            f"created    {timestamp(state.created_at)}",
            f"updated    {timestamp(state.updated_at)}",
            *([f"archived   {timestamp(state.archived_at)}"] if state.archived_at else []),
            *(
                [
                    f"approval   {state.pending_approval['tool']} {text_value(state.pending_approval['arguments'])}"
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
@click.option("--budget-tokens", type=REVISION, help="Token budget (default: unlimited).")
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
            raise click.BadParameter(f"{quoted(budget_cost)} is not a number", param_hint="--budget-cost") from None
    with open_client() as client:
        state = client.create_agent(name, budget_tokens=budget_tokens, budget_cost=cost, actor=actor)
    emit(state, as_json, state_text(state))


@agent.command("show")
@click.argument("agent_ref", metavar="AGENT")
@json_option
@friendly
def agent_show(agent_ref: str, as_json: bool) -> None:
    """Show AGENT (id or name)."""
    with open_client(writes=False) as client:
        state = client.get_state(agent_ref)
    emit(state, as_json, state_text(state))


@agent.command("list")
@click.option(
    "--phase",
    "phases",
    multiple=True,
    type=click.Choice([p.value for p in Phase]),
    help="Only agents in this phase (repeat for several).",
)
@click.option("--archived", is_flag=True, help="List the archived agents instead of those in use.")
@click.option(
    "--limit", type=click.IntRange(1, MAX_PAGE), default=50, show_default=True, help="At most this many (a page)."
)
@click.option("--after", "cursor", metavar="CURSOR", help="The page after this cursor (printed as 'next').")
@json_option
@friendly
def agent_list(phases: tuple[str, ...], archived: bool, limit: int, cursor: str | None, as_json: bool) -> None:
    """List agents, newest first, a page at a time."""
    with open_client(writes=False) as client:
        try:
            page = client.list_agents(phases=phases, archived=archived, limit=limit, after=cursor)
        except BadCursor as exc:
            raise click.BadParameter(str(exc), param_hint="--after") from None
    if not page.agents:
        emit(page, as_json, "no agents")
        return
    names = max(len("NAME"), *(len(s.name) for s in page.agents))
    lines = [f"{'NAME':<{names}}  {'PHASE':<16}  {'REV':>5}  {'REQUEST':<24}  {'CREATED':<27}  UPDATED"]
    lines += [
        f"{s.name:<{names}}  {s.phase:<16}  {s.revision:>5}  {s.request_id or '-':<24}  {timestamp(s.created_at):<27}"
        f"  {timestamp(s.updated_at)}"
        for s in page.agents
    ]
    if page.next is not None:  # the whole command for the next page: the same filters, the same page size
        words = ["keel", "agent", "list", *(w for phase in phases for w in ("--phase", phase))]
        words += [*(["--archived"] if archived else []), "--limit", str(limit), "--after", page.next]
        lines.append(f"next: {command_line(*words)}")
    emit(page, as_json, "\n".join(lines))


@agent.command("archive")
@click.argument("agent_ref", metavar="AGENT")
@actor_option
@json_option
@friendly
def agent_archive(agent_ref: str, actor: str, as_json: bool) -> None:
    """Archive AGENT: it refuses new requests and `keel agent list` leaves it out; its journal stays, verifiable.

    Only while it rests (idle, done or failed). `keel agent unarchive` puts it back in use; `keel agent delete`
    removes an archived agent for good."""
    with open_client() as client:
        state = client.archive(agent_ref, actor=actor)
    emit(state, as_json, state_text(state))


@agent.command("unarchive")
@click.argument("agent_ref", metavar="AGENT")
@actor_option
@json_option
@friendly
def agent_unarchive(agent_ref: str, actor: str, as_json: bool) -> None:
    """Put an archived AGENT back in use."""
    with open_client() as client:
        state = client.unarchive(agent_ref, actor=actor)
    emit(state, as_json, state_text(state))


@agent.command("delete")
@click.argument("agent_ref", metavar="AGENT")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed when stdin is not a terminal).")
@click.option("--revision", type=REVISION, help="Expected revision (rejected if stale).")
@click.option("--reason", help="Why (journaled).")
@actor_option
@json_option
@friendly
def agent_delete(
    agent_ref: str, yes: bool, revision: int | None, reason: str | None, actor: str, as_json: bool
) -> None:
    """Delete an archived AGENT for good: its row and schedules go and its name is free again.

    Archive it first (`keel agent archive`; only an agent at rest can be). Its journal is kept and still verified
    (`keel journal --agent ID`), and its request ids stay its own. Asks for confirmation unless --yes."""
    with open_client() as client:
        state = client.get_state(agent_ref)
        deletable = state.archived_at is not None and Phase(state.phase) in RESTING
        if not yes and deletable:  # an agent Keel would refuse anyway is refused without asking first
            if not sys.stdin.isatty():
                raise click.UsageError(
                    f"stdin is not a terminal, so nobody can confirm: add --yes to delete agent {state.name!r}"
                )
            if not click.confirm(
                f"Delete agent {state.name!r} ({state.id}, {state.phase}, revision {state.revision})? Its row and"
                " schedules go and its name is free again; its journal is kept"
            ):
                click.echo(f"keel: not deleted: agent {state.name!r} is as it was", err=True)
                sys.exit(1)
        tombstone = client.delete_agent(state.id, actor=actor, expected_revision=revision, reason=reason)
    emit(
        tombstone,
        as_json,
        f"deleted agent {tombstone.name!r} ({tombstone.id}) at {timestamp(tombstone.deleted_at)} by"
        f" {tombstone.deleted_by}; its journal is kept: keel journal --agent {tombstone.id}",
    )


timeout_option = click.option(
    "--timeout",
    type=Seconds(MAX_WAIT_SECONDS),
    metavar="SECONDS",
    help="Stop waiting after this many seconds (exit 5; the request goes on).",
)


def _wait_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = timeout_option(fn)
    fn = click.option(
        "--follow",
        is_flag=True,
        help="Show the request's progress (phase, revision, steps) until it rests; implies --wait.",
    )(fn)
    return click.option(
        "--wait",
        is_flag=True,
        help="Wait until the request rests; exit 0 done, 3 failed, 4 waiting for approval, 5 timed out.",
    )(fn)


def _check_wait(wait: bool, follow: bool, timeout: float | None) -> None:
    """Refuse a meaningless combination before anything is submitted."""
    if timeout is not None and not (wait or follow):
        raise click.UsageError("--timeout needs --wait or --follow")


def _finish(
    client: Any,
    state: Any,
    request_id: str,
    *,
    wait: bool,
    follow: bool,
    timeout: float | None,
    as_json: bool,
) -> None:
    """Print the state now, or wait (and follow) until request ``request_id`` rests and exit with its outcome: the
    agent's state if the request is still its current one, else how the request ended."""
    if not (wait or follow):
        emit(state, as_json, state_text(state))
        return
    status, last = wait_for_rest(
        client, state, request_id, follow=follow, as_json=as_json, timeout=timeout, details=False
    )
    agent = client.get_state(state.id)
    if status == EXIT_TIMEOUT:
        again = command_line("keel", "wait", agent.name, request_id)
        click.echo(
            f"keel: timed out after {timeout:g}s: agent {quoted(agent.name)} is {last.to_phase} at revision"
            f" {last.revision} on request {quoted(request_id)}; the request goes on (wait again with `{again}`, or"
            f" see `{command_line('keel', 'state', agent.name)}`)",
            err=True,
        )
    if not (follow and as_json):
        outcome = client.outcome(agent.id, request_id)
        if agent.request_id == request_id:
            shown, text = agent.model_dump(mode="json"), state_text(agent)
        else:
            shown, text = outcome_json(agent, last), outcome_text(agent, last)
        emit({**shown, "outcome": outcome.model_dump(mode="json")}, as_json, "\n".join([text, *outcome_lines(outcome)]))
    sys.exit(status)


@click.command("submit")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("request_id")
@click.option(
    "--input",
    "input_text",
    metavar="JSON",
    help='The request\'s input as JSON (required; plan: {"prompt": "...", "script": [...]}).',
)
@click.option(
    "--operation",
    default="plan",
    show_default=True,
    help="The operation the request starts with: Keel's own loop (plan), or one a handler or an agent"
    " (KeelAgent, KeelGraph) registered in a KEEL_IMPORTS module.",
)
@click.option("--revision", type=REVISION, help="Expected revision (rejected if stale).")
@actor_option
@_wait_options
@json_option
@friendly
def submit(
    agent_ref: str,
    request_id: str,
    input_text: str | None,
    operation: str,
    revision: int | None,
    actor: str,
    wait: bool,
    follow: bool,
    timeout: float | None,
    as_json: bool,
) -> None:
    """Start request REQUEST_ID on AGENT (idempotent on REQUEST_ID: submitting it again as it was changes nothing,
    and with --wait waits for that request)."""
    _check_wait(wait, follow, timeout)
    if input_text is None:  # no default: a forgotten --input is not the same as an input of null
        example = (
            """'{"prompt": "hi"}'""" if operation == "plan" else "'{...}' (what the operation takes; '{}' for none)"
        )
        raise click.UsageError(f"--input is required: the request's input as JSON, e.g. --input {example}")
    value = json_value("--input", input_text)
    with open_client() as client:
        state = client.submit(
            agent_ref, request_id, value, expected_revision=revision, actor=actor, operation=operation
        )
        _finish(client, state, request_id, wait=wait, follow=follow, timeout=timeout, as_json=as_json)


@click.command("run")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("prompt")
@click.option("--request-id", help="Request id (default: a new one). Submitting the same id twice is a no-op.")
@click.option(
    "--script",
    "script_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSON array of scripted model replies (KEEL_LLM_PROVIDER=scripted; without one, the stand-in model answers).",
)
@actor_option
@_wait_options
@json_option
@friendly
def run(
    agent_ref: str,
    prompt: str,
    request_id: str | None,
    script_path: Path | None,
    actor: str,
    wait: bool,
    follow: bool,
    timeout: float | None,
    as_json: bool,
) -> None:
    """Ask AGENT to work on PROMPT; workers and beat take it from there (see `keel state`, or add --follow)."""
    import uuid

    _check_wait(wait, follow, timeout)
    value: dict[str, Any] = {"prompt": prompt}
    if script_path is not None:
        value["script"] = json_value("--script", script_path.read_text())
    with open_client() as client:
        request_id = request_id or f"run-{uuid.uuid4().hex[:12]}"
        state = client.submit(agent_ref, request_id, value, actor=actor)
        _finish(client, state, request_id, wait=wait, follow=follow, timeout=timeout, as_json=as_json)


@click.command("wait")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("request_id", required=False)
@click.option("--follow", is_flag=True, help="Show the request's progress (phase, revision, steps) meanwhile.")
@timeout_option
@json_option
@friendly
def wait_cmd(agent_ref: str, request_id: str | None, follow: bool, timeout: float | None, as_json: bool) -> None:
    """Wait until AGENT's request REQUEST_ID rests, without submitting anything (default: the agent's current or
    last request). Exit 0 done, 3 failed, 4 waiting for approval, 5 past --timeout (the request goes on)."""
    with open_client(writes=False) as client:
        state = client.get_state(agent_ref)
        if request_id is None:
            if state.request_id is None:
                raise click.ClickException(f"agent {quoted(state.name)} has had no request yet: nothing to wait for")
            request_id = state.request_id
        _finish(client, state, request_id, wait=True, follow=follow, timeout=timeout, as_json=as_json)


@click.command("state")
@click.argument("agent_ref", metavar="AGENT")
@json_option
@friendly
def state_cmd(agent_ref: str, as_json: bool) -> None:
    """Show AGENT's state: phase, revision, pending jobs and any call waiting for approval."""
    with open_client(writes=False) as client:
        state = client.get_state(agent_ref)
        dead = client.dead_messages(state.id)
        try:
            outcome = None if state.request_id is None else client.outcome(state.id, state.request_id)
        except RequestNotFound:  # its journal's month was archived
            outcome = None
    lines = [state_text(state)]
    if dead:
        lines.append(
            f"dead       {dead} side effect(s) never arrived: keel outbox list --status dead --agent {state.name},"
            " then keel outbox retry KEY"
        )
    shown: dict[str, Any] = {**state.model_dump(mode="json"), "dead_messages": dead}
    if outcome is not None:
        shown["outcome"] = outcome.model_dump(mode="json")
        lines.extend(outcome_lines(outcome))
    emit(shown, as_json, "\n".join(lines))


def _edited_arguments(text: str | None) -> dict[str, Any] | None:
    """``--arguments JSON``: the edited arguments an approval runs the call with."""
    if text is None:
        return None
    value = json_value("--arguments", text)
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object of the tool's arguments", param_hint="--arguments")
    return value


def _decision_command(name: str, help_text: str) -> click.Command:
    @click.command(name, help=help_text)
    @click.argument("agent_ref", metavar="AGENT")
    @click.option(
        "--revision",
        type=REVISION,
        required=name != "cancel",
        help="The revision you decided on: `keel state AGENT` and `keel approvals` show it (refused if stale).",
    )
    @click.option("--reason", help="Why (journaled).", hidden=name == "approve")
    @click.option(
        "--arguments",
        "arguments_json",
        metavar="JSON",
        hidden=name != "approve",
        help="Edit the call first: the arguments (a JSON object) it runs with instead; checked against the tool.",
    )
    @actor_option
    @json_option
    @friendly
    def command(
        agent_ref: str, revision: int | None, reason: str | None, arguments_json: str | None, actor: str, as_json: bool
    ) -> None:
        if arguments_json is not None and name != "approve":
            raise click.UsageError("--arguments is for approve only")
        arguments = _edited_arguments(arguments_json)
        with open_client() as client:
            try:
                if name == "approve":
                    assert revision is not None
                    state = client.approve(agent_ref, expected_revision=revision, actor=actor, arguments=arguments)
                elif name == "reject":
                    assert revision is not None
                    state = client.reject(agent_ref, expected_revision=revision, actor=actor, reason=reason)
                else:
                    state = client.cancel(agent_ref, expected_revision=revision, actor=actor, reason=reason)
            except StaleRevision as exc:
                # Not a number to retry with blindly: what waits at the new revision may be another call.
                look = command_line("keel", "state", agent_ref)
                raise click.ClickException(f"{exc}: nothing was done; see what it is at now (`{look}`) first") from None
        emit(state, as_json, state_text(state))

    return command


approve = _decision_command("approve", "Approve AGENT's pending tool call (needs --revision).")
reject = _decision_command("reject", "Decline AGENT's pending tool call; it goes back to planning (needs --revision).")
cancel = _decision_command("cancel", "Stop AGENT's request in flight: it moves to failed.")

COMMANDS = (agent, submit, run, wait_cmd, state_cmd, approve, reject, cancel)

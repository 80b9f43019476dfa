"""Following what happens: the journal as text lines, ``keel journal --follow``, and ``keel wait`` / ``--wait`` /
``--follow`` until a request rests, exiting with how it ended; a Rich live display on a terminal, plain lines
elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import click

from agents.cli.common import count, text_value, timestamp, to_json
from agents.core.errors import quoted

#: Exit statuses of ``--wait`` / ``--follow`` (1 and 2 stay Keel's and click's: an error, a usage error).
EXIT_DONE, EXIT_FAILED, EXIT_WAITING_APPROVAL, EXIT_TIMEOUT = 0, 3, 4, 5
OUTCOMES = {"done": EXIT_DONE, "failed": EXIT_FAILED, "waiting_approval": EXIT_WAITING_APPROVAL}
POLL_SECONDS = 0.25


def journal_header(first: str = "seq") -> str:
    return f"{first:>4}  {'at':<27}  {'kind':<10} {'event':<16} {'from -> to':<30} {'rev':>4}  {'decision':<22} actor"


def journal_lines(event: Any, agent_name: str | None = None) -> list[str]:
    """One journal event as text: a line of the table, then, for a rejection (or every event with ``details``),
    its details — a rejection's error text first."""
    move = f"{event.from_phase} -> {event.to_phase}" if event.from_phase != event.to_phase else str(event.to_phase)
    who = f"{agent_name}#{event.seq}" if agent_name is not None else str(event.seq)
    return [
        f"{who:>4}  {timestamp(event.at):<27}  {event.kind:<10} {event.event:<16} {move:<30} {event.revision:>4}  "
        f"{event.decision:<22} {event.actor}"
    ]


def details_lines(event: Any) -> list[str]:
    """A journal event's details, indented under its line: the error text of a rejection on a line of its own."""
    details = dict(event.details)
    lines = []
    if "error" in details:
        lines.append(f"      error: {details.pop('error')}")
    if details:
        lines.append(f"      details: {text_value(details)}")
    return lines


def journal_text(events: Sequence[Any], *, names: dict[Any, str] | None = None, details: bool = False) -> str:
    """Journal events as a table: agent name and seq when ``names`` is given (events of several agents)."""
    lines = [journal_header("seq" if names is None else "agent#seq")]
    for event in events:
        lines += journal_lines(event, None if names is None else names.get(event.agent_id, str(event.agent_id)))
        if details or event.kind == "rejected":
            lines += details_lines(event)
    return "\n".join(lines)


def print_events(
    events: Iterable[Any], *, as_json: bool, details: bool, name_of: Callable[[Any], str] | None = None
) -> None:
    """Print events as they come: JSON Lines with ``--json``, else text lines (colored on a terminal)."""
    console = _console()
    for event in events:
        if as_json:
            click.echo(to_json(event, indent=None))
            continue
        lines = journal_lines(event, None if name_of is None else name_of(event.agent_id))
        if details or event.kind == "rejected":
            lines += details_lines(event)
        if console is None:
            click.echo("\n".join(lines))
        else:
            style = {"rejected": "red", "suppressed": "yellow", "operator": "cyan"}.get(event.kind)
            for line in lines:
                console.print(line, style=style, markup=False, highlight=False, soft_wrap=True)
        sys.stdout.flush()


def _console() -> Any:
    """A Rich console when stdout is a terminal, else None (plain lines)."""
    if not sys.stdout.isatty():
        return None
    from rich.console import Console

    return Console()


def last_transition(events: Iterable[Any], agent_id: Any, request_id: str) -> Any:
    """The request's last transition among ``events``: where the request itself stands (its phase and revision),
    whatever its agent has done since."""
    last = None
    for event in events:
        if event.kind == "transition" and event.agent_id == agent_id and event.request_id == request_id:
            last = event
    return last


def wait_for_rest(
    client: Any,
    state: Any,
    request_id: str,
    *,
    follow: bool,
    as_json: bool,
    timeout: float | None,
    details: bool,
) -> tuple[int, Any]:
    """Wait until the request rests or ``timeout`` passes, showing its progress with ``follow``. Returns the exit
    status and the request's last transition: read from its own events, so an older request's outcome is its own."""
    history = client.journal(agent_id=state.id, request_id=request_id)
    last = last_transition(history, state.id, request_id)
    if last is None:
        raise click.ClickException(f"agent {quoted(state.name)} has no request {quoted(request_id)}")
    seen = {state.id: max(e.seq for e in history)}
    deadline = None if timeout is None else time.monotonic() + timeout
    # The live view shows the agent: only when this request is the one it works on.
    current = state.request_id == request_id
    live = _live(state) if follow and current and not as_json and sys.stdout.isatty() else None
    if follow and live is None:
        print_events(history, as_json=as_json, details=details)
    try:
        while True:
            if last.to_phase in OUTCOMES:
                return OUTCOMES[last.to_phase], last
            if deadline is not None and time.monotonic() >= deadline:
                return EXIT_TIMEOUT, last
            time.sleep(POLL_SECONDS)
            new = client.journal_after(seen, agent_id=state.id)
            for event in new:
                seen[event.agent_id] = event.seq
            last = last_transition(new, state.id, request_id) or last
            if follow and live is None:
                print_events([e for e in new if e.request_id == request_id], as_json=as_json, details=details)
            if live is not None:
                state = client.get_state(state.id)
                live.update(_panel(state, client.request_jobs(state.id, request_id)), refresh=True)
    finally:
        if live is not None:
            live.update(_panel(client.get_state(state.id), client.request_jobs(state.id, request_id)), refresh=True)
            live.stop()


def outcome_text(agent: Any, last: Any) -> str:
    """How an older request ended, for an agent that has moved on since."""
    return "\n".join(
        [
            f"request    {last.request_id}: {last.to_phase} at revision {last.revision}"
            f" ({last.event}, {last.decision}, {timestamp(last.at)})",
            f"agent      {agent.name} ({agent.id}) has moved on: request {agent.request_id or '-'} is {agent.phase}"
            f" at revision {agent.revision}",
        ]
    )


def outcome_json(agent: Any, last: Any) -> dict[str, Any]:
    """How an older request ended (``--json``): the request's fields, and where its agent is now."""
    return {
        "request_id": last.request_id,
        "phase": last.to_phase,
        "revision": last.revision,
        "event": last.event,
        "decision": last.decision,
        "at": last.at,
        "agent": {
            "id": agent.id,
            "name": agent.name,
            "request_id": agent.request_id,
            "phase": agent.phase,
            "revision": agent.revision,
        },
    }


def _live(state: Any) -> Any:
    from rich.live import Live

    live = Live(_panel(state, ()), auto_refresh=False)
    live.start(refresh=True)
    return live


def _panel(state: Any, jobs: Sequence[Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    colors = {"done": "green", "failed": "red", "waiting_approval": "yellow"}
    head = Text.assemble(
        (f"{state.name}", "bold"),
        f"  request {state.request_id}  ",
        (state.phase, colors.get(state.phase, "cyan")),
        f"  revision {state.revision}  tokens {count(state.spent_tokens)}  cost {text_value(state.spent_cost)}",
    )
    steps = Table(box=None, pad_edge=False)
    for column in ("step", "status", "attempts", "last error"):
        steps.add_column(column)
    for job in jobs:
        steps.add_row(job.key, job.status, str(job.attempts), (job.last_error or "")[:80])
    parts: list[Any] = [head, steps]
    if state.pending_approval:
        call = state.pending_approval
        parts.append(
            Text(
                f"waiting for approval: {call['tool']} {text_value(call['arguments'])}"
                f" (keel approve {state.name} --revision {state.revision})",
                style="yellow",
            )
        )
    return Group(*parts)

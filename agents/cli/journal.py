"""``keel journal``: who did what to which agent, and what was decided, a page at a time or followed."""

from __future__ import annotations

from typing import Any

import click

from agents.cli.common import command_line, emit, friendly, json_option, open_client
from agents.cli.watch import journal_header, journal_text, print_events
from agents.core.errors import BadCursor

#: Events one page of ``keel journal`` shows by default, and at most (``--after`` pages on).
JOURNAL_PAGE = 50
MAX_JOURNAL_PAGE = 1000


@click.command("journal")
@click.option("--agent", "agent_ref", help="Only this agent (id or name).")
@click.option("--request-id", help="Only this request.")
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_JOURNAL_PAGE),
    help=f"At most this many events, a page (default {JOURNAL_PAGE}; not with --follow).",
)
@click.option(
    "--after", "cursor", metavar="CURSOR", help="The page after this cursor (printed as 'next'): older events."
)
@click.option("--details", is_flag=True, help="Show every event's details (rejections always show theirs).")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Print every event oldest first, then new events as they commit, until Ctrl-C (with --json: one JSON"
    " object per line).",
)
@json_option
@friendly
def journal_cmd(
    agent_ref: str | None,
    request_id: str | None,
    limit: int | None,
    cursor: str | None,
    details: bool,
    follow: bool,
    as_json: bool,
) -> None:
    """Show journal events, newest first, a page at a time: who did what to which agent, and what was decided."""
    if follow and (limit is not None or cursor is not None):
        raise click.UsageError(f"{'--limit' if limit is not None else '--after'} and --follow do not go together")
    with open_client(writes=False) as client:
        if follow:
            names: dict[Any, str] = {}

            def name_of(agent_id: Any) -> str:
                if agent_id not in names:
                    names.update(client.agent_names([agent_id]))
                return names.get(agent_id, str(agent_id))

            events = client.follow_journal(agent_id=agent_ref, request_id=request_id)  # an unknown agent: here
            if not as_json:
                click.echo(journal_header("seq" if agent_ref else "agent#seq"))
            try:
                print_events(
                    events,
                    as_json=as_json,
                    details=details,
                    name_of=None if agent_ref else name_of,
                )
            except KeyboardInterrupt:
                pass  # Ctrl-C ends a follow: that is how it is meant to stop
            return
        size = limit or JOURNAL_PAGE
        try:
            page = client.journal_page(agent_id=agent_ref, request_id=request_id, limit=size, after=cursor)
        except BadCursor as exc:
            raise click.BadParameter(str(exc), param_hint="--after") from None
        several = agent_ref is None and len({e.agent_id for e in page.events}) > 1
        agent_names = client.agent_names(e.agent_id for e in page.events) if several else None
    if as_json:
        emit(page, as_json, "")
        return
    text = journal_text(list(page.events), names=agent_names, details=details) if page.events else "no events"
    if page.next is not None:  # the whole command for the next page: the same filters, the same page size
        words = ["keel", "journal", *(["--agent", agent_ref] if agent_ref else [])]
        words += [*(["--request-id", request_id] if request_id else []), "--limit", str(size), "--after", page.next]
        text += f"\nnext: {command_line(*words)}"
    emit(None, False, text)


COMMANDS = (journal_cmd,)

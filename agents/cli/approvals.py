"""``keel approvals``: the inbox, every call waiting for approval across agents, oldest first."""

from __future__ import annotations

from datetime import timedelta

import click

from agents.cli.common import emit, friendly, json_option, open_client, text_value, timestamp
from agents.runtime.approvals import waited_text


@click.command("approvals")
@click.option("--tool", help="Only calls to this tool.")
@click.option("--min-age", type=click.FloatRange(0), metavar="SECONDS", help="Only calls waiting at least this long.")
@click.option("--agent-prefix", help="Only agents whose name starts with this.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True, help="At most this many.")
@click.option("--cursor", help="The `next` of the previous page (printed after a full page).")
@json_option
@friendly
def approvals(
    tool: str | None, min_age: float | None, agent_prefix: str | None, limit: int, cursor: str | None, as_json: bool
) -> None:
    """Every call waiting for approval, oldest first: agent, revision (approve with --revision), tool, how long
    it has waited, arguments."""
    with open_client(writes=False) as client:
        page = client.approvals(
            tool=tool,
            min_age=None if min_age is None else timedelta(seconds=min_age),
            agent_prefix=agent_prefix,
            limit=limit,
            after=cursor,
        )
    rows = [
        (a.agent, f"r{a.revision}", a.tool, waited_text(a.waited_seconds), timestamp(a.since), text_value(a.arguments))
        for a in page.approvals
    ]
    header = ("agent", "revision", "tool", "waiting", "since", "arguments")
    # Each column as wide as its widest cell, under its header; the arguments last, cut at 80 characters.
    width = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(5)] if rows else []
    lines = [
        " ".join(f"{cell:<{width[i]}}" for i, cell in enumerate(row[:5])) + f"  {row[5][:80]}"
        for row in ([header, *rows] if rows else [])
    ] or ["no calls are waiting for approval"]
    if page.next:
        lines.append(f"more: keel approvals --cursor {page.next}")
    emit(page, as_json, "\n".join(lines))


COMMANDS = (approvals,)

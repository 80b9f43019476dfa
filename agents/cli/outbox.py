"""``keel outbox``: list, show, retry and count the Slack and GitHub messages."""

from __future__ import annotations

import click

from agents.cli.common import (
    actor_option,
    emit,
    fields_text,
    friendly,
    json_option,
    open_client,
    percent,
    rounded,
)
from agents.core.commands import MAX_BIGINT
from agents.core.errors import quoted


@click.group()
def outbox() -> None:
    """Slack and GitHub messages waiting for, or done with, the relay."""


@outbox.command("list")
@click.option("--status", type=click.Choice(["pending", "sending", "sent", "dead"]), help="Only this status.")
@click.option("--limit", type=click.IntRange(1, MAX_BIGINT), default=50, show_default=True, help="At most this many.")
@click.option("--agent", "agent_ref", metavar="AGENT", help="Only this agent's messages (its id or name).")
@json_option
@friendly
def outbox_list(status: str | None, limit: int, agent_ref: str | None, as_json: bool) -> None:
    """Newest messages first (`--status dead --agent AGENT`: the agent's side effects that never arrived)."""
    from models.outbox_sql import list_messages, page_messages

    with open_client(writes=False) as client:
        if agent_ref is None:
            rows = list_messages(client.db, status, limit)
        else:
            agent_id = client.agent_row(agent_ref).id
            rows = page_messages(
                client.db,
                status=status,
                channel=None,
                before_seq=None,
                limit=limit,
                name_prefix=None,
                agent_id=agent_id,
            )
    columns = ("key", "channel", "destination", "status", "attempts")
    # Each column as wide as its widest cell (keys run long: an agent's request key leads them), under its header.
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns} if rows else {}
    header = " ".join(f"{c:<{width[c]}}" for c in columns) + "  last error" if rows else ""
    lines = [
        " ".join(f"{r[c]!s:<{width[c]}}" for c in columns) + (f"  {r['last_error'][:60]}" if r["last_error"] else "")
        for r in rows
    ]
    emit({"messages": rows}, as_json, "\n".join([header, *lines]) if lines else "no messages")


@outbox.command("show")
@click.argument("key")
@json_option
@friendly
def outbox_show(key: str, as_json: bool) -> None:
    """One message: status, attempts, last error, the receiver's id."""
    from models.outbox_sql import message_row

    with open_client(writes=False) as client:
        row = message_row(client.db, key)
    if row is None:
        raise click.ClickException(f"no outbox message has the key {quoted(key)}")
    emit(row, as_json, fields_text(row))


@outbox.command("retry")
@click.argument("key")
@actor_option
@friendly
def outbox_retry(key: str, actor: str) -> None:
    """Send a dead message again (journaled with --actor); it reconciles first if it may have arrived."""
    from agents.outbox.relay import retry_dead

    with open_client() as client:
        retry_dead(client.db, key, actor=actor)
    click.echo(f"{key}: dead -> pending")


@outbox.command("stats")
@json_option
@friendly
def outbox_stats(as_json: bool) -> None:
    """KPIs: deliveries per key (must be 1), duplicate rate, reconciled and dead counts."""
    from models.outbox_sql import stats

    with open_client(writes=False) as client:
        data = stats(client.db)
    text = fields_text({**data, "duplicate_rate": percent(data["duplicate_rate"])})
    emit({**data, "duplicate_rate": rounded(data["duplicate_rate"])}, as_json, text)


COMMANDS = (outbox,)

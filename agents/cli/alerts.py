"""``keel alerts``: the alert episodes, firing now and (with ``--all``) past."""

from __future__ import annotations

import click

from agents.cli.common import emit, friendly, json_option, open_client, text_value, timestamp


@click.command("alerts")
@click.option("--all", "show_all", is_flag=True, help="Resolved episodes too, not only those firing now.")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="At most this many, newest first."
)
@json_option
@friendly
def alerts(show_all: bool, limit: int, as_json: bool) -> None:
    """Alert episodes (firing -> resolved), newest first: the alerts firing now, or with --all past ones too.

    The leading beat evaluates the alerts every KEEL_ALERT_INTERVAL_SECONDS and posts each episode's start and end
    to KEEL_ALERT_SLACK_CHANNEL once; docs/runbook.md says what to do about each alert."""
    from models.alerts_sql import list_episodes

    with open_client(writes=False) as client:
        episodes = list_episodes(client.db, include_resolved=show_all, limit=limit)
    rows = [
        {
            "name": e.name,
            "state": "firing" if e.resolved_at is None else "resolved",
            "started_at": e.started_at,
            "resolved_at": e.resolved_at,
            "value": e.value,
            "threshold": e.threshold,
            "last_value": e.last_value,
            "last_evaluated_at": e.last_evaluated_at,
            "summary": e.details.get("summary"),
        }
        for e in episodes
    ]
    lines = [
        f"{e.name:<24} {'firing' if e.resolved_at is None else 'resolved':<8} since {timestamp(e.started_at)}"
        + (f"  resolved {timestamp(e.resolved_at)}" if e.resolved_at else "")
        + f"  value {text_value(e.value)} (threshold {text_value(e.threshold)}), last {text_value(e.last_value)}"
        for e in episodes
    ]
    nothing = "no alert episodes" if show_all else "no alert is firing"
    emit({"episodes": rows}, as_json, "\n".join(lines) or nothing)


COMMANDS = (alerts,)

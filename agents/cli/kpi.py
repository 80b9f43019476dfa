"""``keel kpi``: how well Keel is doing, from the counters kept in the database."""

from __future__ import annotations

from dataclasses import fields
from datetime import timedelta

import click

from agents.cli.common import emit, friendly, json_option, open_client


@click.command("kpi")
@click.option(
    "--since",
    metavar="DURATION",
    help="Only the last DURATION, a minute or more: a whole number and a unit (s, m, h, d, w), e.g. 24h, 90m, 7d."
    " Without it: everything since the counters began.",
)
@click.option("--include-demo", is_flag=True, hidden=True)  # gone: refused with the reason below
@json_option
@friendly
def kpi(since: str | None, include_demo: bool, as_json: bool) -> None:
    """The KPIs, from the counters kept in the database: suppressed duplicates, side-effect duplicates, failure
    rate, request times, p95 phase-transition latency, recovery rate after a first failure, retry-caused cost, and the
    side effects dead now (Slack and GitHub messages that never arrived)."""
    from agents.observability.kpis import parse_duration, report_lines
    from models.kpi_sql import MIN_WINDOW, gauges, totals, window

    if include_demo:
        raise click.UsageError(
            "--include-demo is gone: the KPI counters are global, the demo's agents are counted like any other"
            " (run `keel demo` on a database of its own to keep it out of your figures)"
        )
    span = None
    if since is not None:
        try:
            span = parse_duration(since)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--since") from None
        if span < MIN_WINDOW:
            raise click.BadParameter(
                f"{since} is under a minute: the counters are kept per minute and a window starts at its first whole"
                " minute, so a shorter one holds almost nothing; use 1m or more",
                param_hint="--since",
            )
    with open_client(writes=False) as client:
        if span is not None:
            kept = timedelta(days=client.settings.kpi_retention_days)
            if span > kept:
                raise click.BadParameter(
                    f"{since} reaches past the {kept.days} days of per-minute KPI history kept"
                    " (KEEL_KPI_RETENTION_DAYS); leave --since out for the figures since the counters began",
                    param_hint="--since",
                )
            k = window(client.db, span)
        else:
            k = totals(client.db)
        dead = gauges(client.db).dead_letters  # now, whatever the window: side effects that never arrived
    if as_json:
        data = {f.name: getattr(k, f.name) for f in fields(k) if f.name != "counters"}
        data["since"] = since
        data["dead_side_effects"] = dead
        emit(data, as_json, "")
        return
    said = ", ".join(f"{channel} {n:,}" for channel, n in dead.items())
    rows = [
        *report_lines(k),
        ("dead side effects now", f"{sum(dead.values()):,} ({said}): keel outbox list --status dead"),
    ]
    width = max(len(label) for label, _ in rows) + 1
    title = f"KPIs over the last {since}" if since else "KPIs since the counters began"
    emit(None, False, "\n".join([title, *(f"{label:<{width}} {value}" for label, value in rows)]))


COMMANDS = (kpi,)

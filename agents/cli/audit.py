"""``keel journal``, ``keel audit verify`` and ``keel kpi``: what happened, whether the record is intact, how well."""

from __future__ import annotations

import sys
from decimal import Decimal
from typing import Any

import click

from agents.cli.common import (
    count,
    decimal_text,
    emit,
    friendly,
    json_option,
    open_client,
    percent,
    rounded,
    seconds,
    text_value,
    to_json,
)
from agents.cli.watch import journal_header, journal_text, print_events
from agents.core.commands import MAX_BIGINT
from agents.core.errors import quoted


@click.command("journal")
@click.option("--agent", "agent_ref", help="Only this agent (id or name).")
@click.option("--request-id", help="Only this request.")
@click.option("--limit", type=click.IntRange(1, MAX_BIGINT), help="At most this many events (not with --follow).")
@click.option("--details", is_flag=True, help="Show every event's details (rejections always show theirs).")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Keep printing new events as they commit, until Ctrl-C (with --json: one JSON object per line).",
)
@json_option
@friendly
def journal_cmd(
    agent_ref: str | None, request_id: str | None, limit: int | None, details: bool, follow: bool, as_json: bool
) -> None:
    """Show journal events, oldest first: who did what to which agent, and what was decided."""
    if follow and limit is not None:
        raise click.UsageError("--limit and --follow do not go together")
    with open_client() as client:
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
        events = client.journal(agent_id=agent_ref, request_id=request_id, limit=limit)
        several = agent_ref is None and len({e.agent_id for e in events}) > 1
        agent_names = client.agent_names(e.agent_id for e in events) if several else None
    text = journal_text(events, names=agent_names, details=details) if events else "no events"
    emit({"events": events}, as_json, text)


@click.group()
def audit() -> None:
    """Check the journal's integrity."""


@audit.command("verify")
@json_option
@friendly
def audit_verify(as_json: bool) -> None:
    """Walk every agent's hash chain; exit 1 at the first broken link of any chain. The outcome is recorded: the
    audit_verify alert fires while the latest verify (this command's or the beat's periodic one) failed."""
    from agents.audit.verify import verify_and_record

    with open_client() as client:
        report = verify_and_record(client.db, "cli")
        names = client.agent_names(b.agent_id for b in report.breaks)
    if as_json:
        click.echo(
            to_json(
                {
                    "ok": report.ok,
                    "agents": report.agents,
                    "events": report.events,
                    "breaks": [
                        {
                            "agent_id": str(b.agent_id),
                            "agent": names.get(b.agent_id),
                            "seq": b.seq,
                            "journal_id": b.journal_id,
                            "reason": b.reason,
                        }
                        for b in report.breaks
                    ],
                }
            )
        )
    elif report.ok:
        click.echo(f"ok: {report.events} events in {report.agents} agent chains verified")
    else:
        for b in report.breaks:
            where = f"journal id {b.journal_id}" if b.journal_id is not None else "chain head"
            agent = f"{quoted(names[b.agent_id])} ({b.agent_id})" if b.agent_id in names else str(b.agent_id)
            click.echo(f"BROKEN agent {agent} at event {b.seq} ({where}): {b.reason}", err=True)
    if not report.ok:
        sys.exit(1)


@click.command("kpi")
@click.option("--include-demo", is_flag=True, help="Count the demo's agents (named demo-...) too.")
@json_option
@friendly
def kpi(include_demo: bool, as_json: bool) -> None:
    """The KPIs, computed from the tables: suppressed duplicates, side effects confirmed twice, p95 step latency,
    recovery rate after a first failure, retry-caused cost, failure rate."""
    from models.kpi_sql import DEMO_PREFIX, kpis

    with open_client() as client:
        data = kpis(client.db, skip_prefix=None if include_demo else DEMO_PREFIX)
    width = max(len(k) for k in data) + 1
    measured = {k: rounded(v) if k.endswith(("_rate", "_seconds")) else v for k, v in data.items()}
    emit(measured, as_json, "\n".join(f"{k:<{width}} {_kpi_text(k, v)}" for k, v in data.items()))


def _kpi_text(name: str, value: Any) -> str:
    """A KPI for people: counts with separators, rates as percentages, times in ms or s, costs to the cent's
    hundredth; "-" when there is nothing to measure yet."""
    if value is None:
        return "-"
    if name.endswith("_rate"):
        return percent(float(value))
    if name.endswith("_seconds"):
        return seconds(float(value))
    if isinstance(value, Decimal):
        return decimal_text(value.quantize(Decimal("0.0001")))
    if isinstance(value, int):
        return count(value)
    return text_value(value)


COMMANDS = (journal_cmd, audit, kpi)

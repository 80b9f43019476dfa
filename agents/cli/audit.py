"""``keel journal``, ``keel audit verify`` and ``keel kpi``: what happened, whether the record is intact, how well."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import click

from agents.cli.common import emit, friendly, json_option, open_client


def journal_table(events: Sequence[Any]) -> str:
    """The journal as a fixed-width text table."""
    header = f"{'seq':>4}  {'at':<15} {'kind':<10} {'event':<16} {'from -> to':<30} {'rev':>4}  {'actor':<12} decision"
    lines = [header]
    for e in events:
        move = f"{e.from_phase} -> {e.to_phase}" if e.from_phase != e.to_phase else str(e.to_phase)
        lines.append(
            f"{e.seq:>4}  {e.at:%H:%M:%S.%f} {e.kind:<10} {e.event:<16} {move:<30} {e.revision:>4}  "
            f"{e.actor[:12]:<12} {e.decision}"
        )
    return "\n".join(lines)


@click.command("journal")
@click.option("--agent", "agent_ref", help="Only this agent (id or name).")
@click.option("--request-id", help="Only this request.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many events.")
@json_option
@friendly
def journal_cmd(agent_ref: str | None, request_id: str | None, limit: int | None, as_json: bool) -> None:
    """Show journal events, oldest first."""
    with open_client() as client:
        events = client.journal(agent_id=agent_ref, request_id=request_id, limit=limit)
    emit(events, as_json, journal_table(events) if events else "no events")


@click.group()
def audit() -> None:
    """Check the journal's integrity."""


@audit.command("verify")
@json_option
@friendly
def audit_verify(as_json: bool) -> None:
    """Walk every agent's hash chain; exit 1 at the first broken link of any chain."""
    from agents.core import journal

    with open_client() as client:
        report = journal.verify(client.db)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": report.ok,
                    "agents": report.agents,
                    "events": report.events,
                    "breaks": [
                        {
                            "agent_id": str(b.agent_id),
                            "seq": b.seq,
                            "journal_id": b.journal_id,
                            "reason": b.reason,
                        }
                        for b in report.breaks
                    ],
                },
                indent=2,
            )
        )
    elif report.ok:
        click.echo(f"ok: {report.events} events in {report.agents} agent chains verified")
    else:
        for b in report.breaks:
            where = f"journal id {b.journal_id}" if b.journal_id is not None else "chain head"
            click.echo(f"BROKEN agent {b.agent_id} at event {b.seq} ({where}): {b.reason}", err=True)
    if not report.ok:
        sys.exit(1)


@click.command("kpi")
@json_option
@friendly
def kpi(as_json: bool) -> None:
    """The KPIs, computed from the tables: suppressed duplicates, side effects confirmed twice, p95 step latency,
    recovery rate after a first failure, retry-caused cost, failure rate."""
    from models.kpi_sql import kpis

    with open_client() as client:
        data = {k: (float(v) if hasattr(v, "as_tuple") else v) for k, v in kpis(client.db).items()}
    emit(data, as_json, "\n".join(f"{k:<28} {v}" for k, v in data.items()))


COMMANDS = (journal_cmd, audit, kpi)

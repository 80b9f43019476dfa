"""``keel audit``: check that the journal is intact, ship it to a separate store, manage its monthly partitions,
archive its oldest month, and export a request's events for an auditor."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import click

from agents.cli.common import (
    emit,
    friendly,
    json_option,
    open_client,
    settings_or_exit,
    text_value,
    to_json,
)
from agents.core.errors import quoted

#: `keel audit ship` could not ship this time (a transaction writing the journal stayed open): try again later.
EX_TEMPFAIL = 75


@click.group()
def audit() -> None:
    """Check the journal's integrity; ship it to a separate store; export a request's events for an auditor."""


#: Chains listed per kind of finding in the text output (--json lists every one).
SHOWN = 20


@audit.command("verify")
@click.option(
    "--against",
    "against",
    metavar="URL",
    help="Instead: compare the journal with the copy shipped to URL (s3://bucket/prefix or file:///path) and name"
    " every divergence.",
)
@click.option(
    "--public-key",
    type=click.Path(exists=True, dir_okay=False),
    help="With --against: an Ed25519 public key (PEM) the shipped manifests must be signed with.",
)
@click.option(
    "--incremental",
    is_flag=True,
    help="Faster: walk each chain from its checkpoint (where an earlier verify found it intact), trusting the events"
    " below it without checking them (only the checkpoint's own event is checked again); says how many it checked"
    " and how many it trusted, from checkpoints of when.",
)
@click.option("--full", is_flag=True, hidden=True)  # the default now; still accepted from older scripts
@json_option
@friendly
def audit_verify(against: str | None, public_key: str | None, incremental: bool, full: bool, as_json: bool) -> None:
    """Walk every agent's keyed chain with the audit keys (KEEL_AUDIT_KEYS); exit 1 at the first broken link, or when
    events linked with a key the ring lacks could not be checked. Says how many events of each chain are legacy
    (from before the journal was keyed). The outcome is recorded, and the audit_verify alert fires while the latest
    verify failed; run by the read-only auditor role, it is printed only.

    Each chain is checked from its start (or its archived head), KEEL_AUDIT_VERIFY_CHUNK_CHAINS chains per short
    transaction. --incremental checks only what is new since each chain's checkpoint and says which events it
    trusted instead: it cannot see an edit below a checkpoint.

    With --against URL: compare the journal with its shipped copy instead (nothing is recorded); exit 1 on any event
    changed, removed or inserted after shipping, any chain re-forged, any segment missing or manifest that fails."""
    if incremental and full:
        raise click.UsageError("--incremental and --full do not go together")
    if against is not None:
        if incremental or full:
            flag = "--incremental" if incremental else "--full"
            raise click.UsageError(f"{flag} does not go with --against (the comparison reads every event anyway)")
        _verify_against(against, public_key, as_json)
        return
    if public_key is not None:
        raise click.UsageError("--public-key goes with --against")
    from agents.audit.verify import verify_and_record
    from agents.core.journal.verdict import Verdict
    from models.alerts_sql import may_record_verification

    with open_client(writes=False) as client:
        recorded = may_record_verification(client.db)
        report = verify_and_record(
            client.db,
            "cli",
            full=not incremental,
            record=recorded,
            chunk_chains=client.settings.audit_verify_chunk_chains,
            chunk_events=client.settings.audit_verify_chunk_events,
        )
        names = client.agent_names(
            {
                *(b.agent_id for b in report.breaks),
                *(u.agent_id for u in report.unchecked),
                *(p.agent_id for p in report.legacy),
            }
        )
    if not recorded:
        click.echo("(not recorded: this database role may only read; the beat records its own runs)", err=True)
    if as_json:
        click.echo(
            to_json(
                {
                    "ok": report.ok,
                    "mode": "full" if report.full else "incremental",
                    "agents": report.agents,
                    "checked": report.read_events,
                    "trusted": report.trusted,
                    "trusted_chains": report.trusted_chains,
                    "trusted_from": report.trusted_from,
                    "trusted_to": report.trusted_to,
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
                    "unchecked": [
                        {
                            "agent_id": str(u.agent_id),
                            "agent": names.get(u.agent_id),
                            "key_id": u.key_id,
                            "seq": u.seq,
                            "events": u.events,
                        }
                        for u in report.unchecked
                    ],
                    "legacy": [
                        {"agent_id": str(p.agent_id), "agent": names.get(p.agent_id), "events": p.events}
                        for p in report.legacy
                    ],
                    "key_ids": list(report.key_ids),
                    "archive_problems": list(report.archive_problems),
                    "checkpoint_problems": list(report.checkpoint_problems),
                }
            )
        )
        if not report.ok:
            sys.exit(1)
        return

    def agent(agent_id: Any) -> str:
        return f"{quoted(names[agent_id])} ({agent_id})" if agent_id in names else str(agent_id)

    if report.legacy:
        events = sum(p.events for p in report.legacy)
        click.echo(
            f"legacy: {events} events in {len(report.legacy)} chains were written before the journal was keyed"
            " (plain sha256; sealed with the key at the upgrade, so protected from then on, not before):"
        )
        for part in report.legacy[:SHOWN]:
            click.echo(f"  agent {agent(part.agent_id)}: events 1-{part.events}")
        if len(report.legacy) > SHOWN:
            click.echo(f"  … and {len(report.legacy) - SHOWN} more chains (--json lists them all)")
    for problem in report.archive_problems:
        click.echo(f"BROKEN archive: {problem}", err=True)
    for problem in report.checkpoint_problems:
        click.echo(f"FORGED checkpoint: {problem}", err=True)
    for b in report.breaks:
        where = f"journal id {b.journal_id}" if b.journal_id is not None else "chain head"
        click.echo(f"BROKEN agent {agent(b.agent_id)} at event {b.seq} ({where}): {b.reason}", err=True)
    by_key: dict[str, list[Any]] = {}
    for u in report.unchecked:
        by_key.setdefault(u.key_id, []).append(u)
    held = f"it holds {', '.join(repr(k) for k in report.key_ids)}" if report.key_ids else "no audit key is configured"
    for key_id, chains in by_key.items():
        events = sum(u.events for u in chains)
        click.echo(
            f"NOT CHECKED: {events} events in {len(chains)} chains are linked with key {key_id!r}, which"
            f" KEEL_AUDIT_KEYS does not hold ({held}): their links could not be checked; if no key of that id was"
            " ever in use (a retired key kept elsewhere), treat these events as forged",
            err=True,
        )
        for u in chains[:SHOWN]:
            click.echo(f"  agent {agent(u.agent_id)}: {u.events} events, the first at event {u.seq}", err=True)
        if len(chains) > SHOWN:
            click.echo(f"  … and {len(chains) - SHOWN} more chains (--json lists them all)", err=True)
    verdict = Verdict.of(report)
    if report.ok:
        click.echo(verdict.text())
    else:
        click.echo(verdict.text(), err=True)
        sys.exit(1)


def _verify_against(url: str, public_key_path: str | None, as_json: bool) -> None:
    from agents.audit.compare import verify_against
    from agents.audit.ship import destination_of, open_configured_store
    from models.audit_destination import load_public_key
    from models.audit_keys import AuditKeyMissing, audit_keys_for

    public_key = None
    if public_key_path is not None:
        try:
            public_key = load_public_key(Path(public_key_path).read_bytes())
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--public-key") from None
    with open_client(writes=False) as client:
        destination = destination_of(client.settings, url)
        try:
            keys = audit_keys_for(client.settings)
        except AuditKeyMissing:
            if public_key is None:
                raise
            keys = None
        store = open_configured_store(client.db, client.settings, destination)
        report = verify_against(
            client.db,
            store,
            keys,
            destination=str(destination),
            public_key=public_key,
            segment_events=client.settings.audit_segment_events,
            segment_age=timedelta(minutes=client.settings.audit_segment_minutes),
        )
    if as_json:
        click.echo(
            to_json(
                {
                    "ok": report.ok,
                    "destination": report.destination,
                    "segments": report.segments,
                    "events": report.events,
                    "last_id": report.last_id,
                    "unshipped": report.unshipped,
                    "divergences": [{"kind": d.kind, "text": d.text} for d in report.divergences],
                    "notes": list(report.notes),
                }
            )
        )
    else:
        for note in report.notes:
            click.echo(f"note: {note}", err=True)
        for d in report.divergences:
            click.echo(f"DIVERGED ({d.kind}): {d.text}", err=True)
        if report.ok:
            click.echo(
                f"ok: {report.events} events in {report.segments} segments at {report.destination} match the journal"
                f" (to id {report.last_id}; {report.unshipped} events not shipped yet)"
            )
    if not report.ok:
        sys.exit(1)


@audit.command("ship")
@click.option(
    "--url", metavar="URL", help="Ship here instead of KEEL_AUDIT_SHIP_URL (s3://bucket/prefix, file:///path)."
)
@click.option(
    "--flush",
    is_flag=True,
    help="Also seal the segment still open (its events are fewer than KEEL_AUDIT_SEGMENT_EVENTS and younger than"
    " KEEL_AUDIT_SEGMENT_MINUTES): everything committed is shipped.",
)
@json_option
@friendly
def audit_ship(url: str | None, flush: bool, as_json: bool) -> None:
    """Ship the journal's closed segments to the separate store, each as JSON Lines with a keyed (and, with
    KEEL_AUDIT_SIGNING_KEY, signed) manifest; resumes where the store's last segment ends. The leading beat does
    the same every KEEL_AUDIT_SHIP_INTERVAL_SECONDS.

    Exit status 0 when it shipped everything due (or nothing was due), 75 when a transaction writing the journal
    stayed open past KEEL_AUDIT_SETTLE_SECONDS and what it holds back was not shipped (try again later), 1 on an
    error."""
    from agents.audit.ship import ship_configured

    with open_client() as client:
        report = ship_configured(client.db, client.settings, url=url, flush=flush)
    if as_json:
        emit(
            {
                "destination": report.destination,
                "last_id": report.last_id,
                "waiting": report.waiting,
                "unsettled": report.unsettled,
                "notes": list(report.notes),
                "segments": [
                    {
                        "segment": s.segment,
                        "manifest": s.manifest,
                        "first_id": s.first_id,
                        "last_id": s.last_id,
                        "events": s.events,
                        "resumed": s.resumed,
                    }
                    for s in report.segments
                ],
            },
            True,
            "",
        )
        if report.unsettled:
            click.echo(_held_up(client.settings.audit_settle_seconds), err=True)
            raise SystemExit(EX_TEMPFAIL)
        return
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
    for s in report.segments:
        how = " (its body was already there: completed)" if s.resumed else ""
        click.echo(f"shipped {s.segment}: {s.events} events, ids {s.first_id}..{s.last_id}{how}")
    if report.unsettled:  # a cron job or a script must see that what is due did not all ship, not a clean exit
        click.echo(_held_up(client.settings.audit_settle_seconds), err=True)
        raise SystemExit(EX_TEMPFAIL)
    if report.waiting:
        click.echo(
            f"{report.waiting} events wait for their segment to close (KEEL_AUDIT_SEGMENT_EVENTS or"
            " KEEL_AUDIT_SEGMENT_MINUTES; --flush ships them now)"
        )
    elif not report.segments:
        click.echo(f"nothing to ship: {report.destination} holds the journal to id {report.last_id}")


def _held_up(settle_seconds: float) -> str:
    return (
        f"waiting: a transaction writing the journal is still open after {settle_seconds:g}s"
        " (KEEL_AUDIT_SETTLE_SECONDS); nothing more was shipped, try again later"
    )


@audit.command("partitions")
@click.option(
    "--create",
    is_flag=True,
    help="First create the partitions missing for this month and the months ahead (empty, of the fixed shape, the"
    " owner's), as the leading beat does daily.",
)
@click.option(
    "--months",
    type=click.IntRange(1, 12),
    help="With --create: this many months after the current one (default KEEL_AUDIT_PARTITION_MONTHS_AHEAD).",
)
@json_option
@friendly
def audit_partitions(create: bool, months: int | None, as_json: bool) -> None:
    """List the journal's monthly partitions with their bounds (UTC) and event counts, and how many months ahead
    have one: an event whose month has no partition is refused, so the journal_partitions alert fires below two."""
    from models import partitions_sql

    if months is not None and not create:
        raise click.UsageError("--months goes with --create")
    with open_client(writes=create) as client:
        created = (
            partitions_sql.ensure_partitions(client.db, months or client.settings.audit_partition_months_ahead)
            if create
            else []
        )
        found = partitions_sql.partitions(client.db, count=True)
        ahead = partitions_sql.months_ahead(client.db)
    rows = [{"partition": p.name, "from": p.from_at, "to": p.to_at, "events": p.events} for p in found]
    lines = [f"created audit.{name}" for name in created]
    table = [
        (p.name, text_value(p.from_at, none="(everything before)"), text_value(p.to_at), str(p.events)) for p in found
    ]
    widths = [
        max(len(cell) for cell in column) + 2 for column in zip(("partition", "from", "to", ""), *table, strict=True)
    ]
    lines += [
        "".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=False)) + row[3]
        for row in [("partition", "from", "to", "events"), *table]
    ]
    lines.append(f"{ahead} whole month(s) after this one have a partition")
    emit({"created": created, "partitions": rows, "months_ahead": ahead}, as_json, "\n".join(lines))


@audit.command("archive")
@click.option(
    "--against",
    required=True,
    metavar="URL",
    help="The store the journal is shipped to (s3://bucket/prefix or file:///path): every event of the month must be"
    " there, in segments whose manifests verify, byte for byte as in the database.",
)
@click.option(
    "--partition",
    metavar="NAME",
    help="The partition to archive (e.g. journal_2027_01); it must be the oldest attached one. Default: that one.",
)
@click.option("--dry-run", is_flag=True, help="Make every check and say what would be archived; change nothing.")
@json_option
@friendly
def audit_archive(against: str, partition: str | None, dry_run: bool, as_json: bool) -> None:
    """Remove the journal's oldest month from the database, once every event in it is proved shipped and verified
    against the store, with a sealed record of what left (audit.archived_partitions): the only way journal rows
    ever leave. Runs as the owner (KEEL_MIGRATION_DATABASE_URL), with the audit keys (KEEL_AUDIT_KEYS); only a month
    that ended more than KEEL_AUDIT_ARCHIVE_GRACE_DAYS ago. Any check that fails refuses, names what is missing or
    different, changes nothing and exits 1."""
    from agents.audit.archive import archive_partition
    from agents.audit.ship import destination_of
    from agents.audit.store import open_store
    from models.audit_keys import audit_keys_for
    from models.embedded import migration_url_for

    settings = settings_or_exit()
    destination = destination_of(settings, against)
    report = archive_partition(
        migration_url_for(settings),
        open_store(destination, endpoint_url=settings.audit_s3_endpoint_url),
        audit_keys_for(settings),
        destination=str(destination),
        grace=timedelta(days=settings.audit_archive_grace_days),
        partition=partition,
        dry_run=dry_run,
    )
    done = "would archive" if report.dry_run else "archived"
    ids = f"ids {report.first_id}..{report.last_id}" if report.events else "no events"
    emit(
        {
            "partition": report.partition,
            "dry_run": report.dry_run,
            "first_id": report.first_id,
            "last_id": report.last_id,
            "events": report.events,
            "manifests": report.manifests,
            "agents": report.agents,
        },
        as_json,
        f"{done} {report.partition}: {report.events} events ({ids}) of {report.agents} agent chains, shipped in"
        f" {report.manifests} segments of {destination}",
    )


@audit.command("export")
@click.option("--agent", "agent_ref", required=True, help="The agent (name or id; a deleted one's too) of the request.")
@click.option("--request-id", required=True, help="The request whose events to export.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "csv"]),
    required=True,
    help="jsonl: one JSON object per event, exact. csv: a header row, then one row per event; a cell a spreadsheet"
    " would run as a formula (starting with =, +, -, @, tab or CR) and one starting with ' get a leading '.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write to FILE (replaced only once the whole export is written) instead of standard output.",
)
@friendly
def audit_export(agent_ref: str, request_id: str, fmt: str, output: Path | None) -> None:
    """One request's story for an auditor: every journal event of the agent with this request id, oldest first,
    with every stored field (the agent's name after its id; details as stored; times in UTC, RFC 3339). Read in one
    snapshot through a server-side cursor, so a request of any size streams. Exit 1 when no event has the id. Reads
    only: any database role may run it, the auditor's included."""
    from agents.audit.export import request_events, write_export

    as_csv = fmt == "csv"
    with (
        open_client(writes=False) as client,
        request_events(client.db, client.journal_agent(agent_ref), request_id) as (columns, rows),
    ):
        if output is None:
            write_export(sys.stdout, "csv" if as_csv else "jsonl", columns, rows)
            return
        written = _write_file(output, lambda out: write_export(out, "csv" if as_csv else "jsonl", columns, rows))
    click.echo(f"exported {written} events of request {quoted(request_id)} to {output}")


def _write_file(path: Path, write: Callable[[IO[str]], int]) -> int:
    """Run ``write`` on a new file next to ``path`` and put it in ``path``'s place once it is whole: a failed export
    leaves ``path`` as it was."""
    try:
        handle, scratch = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".partial")
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with open(handle, "w", encoding="utf-8", newline="") as out:
            written = write(out)
        os.replace(scratch, path)
    except BaseException as exc:
        Path(scratch).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
        raise
    return written


COMMANDS = (audit,)

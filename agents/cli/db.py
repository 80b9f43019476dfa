"""``keel db``: deploy and revert the schema (Alembic migrations), the database roles Keel runs under, and retention's
prune."""

from __future__ import annotations

from typing import Any

import click

from agents.cli.common import emit, friendly, json_option, open_client, settings_or_exit


@click.group()
def db() -> None:
    """Database schema (Alembic migrations), roles, and retention's prune."""


def _migration(settings: Any) -> tuple[str, Any]:
    """Where migrations connect (KEEL_MIGRATION_DATABASE_URL, else KEEL_DATABASE_URL) and the roles they run under.
    In production the owner role must exist: `keel db roles` creates it."""
    from models import roles
    from models.embedded import migration_url_for

    url = migration_url_for(settings)
    names = roles.RoleNames.of(settings)
    if settings.environment == "production" and (absent := roles.missing(url, names)):
        raise roles.RolesError(
            f"the database roles {', '.join(absent)} do not exist: run 'keel db roles' first (as a superuser,"
            " KEEL_MIGRATION_DATABASE_URL); in production migrations run as the owner role"
        )
    return url, names


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Target migration.")
@friendly
def db_upgrade(revision: str) -> None:
    """Apply migrations up to REVISION, as the owner role (KEEL_DB_OWNER_ROLE) when it exists.

    Connects with KEEL_MIGRATION_DATABASE_URL (else KEEL_DATABASE_URL)."""
    from models import migrations

    url, names = _migration(settings_or_exit())
    migrations.upgrade(url, revision, roles=names)
    click.echo(_where(url))


@db.command("downgrade")
@click.argument("revision")
@friendly
def db_downgrade(revision: str) -> None:
    """Revert migrations down to REVISION ('base' removes everything), as the owner role when it exists."""
    from models import migrations

    url, names = _migration(settings_or_exit())
    migrations.downgrade(url, revision, roles=names)
    click.echo(_where(url))


@db.command("roles")
@friendly
def db_roles() -> None:
    """Create or repair the database roles: the owner of Keel's schema (KEEL_DB_OWNER_ROLE, no login), the role
    Keel's processes log in as (KEEL_DB_APP_ROLE: on the journal SELECT and INSERT only) and a read-only auditor
    (KEEL_DB_AUDITOR_ROLE); hand Keel's tables and functions to the owner; set the grants and the passwords
    (KEEL_DB_APP_PASSWORD, KEEL_DB_AUDITOR_PASSWORD).

    Run it as a superuser (KEEL_MIGRATION_DATABASE_URL), before 'keel db upgrade'. Idempotent: it prints what it
    changed, one line each, and changes nothing when all is as it should be."""
    from models import roles
    from models.embedded import migration_url_for

    settings = settings_or_exit()
    names = roles.RoleNames.of(settings)
    lines = roles.set_up(migration_url_for(settings), names, roles.Passwords.of(settings))
    for line in lines:
        click.echo(line)
    if not lines:
        click.echo(
            f"nothing to change: {names.owner} owns Keel's schema; {names.app} and {names.auditor} hold their grants"
        )


@db.command("prune")
@click.option("--dry-run", is_flag=True, help="Count what would be pruned now; change nothing.")
@json_option
@friendly
def db_prune(dry_run: bool, as_json: bool) -> None:
    """Prune what retention allows now: finished jobs older than KEEL_JOBS_RETENTION_DAYS, sent outbox messages
    (and their delivery log rows) older than KEEL_OUTBOX_RETENTION_DAYS, and the inputs of requests submitted more
    than KEEL_REQUESTS_RETENTION_DAYS ago (0: keep that kind for ever), measured on the database's clock.

    Nothing of a request in flight, no dead letter, nothing unsent and no journal event is pruned; a pruned key
    stays taken. Batches of KEEL_PRUNE_BATCH rows, one short transaction each; safe beside the leading beat, which
    runs the same prune every KEEL_PRUNE_INTERVAL_SECONDS. Prints what it removed (with --dry-run: would remove)."""
    from models.retention_sql import Retention, prune

    retention = Retention.of(settings_or_exit())
    with open_client(writes=not dry_run) as client:
        pruned = prune(client.db, retention, dry_run=dry_run)
    kept = [
        name
        for name, days in (
            ("jobs", retention.jobs_days),
            ("outbox messages", retention.messages_days),
            ("requests", retention.requests_days),
        )
        if not days
    ]
    verb = "would prune" if dry_run else "pruned"
    lines = [
        f"{verb} {pruned.jobs} finished jobs, {pruned.messages} sent outbox messages with {pruned.confirmations}"
        f" delivery log rows, {pruned.requests} request inputs"
    ]
    if kept:
        lines.append(f"kept for ever (retention 0 days): {', '.join(kept)}")
    value = {
        "dry_run": dry_run,
        "jobs": pruned.jobs,
        "messages": pruned.messages,
        "delivery_log": pruned.confirmations,
        "requests": pruned.requests,
        "kept_forever": kept,
    }
    emit(value, as_json, "\n".join(lines))


def _where(url: str) -> str:
    """Where the database is now, said as the revision it is at: ``database at 0005 (head)``."""
    from models import migrations

    at = migrations.revision_at(url)
    if at is None:
        return "database at base (no Keel schema)"
    return f"database at {at}" + (" (head)" if at == migrations.head() else f" (head is {migrations.head()})")


COMMANDS = (db,)

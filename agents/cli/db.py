"""``keel db``: deploy and revert the schema (Alembic migrations)."""

from __future__ import annotations

import click

from agents.cli.common import friendly, settings_or_exit


@click.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Target migration.")
@friendly
def db_upgrade(revision: str) -> None:
    """Apply migrations up to REVISION."""
    from models import migrations
    from models.embedded import database_url_for

    url = database_url_for(settings_or_exit())
    migrations.upgrade(url, revision)
    click.echo(_where(url))


@db.command("downgrade")
@click.argument("revision")
@friendly
def db_downgrade(revision: str) -> None:
    """Revert migrations down to REVISION ('base' removes everything)."""
    from models import migrations
    from models.embedded import database_url_for

    url = database_url_for(settings_or_exit())
    migrations.downgrade(url, revision)
    click.echo(_where(url))


def _where(url: str) -> str:
    """Where the database is now, said as the revision it is at: ``database at 0005 (head)``."""
    from models import migrations

    at = migrations.revision_at(url)
    if at is None:
        return "database at base (no Keel schema)"
    return f"database at {at}" + (" (head)" if at == migrations.head() else f" (head is {migrations.head()})")


COMMANDS = (db,)

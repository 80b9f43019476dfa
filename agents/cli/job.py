"""``keel job``: one job by its key."""

from __future__ import annotations

import click

from agents.cli.common import emit, fields_text, friendly, json_option, open_client
from agents.core.errors import quoted


@click.command("job")
@click.argument("key")
@json_option
@friendly
def job_show(key: str, as_json: bool) -> None:
    """Show one job by its key ({request}:{operation}:{target}; {request} is the agent id in hex, ~, the request id)."""
    from models.jobs_sql import job_row

    with open_client(writes=False) as client:
        row = job_row(client.db, key)
    if row is None:
        raise click.ClickException(f"no job has the key {quoted(key)}")
    emit(row, as_json, fields_text(row))


COMMANDS = (job_show,)

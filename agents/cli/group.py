"""The ``keel`` group and its entry point. Each command group lives in a module of its own; this one assembles
them and adds the ``keel.commands`` entry points (``keel worker``, ``keel beat``, ``keel flower`` from tasks/)."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import click

from agents.cli import (
    agent,
    alerts,
    approvals,
    audit,
    db,
    demo,
    dev,
    docs,
    job,
    journal,
    kpi,
    outbox,
    request,
    token,
)
from agents.core.errors import QUOTED_CHARS, KeelError
from agents.observability.logs import configure_logging
from models.settings import Settings

#: A "word" this long in a usage error is a value someone gave (click echoes it): shortened, not echoed whole.
_LONG_WORD = re.compile(rf"\S{{{2 * QUOTED_CHARS},}}")


class _Keel(click.Group):
    """Adds the subcommands registered in the ``keel.commands`` entry point group, loaded only when used."""

    def _plugins(self) -> dict[str, Any]:
        from importlib.metadata import entry_points

        return {point.name: point for point in entry_points(group="keel.commands")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in (plugins := self._plugins()):
            loaded = plugins[cmd_name].load()
            assert isinstance(loaded, click.Command)
            return loaded
        return command


@click.group(cls=_Keel, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="keel", prog_name="keel", message="%(prog)s %(version)s")
def cli() -> None:
    """Keel: a control plane for long-running AI agents.

    Configuration comes from KEEL_* environment variables (KEEL_DATABASE_URL, KEEL_BROKER_URL, ...). With none
    set, Keel starts an embedded PostgreSQL and Redis under ./.keel/ (see `keel dev status`).

    Shell completion: eval "$(_KEEL_COMPLETE=bash_source keel)" in ~/.bashrc (zsh_source for zsh; for fish,
    _KEEL_COMPLETE=fish_source keel | source).
    """


for _module in (db, agent, request, approvals, job, outbox, token, journal, audit, kpi, alerts, docs, demo, dev):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def _log_format() -> str | None:
    """``KEEL_LOG_FORMAT``, if the settings can be read (a command that needs them reports why they cannot)."""
    try:
        return Settings().log_format
    except ValueError:
        return None


def main() -> None:
    """Entry point: every error is one line on stderr (no usage dump, no traceback) and a non-zero status."""
    # Python's own fallback prints warnings unfiltered: give the root logger a handler that masks secrets.
    configure_logging("cli", level=logging.WARNING, setting=_log_format())
    try:
        status = cli.main(prog_name="keel", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("keel: aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.format_message(), err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        message = " ".join(exc.format_message().split())
        if isinstance(exc, click.UsageError):
            message = _LONG_WORD.sub(lambda m: f"{m[0][:QUOTED_CHARS]}… ({len(m[0]):,} characters)", message)
            if exc.ctx is not None:
                message += f" (see '{exc.ctx.command_path} --help')"
        click.echo(f"keel: error: {message}", err=True)
        sys.exit(exc.exit_code)
    except KeelError as exc:  # one a command did not turn into a line itself (e.g. the embedded servers missing)
        click.echo(f"keel: error: {exc}", err=True)
        sys.exit(1)
    sys.exit(status if isinstance(status, int) else 0)

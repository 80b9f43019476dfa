"""The whole ``keel`` command as the docs' CLI reference renders it (docs/reference/cli.md, through mkdocs-click):
the group with its ``keel.commands`` entry points (``keel worker``, ``keel beat``, ``keel flower``, ``keel serve``)
loaded, which the command itself loads only when one of them runs. Imported by the docs build, never by ``keel``."""

from __future__ import annotations

import click

from agents.cli.group import cli


def _whole() -> click.Group:
    ctx = click.Context(cli, info_name="keel")
    commands: dict[str, click.Command] = {}
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert command is not None, name
        commands[name] = command
    return click.Group(
        "keel", commands=commands, help=cli.help, params=cli.params, context_settings=cli.context_settings
    )


keel = _whole()

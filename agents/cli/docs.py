"""``keel docs``: documentation generated from the code."""

from __future__ import annotations

from pathlib import Path

import click

DOCS_PHASES = Path("docs/phases.md")


@click.group()
def docs() -> None:
    """Generated documentation."""


@docs.command("phases")
@click.option("--output", type=click.Path(path_type=Path), default=DOCS_PHASES, show_default=True)
@click.option("--check", is_flag=True, help="Exit 1 if the file differs from the phase table instead of writing.")
def docs_phases(output: Path, check: bool) -> None:
    """Write the phase diagram (Mermaid) generated from agents/core/phases.py."""
    from agents.core.phases import phases_markdown

    text = phases_markdown()
    if check:
        current = output.read_text() if output.exists() else ""
        if current != text:
            raise click.ClickException(f"{output} is out of date: run `keel docs phases`")
        click.echo(f"{output} matches the phase table")
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    click.echo(f"wrote {output}")


COMMANDS = (docs,)

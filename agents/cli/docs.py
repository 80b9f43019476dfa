"""``keel docs``: documentation generated from the code."""

from __future__ import annotations

from pathlib import Path

import click

#: The checkout this code runs from (an editable install), if it does: ``docs/`` beside ``agents/``.
CHECKOUT = Path(__file__).resolve().parents[2]
DOCS_PHASES = Path("docs/reference/phases.md")


@click.group()
def docs() -> None:
    """Generated documentation."""


def _checkout_file(relative: Path) -> Path:
    """``relative`` in the checkout this code runs from; one line saying to give a file when it runs from an
    installed package (a wheel, an image), where there is no checkout to write into."""
    if not ((CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / relative).parent.is_dir()):
        raise click.ClickException(
            f"this Keel is installed from a package, not run from its checkout, so there is no {relative} to write"
            " or check: give --output FILE"
        )
    return CHECKOUT / relative


def _shown(path: Path) -> Path:
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


@docs.command("phases")
@click.option(
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    help=f"The file to write or check [default: {DOCS_PHASES} in the checkout Keel runs from].",
)
@click.option("--check", is_flag=True, help="Exit 1 if the file differs from the phase table instead of writing.")
def docs_phases(output: Path | None, check: bool) -> None:
    """Write the phase diagram (Mermaid) generated from agents/core/phases.py."""
    from agents.core.phases import phases_markdown

    target = output if output is not None else _checkout_file(DOCS_PHASES)
    text = phases_markdown()
    if check:
        current = target.read_text() if target.exists() else ""
        if current != text:
            raise click.ClickException(f"{_shown(target)} is out of date: run `keel docs phases`")
        click.echo(f"{_shown(target)} matches the phase table")
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    click.echo(f"wrote {_shown(target)}")


COMMANDS = (docs,)

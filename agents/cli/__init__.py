"""The ``keel`` command: the group and ``main`` (``group``), shared helpers (``common``) and one module per command
group. ``keel = "agents.cli:main"`` is the console script."""

from agents.cli.group import cli, main

__all__ = ["cli", "main"]

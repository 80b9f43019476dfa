"""``python -m agents …`` is the ``keel`` command."""

from agents.cli import main

main()

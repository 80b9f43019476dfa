"""``python -m agents …`` is the ``keel`` command."""

from agents.cli import main
from agents.cli.supervisor import die_with_parent

die_with_parent()
main()

"""A process that publishes run_job messages straight to the broker, bypassing Keel's dispatcher:
``python -m tests.support.publish KEY ...``. Each message's task id is its key, as Keel's own are."""

from __future__ import annotations

import sys

from models.jobs_sql import Due
from tasks.app import app, publish


def main(keys: list[str]) -> None:
    publish([Due(key, "keel.jobs", False) for key in keys], app)


if __name__ == "__main__":
    main(sys.argv[1:])

"""A handler module in the directory Keel is started from is found without ``PYTHONPATH=.`` (issue 37: `keel up`
with ``KEEL_IMPORTS='["myagents"]'`` raised ModuleNotFoundError), and it shadows no installed package."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agents.client import Client
from models.db import Database
from models.jobs_sql import job_row
from tests.support.cli import KEEL, keel_env
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

MODULE = """
from agents.core.phases import Event
from agents.jobs.handlers import JobContext, JobResult, handler


@handler("from_here")
def from_here(ctx: JobContext) -> JobResult:
    return JobResult(event=Event.FINISH)
"""


def test_a_module_in_the_working_directory_is_imported_without_pythonpath(
    tmp_path: Path, db_url: str, client: Client, db: Database
) -> None:
    (tmp_path / "myagents.py").write_text(MODULE)
    (tmp_path / "json.py").write_text("raise SystemExit('the working directory shadowed an installed module')\n")
    agent = client.create_agent("here")
    env = keel_env(db_url, KEEL_IMPORTS='["myagents"]')
    env.pop("PYTHONPATH", None)
    submitted = subprocess.run(
        [KEEL, "submit", "here", "r1", "--operation", "from_here", "--input", "{}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    assert job_row(db, scoped(agent.id, "r1:from_here:1")) is not None

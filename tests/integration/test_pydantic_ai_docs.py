"""docs/how-to/pydantic-ai.md: its example agent, run as printed (its first Python block registers it; its second
submits to it), runs to the end on Keel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agents.client import Client
from models.db import Database
from models.jobs_sql import job_row
from tests.support.keys import scoped
from tests.support.runs import run_all

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "pydantic-ai.md"


def test_the_how_to_example_runs_as_printed(client: Client, db: Database) -> None:
    register, submit = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    namespace: dict[str, object] = {}
    exec(compile(register, str(PAGE), "exec"), namespace)
    agent = client.create_agent("docs-support")
    exec(compile(submit, str(PAGE), "exec"), {"client": client, "agent": agent})
    ran = run_all(db)
    assert client.get_state(agent.id).phase == "done"
    final = job_row(db, ran[-1])
    assert final is not None and final["key"] == scoped(agent.id, f"req-1:support:{len(ran)}")
    assert "shipped to ada" in str(final["result"]["answer"])

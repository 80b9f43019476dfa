"""docs/how-to/pydantic-ai.md: its example agent, run as printed (its first Python block registers it, its second
submits to it, its third approves the refund it holds), runs to the end on Keel."""

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
    register, submit, approve = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    namespace: dict[str, object] = {}
    exec(compile(register, str(PAGE), "exec"), namespace)
    agent = client.create_agent("docs-support")
    exec(compile(submit, str(PAGE), "exec"), {"client": client, "agent": agent})
    run_all(db)
    held = client.get_state(agent.id)
    assert held.phase == "waiting_approval" and held.pending_approval is not None
    assert held.pending_approval["tool"] == "refund"
    exec(compile(approve, str(PAGE), "exec"), {"client": client, "agent": agent})
    ran = run_all(db)
    assert client.get_state(agent.id).phase == "done"
    final = job_row(db, ran[-1])
    assert final is not None and final["key"].startswith(scoped(agent.id, "req-1:support:"))
    answer = str(final["result"]["answer"])
    assert "shipped to ada" in answer and "refunded 20 on A-1" in answer

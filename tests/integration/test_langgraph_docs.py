"""docs/how-to/langgraph.md: its example graph, run as printed (its first Python block registers it, its second submits
to it, its third approves the refund it holds with an edit), runs to the end on Keel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agents.client import Client
from models.db import Database
from models.jobs_sql import job_row
from tests.support.runs import run_all

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "langgraph.md"


def test_the_how_to_example_runs_as_printed(client: Client, db: Database) -> None:
    register, submit, approve = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    exec(compile(register, str(PAGE), "exec"), {})
    agent = client.create_agent("docs-refunds")
    exec(compile(submit, str(PAGE), "exec"), {"client": client, "agent": agent})
    run_all(db)
    held = client.get_state(agent.id)
    assert held.phase == "waiting_approval" and held.pending_approval is not None
    assert (held.pending_approval["tool"], held.pending_approval["arguments"]) == (
        "refund",
        {"order": "A-1", "amount": 30},
    )
    exec(compile(approve, str(PAGE), "exec"), {"client": client, "agent": agent})
    ran = run_all(db)
    assert client.get_state(agent.id).phase == "done"
    final = job_row(db, ran[-1])
    assert final is not None and final["result"]["answer"] == "Refund done."
    assert "refunded 20 on A-1" in [m["data"]["content"] for m in final["result"]["messages"]]

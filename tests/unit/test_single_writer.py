"""Only agents.core.transition() (and the agent's create, archive and delete in agents.core.lifecycle) writes agent
rows: the SQL that does lives in models/sql.py, and only the core and the journal it calls use those helpers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("agents", "tasks", "models", "alembic") for p in (ROOT / d).rglob("*.py")]
WRITES = re.compile(
    r"\b(UPDATE\s+(public\.)?agents\b|INSERT\s+INTO\s+(public\.)?agents\b|DELETE\s+FROM\s+(public\.)?agents\b"
    r"|agents\.(update|insert|delete)\(|(update|insert|delete)\(\s*agents\b)",
    re.IGNORECASE,
)
# A migration that adds a column fills it in once, before any process runs on it (0028: the keys of requests in flight).
BACKFILLS = {"alembic/versions/0028_requests_per_agent.py"}
HELPERS = ("update_agent_and_commit_txn", "advance_chain_txn", "insert_agent_txn", "lock_agent_txn")


def test_agent_row_sql_lives_only_in_models_sql() -> None:
    offenders = [
        name
        for p in SOURCES
        if WRITES.search(p.read_text()) and p.name != "sql.py" and (name := str(p.relative_to(ROOT))) not in BACKFILLS
    ]
    assert offenders == [], f"agent rows written outside models/sql.py: {offenders}"


def test_only_the_core_and_its_journal_call_the_row_writers() -> None:
    allowed = {"models/sql.py", "agents/core/transition.py", "agents/core/lifecycle.py", "agents/core/journal/write.py"}
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        used = [h for h in HELPERS if re.search(rf"\b{h}\b", path.read_text())]
        assert rel in allowed or not used, f"{rel} calls {used}: only agents/core/transition.py may change an agent row"


def test_an_agent_row_is_every_column_of_agents_and_nothing_else() -> None:
    """Rows are built by position from AGENT_COLUMNS, the dataclass's fields: each field must be a column of the
    table (a field that is not would break every read of the row), and every column must be read."""
    from dataclasses import fields

    from models.schemas import AgentRow
    from models.sql import AGENT_COLUMNS
    from models.tables import agents

    names = [field.name for field in fields(AgentRow)]
    assert all(field.init for field in fields(AgentRow)), "a field built by position must be an argument"
    assert sorted(names) == sorted(column.name for column in agents.c)
    assert AGENT_COLUMNS.split(", ") == names

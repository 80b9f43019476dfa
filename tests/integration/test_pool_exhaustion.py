"""A process whose pool has no connection free within its timeout (every one busy on a slow or hung database) gets
an outage, not a bug: a worker hands its message back and tries again later, and nothing is half-written."""

from __future__ import annotations

import pytest

from agents.client import Client
from agents.core import transition as core
from agents.core.commands import Command
from agents.core.errors import StoreError
from agents.core.outage import is_outage
from agents.core.phases import Event
from models.db import Database
from tests.support.audit import TEST_KEYS

pytestmark = pytest.mark.integration


def test_an_exhausted_pool_is_an_outage_and_changes_nothing(db_url: str, client: Client) -> None:
    agent = client.create_agent("starved")
    db = Database(db_url, pool_size=1, audit_keys=TEST_KEYS, pool_timeout_seconds=0.2)
    try:
        # The pool's one connection and its one overflow, both taken (as by two stuck transactions).
        with db.connection(), db.connection():
            with pytest.raises(StoreError) as caught, core.store_errors():
                core.transition(db, Command(agent.id, Event.SUBMIT, "test", request_id="r-1"))
        assert is_outage(caught.value), caught.value
        assert "QueuePool limit" in str(caught.value)
        state = client.get_state(agent.id)
        assert (state.phase, state.revision) == ("idle", 0), "nothing was written"
        # Connections back in the pool: the same command goes through.
        with core.store_errors():
            core.transition(db, Command(agent.id, Event.SUBMIT, "test", request_id="r-1"))
        assert client.get_state(agent.id).phase == "planning"
    finally:
        db.dispose()

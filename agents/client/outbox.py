"""The direct client's outbox: a request's messages, and an operator's retry of a dead one."""

from __future__ import annotations

from typing import Any

from agents.client.base import ClientBase
from agents.client.checks import AgentRef, check_actor
from agents.core import transition as core
from agents.core.commands import check_text
from agents.outbox.relay import retry_dead
from models.outbox_sql import request_messages
from models.outcome_sql import dead_messages


class OutboxMixin(ClientBase):
    def request_messages(self, agent: AgentRef, request_id: str) -> list[dict[str, Any]]:
        """The outbox messages of the agent's request ``request_id``, in the order they were emitted."""
        check_text("request_id", request_id, limit=200)
        agent_id = self._chain_id(agent)
        with core.store_errors():
            return request_messages(self.db, agent_id, request_id)

    def dead_messages(self, agent: AgentRef) -> int:
        """How many of the agent's Slack/GitHub messages are dead now: side effects that never arrived (``keel outbox
        retry KEY`` sends one again)."""
        agent_id = self._chain_id(agent)
        with core.store_errors():
            return dead_messages(self.db, agent_id)

    def retry_outbox(self, key: str, *, actor: str) -> None:
        """Put a dead outbox message back to pending (reconciled with its receiver first if it may have arrived),
        journaled on its agent's chain. Raises ``MessageNotFound`` / ``MessageNotDead``."""
        check_actor(actor)
        check_text("key", key, limit=600)
        retry_dead(self.db, key, actor=actor)

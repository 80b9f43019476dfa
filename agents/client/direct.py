"""``Client``: the producer API on Keel's database, assembled from one mixin per concept."""

from __future__ import annotations

from agents.client.agents import AgentsMixin
from agents.client.approvals import ApprovalsMixin
from agents.client.journal import JournalMixin
from agents.client.outbox import OutboxMixin
from agents.client.requests import RequestsMixin


class Client(AgentsMixin, RequestsMixin, ApprovalsMixin, JournalMixin, OutboxMixin):
    """Talks to Keel's database directly; every change goes through :func:`agents.core.transition.transition`.

    ``Client(db, settings, publisher=...)``, or ``Client.from_settings()``; use it as a context manager."""

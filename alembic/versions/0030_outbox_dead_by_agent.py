"""An agent's dead outbox messages, read by the agent's state (``AgentState.dead_messages``): ``ix_outbox_dead_agent``,
a partial index holding only dead messages, so the read costs next to nothing however long the outbox is.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE INDEX IF NOT EXISTS ix_outbox_dead_agent ON outbox (agent_id) WHERE status = 'dead'")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_outbox_dead_agent")

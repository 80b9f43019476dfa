"""Two outbox indexes for a request's outcome and an agent's dead side effects: ``ix_outbox_request`` (a request's
messages in order: the outcome, the story) and ``ix_outbox_dead_agent`` (an agent's dead messages: a partial index
that holds only those, so the read costs next to nothing however long the outbox is).

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
    op.execute("CREATE INDEX IF NOT EXISTS ix_outbox_request ON outbox (agent_id, request_id, seq)")
    op.execute("CREATE INDEX IF NOT EXISTS ix_outbox_dead_agent ON outbox (agent_id) WHERE status = 'dead'")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_outbox_dead_agent")
    op.execute("DROP INDEX IF EXISTS ix_outbox_request")

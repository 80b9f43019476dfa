"""Indexes for calls waiting for approval: the inbox (``GET /v1/approvals``, ``keel approvals``) and the beat's
approval-timeout pass start from the agents waiting for a person (``ix_agents_waiting``) and find each one's gate
step by its request (``ix_jobs_gates``).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_agents_waiting", "agents", ["id"], unique=False, postgresql_where=sa.text("phase = 'waiting_approval'")
    )
    op.create_index(
        "ix_jobs_gates",
        "jobs",
        ["request_id", "finished_at"],
        unique=False,
        postgresql_where=sa.text("operation = 'gate' AND status = 'succeeded'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_gates", table_name="jobs")
    op.drop_index("ix_agents_waiting", table_name="agents")

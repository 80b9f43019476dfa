"""Indexes for the console's pages, read a page at a time by keyset: the agents list in the order people handle
them (those waiting for approval longest first, ``ix_agents_waiting_since``; then per phase newest first,
``ix_agents_by_phase``) and the Outbox page's messages not sent yet, newest first (``ix_outbox_unsent``: sent
messages are most of the table, and a scan of the whole ``seq`` index would step over all of them).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_agents_waiting_since",
        "agents",
        ["updated_at", "id"],
        unique=False,
        postgresql_where=sa.text("phase = 'waiting_approval' AND archived_at IS NULL"),
    )
    op.create_index(
        "ix_agents_by_phase",
        "agents",
        ["phase", "created_at", "id"],
        unique=False,
        postgresql_where=sa.text("archived_at IS NULL"),
    )
    op.create_index(
        "ix_outbox_unsent",
        "outbox",
        ["seq"],
        unique=False,
        postgresql_where=sa.text("status IN ('pending', 'sending', 'dead')"),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_unsent", table_name="outbox")
    op.drop_index("ix_agents_by_phase", table_name="agents")
    op.drop_index("ix_agents_waiting_since", table_name="agents")

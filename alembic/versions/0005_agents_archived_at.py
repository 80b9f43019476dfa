"""Agents can be archived: hidden from lists, refusing new requests, their row and journal kept.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-14
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("agents", sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True))
    # `keel agent list`: newest first, keyset-paginated, archived agents apart.
    op.create_index("ix_agents_listing", "agents", ["created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_agents_listing", table_name="agents")
    op.drop_column("agents", "archived_at")

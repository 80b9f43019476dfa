"""Outbox: rate-limited attempts counted apart from the attempts that count toward KEEL_OUTBOX_MAX_ATTEMPTS.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox", sa.Column("rate_limited_attempts", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    op.drop_column("outbox", "rate_limited_attempts")

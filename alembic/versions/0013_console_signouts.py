"""Console sign-outs: the sessions signed out before they expired, refused from then on even to a copy of the
cookie (a session is a signed cookie, not a stored row). A row is kept until its session would have expired.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_signouts",
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )
    op.create_index("ix_console_signouts_expires_at", "console_signouts", ["expires_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_console_signouts_expires_at", table_name="console_signouts")
    op.drop_table("console_signouts")

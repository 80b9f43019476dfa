"""The beat leader's lease: ``beat_leadership`` holds one row per leadership (the beat's, ``name = 'beat'``): who
holds it, its term (a fencing number, +1 on every change of hands, never reused) and until when, on the database's
clock. It replaces the session advisory lock, which a transaction pooler (PgBouncer ``pool_mode=transaction``)
cannot hold for a client: tasks/leadership.py.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "beat_leadership",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("term > 0", name=op.f("ck_beat_leadership_term_positive")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_beat_leadership")),
    )


def downgrade() -> None:
    op.drop_table("beat_leadership")

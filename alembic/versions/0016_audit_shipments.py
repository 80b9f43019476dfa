"""Audit shipments: one row per journal segment confirmed in the separate store (`keel audit ship`), the shipper's
note of its progress. The store is the authority: a shipper resuming reads the store, this only tells it where to
look and tells people how far shipping has got.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_shipments",
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("first_id", sa.BigInteger(), nullable=False),
        sa.Column("last_id", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("segment", sa.Text(), nullable=False),
        sa.Column("manifest_sha256", sa.Text(), nullable=False),
        sa.Column("shipped_at", sa.DateTime(timezone=True), server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.CheckConstraint("first_id <= last_id", name=op.f("ck_audit_shipments_range")),
        sa.PrimaryKeyConstraint("destination", "last_id"),
    )


def downgrade() -> None:
    op.drop_table("audit_shipments")

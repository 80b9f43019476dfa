"""Verify progress: ``audit_verified_chains``, one sealed checkpoint per chain (its last verified event and link), so
`keel audit verify` reads only the events after it, a chunk of chains per short transaction; and a partial index on
the reconciled deliveries, so `keel outbox stats` counts them without reading every delivery.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_verified_chains",
        sa.Column("agent_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("hash", sa.Text(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=True),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("keyed_at", sa.BigInteger(), nullable=False),
        sa.Column("deleted_at", sa.BigInteger(), nullable=False),
        sa.Column("legacy", sa.BigInteger(), nullable=False),
        sa.Column(
            "verified_at", sa.DateTime(timezone=True), server_default=sa.text("clock_timestamp()"), nullable=False
        ),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("seal", sa.Text(), nullable=False),
        sa.CheckConstraint("seq >= 1", name=op.f("ck_audit_verified_chains_seq_positive")),
        sa.PrimaryKeyConstraint("agent_id", name=op.f("pk_audit_verified_chains")),
    )
    op.create_index(
        "ix_delivery_log_reconciled", "delivery_log", ["id"], postgresql_where=sa.text("how = 'reconciled'")
    )


def downgrade() -> None:
    op.drop_index("ix_delivery_log_reconciled", table_name="delivery_log")
    op.drop_table("audit_verified_chains")

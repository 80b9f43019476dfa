"""Archived partitions: one sealed row per month of the journal that `keel audit archive` removed from the database
once every event in it was shipped and verified (docs/audit-retention.md). ``keel audit verify`` starts each chain
from the newest record's head for it (``heads``), and ``verify --against`` checks each record against the store.

The table is insert-only, as the journal is (triggers refuse UPDATE, DELETE and TRUNCATE); only the owner may INSERT
(the application and the auditor read it: models/roles.py), and each row is sealed with an HMAC under the audit key
ring (``key_id``, ``seal``), so a row the owner inserts without the key does not verify.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from models.migrations import DowngradeRefused
from sqlalchemy.dialects import postgresql

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_INSERT_ONLY = """
CREATE FUNCTION audit.keel_archived_partitions_insert_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit.archived_partitions is insert-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER archived_partitions_no_update_delete BEFORE UPDATE OR DELETE ON audit.archived_partitions
    FOR EACH ROW EXECUTE FUNCTION audit.keel_archived_partitions_insert_only();
CREATE TRIGGER archived_partitions_no_truncate BEFORE TRUNCATE ON audit.archived_partitions
    FOR EACH STATEMENT EXECUTE FUNCTION audit.keel_archived_partitions_insert_only();
"""


def upgrade() -> None:
    op.create_table(
        "archived_partitions",
        sa.Column("partition", sa.Text(), nullable=False),
        sa.Column("from_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("to_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("first_id", sa.BigInteger(), nullable=True),
        sa.Column("last_id", sa.BigInteger(), nullable=True),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("manifests", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("heads", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("archived_by", sa.Text(), nullable=False),
        sa.Column("archived_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("seal", sa.Text(), nullable=False),
        sa.CheckConstraint(
            "(events = 0 AND first_id IS NULL AND last_id IS NULL) OR (events > 0 AND first_id <= last_id)",
            name=op.f("ck_archived_partitions_range"),
        ),
        sa.PrimaryKeyConstraint("partition", name=op.f("pk_archived_partitions")),
        schema="audit",
    )
    op.execute(_INSERT_ONLY)


def downgrade() -> None:
    archived = op.get_bind().execute(sa.text("SELECT count(*) FROM audit.archived_partitions")).scalar_one()
    if archived:
        raise DowngradeRefused(
            f"cannot downgrade below 0018: audit.archived_partitions records {archived} archived part(s) of the"
            " journal (their events are only in the store now), and Keel before 0017 would call every chain that"
            " starts past its archived part broken; stay on 0017 or later"
        )
    op.drop_table("archived_partitions", schema="audit")
    op.execute("DROP FUNCTION audit.keel_archived_partitions_insert_only()")

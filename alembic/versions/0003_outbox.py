"""The transactional outbox and its append-only delivery log; journal kind "operator".

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

DELIVERY_LOG_APPEND_ONLY = """
CREATE FUNCTION keel_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER delivery_log_no_update_delete BEFORE UPDATE OR DELETE ON delivery_log
    FOR EACH ROW EXECUTE FUNCTION keel_refuse_change();
CREATE TRIGGER delivery_log_no_truncate BEFORE TRUNCATE ON delivery_log
    FOR EACH STATEMENT EXECUTE FUNCTION keel_refuse_change();
"""

KINDS_0002 = "kind IN ('created', 'transition', 'rejected', 'suppressed')"
KINDS_0003 = "kind IN ('created', 'transition', 'rejected', 'suppressed', 'operator')"


def upgrade() -> None:
    op.create_table('outbox',
    sa.Column('key', sa.Text(), nullable=False),
    sa.Column('seq', sa.BigInteger(), sa.Identity(always=True), nullable=False),
    sa.Column('agent_id', sa.UUID(), nullable=False),
    sa.Column('request_id', sa.Text(), nullable=False),
    sa.Column('channel', sa.Text(), nullable=False),
    sa.Column('destination', sa.Text(), nullable=False),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('status', sa.Text(), server_default='pending', nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('claim_token', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('needs_reconcile', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('external_id', sa.Text(), nullable=True),
    sa.Column('external_url', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('sent_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("channel IN ('slack', 'github')", name=op.f('ck_outbox_channel')),
    sa.CheckConstraint("status <> 'sent' OR external_id IS NOT NULL", name=op.f('ck_outbox_sent_has_external_id')),
    sa.CheckConstraint("status IN ('pending', 'sending', 'sent', 'dead')", name=op.f('ck_outbox_status')),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_outbox_agent_id_agents')),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_outbox')),
    sa.UniqueConstraint('seq', name=op.f('uq_outbox_seq'))
    )
    op.create_index('ix_outbox_line', 'outbox', ['destination', 'seq'], unique=False, postgresql_where=sa.text("status IN ('pending', 'sending')"))
    op.create_table('delivery_log',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=True), nullable=False),
    sa.Column('key', sa.Text(), nullable=False),
    sa.Column('external_id', sa.Text(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('how', sa.Text(), nullable=False),
    sa.Column('confirmed_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("how IN ('sent', 'reconciled')", name=op.f('ck_delivery_log_how')),
    sa.ForeignKeyConstraint(['key'], ['outbox.key'], name=op.f('fk_delivery_log_key_outbox')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_delivery_log'))
    )
    op.create_index(op.f('ix_delivery_log_key'), 'delivery_log', ['key'], unique=False)
    op.execute(DELIVERY_LOG_APPEND_ONLY)
    op.drop_constraint(op.f("ck_journal_kind"), "journal", schema="audit", type_="check")
    op.create_check_constraint(op.f("ck_journal_kind"), "journal", KINDS_0003, schema="audit")


def downgrade() -> None:
    op.drop_constraint(op.f("ck_journal_kind"), "journal", schema="audit", type_="check")
    op.create_check_constraint(op.f("ck_journal_kind"), "journal", KINDS_0002, schema="audit")
    op.execute("DROP TABLE delivery_log")
    op.execute("DROP FUNCTION keel_refuse_change()")
    op.drop_index("ix_outbox_line", table_name="outbox")
    op.drop_table("outbox")

"""Agents, requests and the append-only audit journal.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# The journal is append-only: these triggers refuse UPDATE, DELETE and TRUNCATE from every role while they fire. They
# do not bind the table's owner or a superuser, who can switch them off (ALTER TABLE … DISABLE TRIGGER,
# SET session_replication_role = replica), drop them or replace their function. So Keel's processes run as a role that
# neither owns the journal nor holds more than SELECT and INSERT on it (models/roles.py, `keel db roles`), and refuse
# in production to run as one that could; the owner's credentials are for migrations only.
JOURNAL_APPEND_ONLY = """
CREATE FUNCTION audit.refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit.journal is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER journal_no_update_delete BEFORE UPDATE OR DELETE ON audit.journal
    FOR EACH ROW EXECUTE FUNCTION audit.refuse_change();
CREATE TRIGGER journal_no_truncate BEFORE TRUNCATE ON audit.journal
    FOR EACH STATEMENT EXECUTE FUNCTION audit.refuse_change();
"""

# The database keeps revisions honest too: +1 with every change of state, never reused, never skipped,
# and the journal chain only moves forward.
AGENT_REVISION_GUARD = """
CREATE FUNCTION keel_agents_revision_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id <> OLD.id OR NEW.name <> OLD.name OR NEW.created_at <> OLD.created_at THEN
        RAISE EXCEPTION 'agents: id, name and created_at never change';
    END IF;
    IF NEW.revision = OLD.revision THEN
        IF (NEW.phase, NEW.request_id, NEW.soft_deadline, NEW.hard_deadline)
           IS DISTINCT FROM (OLD.phase, OLD.request_id, OLD.soft_deadline, OLD.hard_deadline) THEN
            RAISE EXCEPTION 'agents: a change of state must bump the revision (agent %, revision %)',
                OLD.id, OLD.revision;
        END IF;
    ELSIF NEW.revision <> OLD.revision + 1 THEN
        RAISE EXCEPTION 'agents: revision must go from % to %, not to %', OLD.revision, OLD.revision + 1,
            NEW.revision;
    END IF;
    IF NEW.journal_seq < OLD.journal_seq THEN
        RAISE EXCEPTION 'agents: the journal chain never moves back (% to %)', OLD.journal_seq, NEW.journal_seq;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER agents_revision_guard BEFORE UPDATE ON agents
    FOR EACH ROW EXECUTE FUNCTION keel_agents_revision_guard();
"""


def upgrade() -> None:
    op.execute("CREATE SCHEMA IF NOT EXISTS audit")
    op.create_table('agents',
    sa.Column('id', sa.UUID(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('phase', sa.Text(), server_default='idle', nullable=False),
    sa.Column('request_id', sa.Text(), nullable=True),
    sa.Column('revision', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('soft_deadline', sa.DateTime(timezone=True), nullable=True),
    sa.Column('hard_deadline', sa.DateTime(timezone=True), nullable=True),
    sa.Column('budget_tokens', sa.BigInteger(), nullable=True),
    sa.Column('budget_cost', sa.Numeric(precision=18, scale=6), nullable=True),
    sa.Column('spent_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('spent_cost', sa.Numeric(precision=18, scale=6), server_default='0', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('journal_seq', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('journal_head', sa.Text(), server_default='0000000000000000000000000000000000000000000000000000000000000000', nullable=False),
    sa.CheckConstraint("phase IN ('idle', 'planning', 'executing', 'waiting_approval', 'done', 'failed')", name=op.f('ck_agents_phase')),
    sa.CheckConstraint('budget_cost IS NULL OR budget_cost >= 0', name=op.f('ck_agents_budget_cost_non_negative')),
    sa.CheckConstraint('budget_tokens IS NULL OR budget_tokens >= 0', name=op.f('ck_agents_budget_tokens_non_negative')),
    sa.CheckConstraint('char_length(name) BETWEEN 1 AND 200', name=op.f('ck_agents_name_length')),
    sa.CheckConstraint('revision >= 0', name=op.f('ck_agents_revision_non_negative')),
    sa.CheckConstraint('soft_deadline IS NULL OR hard_deadline IS NULL OR soft_deadline <= hard_deadline', name=op.f('ck_agents_soft_before_hard')),
    sa.CheckConstraint('spent_cost >= 0', name=op.f('ck_agents_spent_cost_non_negative')),
    sa.CheckConstraint('spent_tokens >= 0', name=op.f('ck_agents_spent_tokens_non_negative')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_agents')),
    sa.UniqueConstraint('name', name=op.f('uq_agents_name'))
    )
    op.create_table('journal',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=True), nullable=False),
    sa.Column('agent_id', sa.UUID(), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('event', sa.Text(), nullable=False),
    sa.Column('actor', sa.Text(), nullable=False),
    sa.Column('request_id', sa.Text(), nullable=True),
    sa.Column('from_phase', sa.Text(), nullable=True),
    sa.Column('to_phase', sa.Text(), nullable=True),
    sa.Column('revision', sa.BigInteger(), nullable=False),
    sa.Column('decision', sa.Text(), nullable=False),
    sa.Column('details', sa.JSON(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('prev_hash', sa.Text(), nullable=False),
    sa.Column('hash', sa.Text(), nullable=False),
    sa.CheckConstraint("kind IN ('created', 'transition', 'rejected', 'suppressed')", name=op.f('ck_journal_kind')),
    sa.CheckConstraint('seq >= 1', name=op.f('ck_journal_seq_positive')),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_journal_agent_id_agents')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_journal')),
    sa.UniqueConstraint('agent_id', 'seq', name=op.f('uq_journal_agent_id_seq')),
    schema='audit'
    )
    op.create_index(op.f('ix_journal_request_id'), 'journal', ['request_id'], unique=False, schema='audit')
    op.create_table('requests',
    sa.Column('request_id', sa.Text(), nullable=False),
    sa.Column('agent_id', sa.UUID(), nullable=False),
    sa.Column('input', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('actor', sa.Text(), nullable=False),
    sa.Column('submitted_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_requests_agent_id_agents')),
    sa.PrimaryKeyConstraint('request_id', name=op.f('pk_requests'))
    )
    op.create_index(op.f('ix_requests_agent_id'), 'requests', ['agent_id'], unique=False)
    op.execute(JOURNAL_APPEND_ONLY)
    op.execute(AGENT_REVISION_GUARD)


def downgrade() -> None:
    op.execute("DROP TRIGGER agents_revision_guard ON agents")
    op.execute("DROP FUNCTION keel_agents_revision_guard()")
    op.drop_index(op.f('ix_requests_agent_id'), table_name='requests')
    op.drop_table('requests')
    op.drop_index(op.f('ix_journal_request_id'), table_name='journal', schema='audit')
    op.drop_table('journal', schema='audit')
    op.execute("DROP FUNCTION audit.refuse_change()")
    op.execute("DROP SCHEMA audit")
    op.drop_table('agents')

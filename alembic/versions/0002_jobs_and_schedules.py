"""Jobs (run-once claims with leases and fencing tokens), recurring schedules, agent priority.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


# A finished job never changes status again, and a fencing token never goes back.
JOB_GUARD = """
CREATE FUNCTION keel_jobs_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.key <> OLD.key OR NEW.agent_id <> OLD.agent_id THEN
        RAISE EXCEPTION 'jobs: key and agent never change';
    END IF;
    IF OLD.status IN ('succeeded', 'failed', 'cancelled', 'dead') AND NEW.status <> OLD.status THEN
        RAISE EXCEPTION 'jobs: % is % already and cannot become %', OLD.key, OLD.status, NEW.status;
    END IF;
    IF NEW.fencing_token < OLD.fencing_token THEN
        RAISE EXCEPTION 'jobs: fencing token of % cannot go back from % to %', OLD.key, OLD.fencing_token,
            NEW.fencing_token;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER jobs_guard BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION keel_jobs_guard();
"""


# The revision guard of 0001, now also covering priority, spend and budget: state, so it moves only with a revision.
AGENT_REVISION_GUARD = """
CREATE OR REPLACE FUNCTION keel_agents_revision_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id <> OLD.id OR NEW.name <> OLD.name OR NEW.created_at <> OLD.created_at THEN
        RAISE EXCEPTION 'agents: id, name and created_at never change';
    END IF;
    IF NEW.revision = OLD.revision THEN
        IF (NEW.phase, NEW.request_id, NEW.soft_deadline, NEW.hard_deadline, NEW.priority, NEW.spent_tokens, NEW.spent_cost, NEW.budget_tokens, NEW.budget_cost)
           IS DISTINCT FROM (OLD.phase, OLD.request_id, OLD.soft_deadline, OLD.hard_deadline, OLD.priority, OLD.spent_tokens, OLD.spent_cost, OLD.budget_tokens, OLD.budget_cost) THEN
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
    IF NEW.journal_seq <> OLD.journal_seq AND NEW.journal_seq <> OLD.journal_seq + 1 THEN
        RAISE EXCEPTION 'agents: the journal head of agent % must move to its next event', NEW.id;
    END IF;
    IF NEW.revision <> OLD.revision AND NEW.journal_seq = OLD.journal_seq THEN
        RAISE EXCEPTION 'agents: revision % of agent % has no transition event in audit.journal', NEW.revision, NEW.id;
    END IF;
    RETURN NEW;
END;
$$;
"""
# No change of state without its journal event: at commit, the head must point at the event that explains it.
# Deferred, so a transition can write its event and its row in one statement.
AGENTS_JOURNALED = """
CREATE FUNCTION keel_agents_journaled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.revision <> OLD.revision AND NOT EXISTS (
        SELECT 1 FROM audit.journal j WHERE j.agent_id = NEW.id AND j.seq = NEW.journal_seq
           AND j.hash = NEW.journal_head AND j.kind = 'transition' AND j.revision = NEW.revision
           AND j.to_phase = NEW.phase) THEN
        RAISE EXCEPTION 'agents: revision % of agent % has no transition event in audit.journal', NEW.revision, NEW.id;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM audit.journal j WHERE j.agent_id = NEW.id AND j.seq = NEW.journal_seq
           AND j.hash = NEW.journal_head) THEN
        RAISE EXCEPTION 'agents: the journal head of agent % must move to its next event', NEW.id;
    END IF;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER agents_journaled AFTER UPDATE ON agents DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.journal_seq <> OLD.journal_seq OR NEW.revision <> OLD.revision)
    EXECUTE FUNCTION keel_agents_journaled();
"""
AGENT_REVISION_GUARD_0001 = """
CREATE OR REPLACE FUNCTION keel_agents_revision_guard() RETURNS trigger LANGUAGE plpgsql AS $$
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
"""


def upgrade() -> None:
    op.execute("CREATE SEQUENCE job_fencing_token_seq")
    op.create_table('jobs',
    sa.Column('key', sa.Text(), nullable=False),
    sa.Column('agent_id', sa.UUID(), nullable=False),
    sa.Column('request_id', sa.Text(), nullable=False),
    sa.Column('operation', sa.Text(), nullable=False),
    sa.Column('target', sa.Text(), nullable=False),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('status', sa.Text(), server_default='pending', nullable=False),
    sa.Column('queue', sa.Text(), nullable=False),
    sa.Column('priority', sa.SmallInteger(), server_default='5', nullable=False),
    sa.Column('run_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('error_attempts', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('fencing_token', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('worker', sa.Text(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('error_class', sa.Text(), nullable=True),
    sa.Column('result', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('cost', sa.Numeric(precision=18, scale=6), server_default='0', nullable=False),
    sa.Column('failed_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('failed_cost', sa.Numeric(precision=18, scale=6), server_default='0', nullable=False),
    sa.Column('suppressed', sa.Integer(), server_default='0', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('enqueued_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status <> 'running' OR lease_until IS NOT NULL", name=op.f('ck_jobs_running_has_lease')),
    sa.CheckConstraint("status IN ('pending', 'enqueued', 'running', 'succeeded', 'failed', 'cancelled', 'dead')", name=op.f('ck_jobs_status')),
    sa.CheckConstraint('attempts >= 0 AND tokens >= 0 AND cost >= 0 AND failed_tokens >= 0 AND failed_cost >= 0', name=op.f('ck_jobs_non_negative')),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_jobs_agent_id_agents')),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_jobs'))
    )
    op.create_index('ix_jobs_agent_live', 'jobs', ['agent_id'], unique=False, postgresql_where=sa.text("status IN ('pending', 'enqueued', 'running')"))
    op.create_index('ix_jobs_due', 'jobs', ['run_at'], unique=False, postgresql_where=sa.text("status IN ('pending', 'enqueued', 'running')"))
    op.create_table('schedules',
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('agent_id', sa.UUID(), nullable=False),
    sa.Column('every_seconds', sa.Integer(), nullable=True),
    sa.Column('cron', sa.Text(), nullable=True),
    sa.Column('operation', sa.Text(), nullable=False),
    sa.Column('input', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('enabled', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('next_fire_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_fire_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_outcome', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('(every_seconds IS NULL) <> (cron IS NULL)', name=op.f('ck_schedules_interval_or_cron')),
    sa.CheckConstraint('every_seconds IS NULL OR every_seconds > 0', name=op.f('ck_schedules_every_positive')),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_schedules_agent_id_agents')),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_schedules'))
    )
    op.add_column('agents', sa.Column('priority', sa.Text(), server_default='normal', nullable=False))
    op.create_check_constraint(op.f("ck_agents_priority"), "agents", "priority IN ('normal', 'low')")
    op.execute(JOB_GUARD)
    op.execute(AGENT_REVISION_GUARD)
    op.execute(AGENTS_JOURNALED)


def downgrade() -> None:
    op.execute("DROP TRIGGER agents_journaled ON agents")
    op.execute("DROP FUNCTION keel_agents_journaled()")
    op.execute(AGENT_REVISION_GUARD_0001)
    op.execute("DROP TRIGGER jobs_guard ON jobs")
    op.execute("DROP FUNCTION keel_jobs_guard()")
    op.drop_constraint(op.f("ck_agents_priority"), "agents", type_="check")
    op.drop_column('agents', 'priority')
    op.drop_table('schedules')
    op.drop_index('ix_jobs_due', table_name='jobs', postgresql_where=sa.text("status IN ('pending', 'enqueued', 'running')"))
    op.drop_index('ix_jobs_agent_live', table_name='jobs', postgresql_where=sa.text("status IN ('pending', 'enqueued', 'running')"))
    op.drop_table('jobs')
    op.execute("DROP SEQUENCE job_fencing_token_seq")

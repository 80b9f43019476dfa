"""System messages in the outbox (alerts, the daily KPI report), the beat leader's terms, recorded audit verifies.

An outbox message belongs to an agent, except Keel's own: an alert or the daily KPI report has no agent, so
``outbox.agent_id`` may be NULL for those only — the check ``system_message`` allows it for the system's request ids
(``alert``, ``kpi``) and no other, and the trigger that checks an agent exists (``keel_agent_exists``, 0006) still
runs for every message that names one. Their keys keep the outbox's three segments: ``alert:{name}:{start}:firing``.

``beat_terms``: one row per leadership term of the beat (who, since when, its last tick on the database's clock,
and how long nobody led before it): the "no beat leader for a while" alert and the last-tick gauge read it.
``beat_chores``: when the leader last ran each periodic chore (alert evaluation, audit verify, KPI report), on the
database's clock, so two beats or a restarted one never run a chore more often than its interval.
``audit_verifications``: the outcome of every `keel audit verify` (the command's and the beat's periodic one).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SYSTEM_MESSAGE = "agent_id IS NOT NULL OR request_id IN ('alert', 'kpi')"

_REFUSE_DOWNGRADE = """
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox WHERE agent_id IS NULL) THEN
        RAISE EXCEPTION 'cannot downgrade below 0010: % outbox messages are Keel''s own (alerts, KPI reports) and 0008 needs an agent on every message',
            (SELECT count(*) FROM outbox WHERE agent_id IS NULL);
    END IF;
END;
$$;
"""


def upgrade() -> None:
    op.alter_column("outbox", "agent_id", existing_type=sa.UUID(), nullable=True)
    op.create_check_constraint(op.f("ck_outbox_system_message"), "outbox", SYSTEM_MESSAGE)
    op.execute("DROP TRIGGER outbox_agent_exists ON outbox")
    op.execute(
        "CREATE TRIGGER outbox_agent_exists BEFORE INSERT OR UPDATE OF agent_id ON outbox"
        " FOR EACH ROW WHEN (NEW.agent_id IS NOT NULL) EXECUTE FUNCTION keel_agent_exists()"
    )
    op.create_table(
        "beat_terms",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("leader", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_tick_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("gap_seconds", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_beat_terms")),
    )
    op.create_index(op.f("ix_beat_terms_started_at"), "beat_terms", ["started_at"], unique=False)
    op.create_table(
        "beat_chores",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("last_run_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_beat_chores")),
    )
    op.create_table(
        "audit_verifications",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("agents", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("breaks", sa.BigInteger(), nullable=False),
        sa.Column("details", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.CheckConstraint("source IN ('cli', 'beat')", name=op.f("ck_audit_verifications_source")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_verifications")),
    )


def downgrade() -> None:
    op.execute(_REFUSE_DOWNGRADE)
    op.drop_table("audit_verifications")
    op.drop_table("beat_chores")
    op.drop_index(op.f("ix_beat_terms_started_at"), table_name="beat_terms")
    op.drop_table("beat_terms")
    op.execute("DROP TRIGGER outbox_agent_exists ON outbox")
    op.execute(
        "CREATE TRIGGER outbox_agent_exists BEFORE INSERT OR UPDATE OF agent_id ON outbox"
        " FOR EACH ROW EXECUTE FUNCTION keel_agent_exists()"
    )
    op.drop_constraint(op.f("ck_outbox_system_message"), "outbox", type_="check")
    op.alter_column("outbox", "agent_id", existing_type=sa.UUID(), nullable=False)

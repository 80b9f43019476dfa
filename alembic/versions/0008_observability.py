"""Observability: KPI counters kept in the transactions that cause them, alert episodes, trace context.

``kpi_deltas`` is insert-only: the transaction that causes a KPI to move (a journal event, a job's outcome, a
confirmed delivery) inserts one row per counter it moves, so no two transactions ever wait on one counter row. The
leading beat folds deltas into ``kpi_rollups`` (per minute, and one running total per counter at bucket
``-infinity``) and deletes them in the same transaction, so a reader sums the rollups and the few deltas not folded
yet: cost grows with the counters and the time window read, never with history. Values are ``numeric``, exact: a sum
must not depend on how the deltas were grouped (rollup + d1 + d2 before a fold, rollup + (d1 + d2) after it), or a
counter could read a hair lower after a fold than before it, which Prometheus takes for a reset.

``alert_episodes``: one row per firing of an alert (firing → resolved). At most one episode per alert is open, which
the database holds (a partial unique index), so two beats can never open one episode twice.

``jobs.traceparent`` and ``outbox.traceparent``: the W3C trace context of the request that caused the row, so one
trace follows a request across processes and retries; ``requests.traceparent``: the submit's, which the rows a later
transition of the request inserts carry when that transition runs in another trace (an approval).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kpi_deltas",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("label", sa.Text(), server_default="", nullable=False),
        sa.Column("value", sa.Numeric(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kpi_deltas")),
    )
    op.create_table(
        "kpi_rollups",
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("label", sa.Text(), server_default="", nullable=False),
        sa.Column("value", sa.Numeric(), nullable=False),
        sa.PrimaryKeyConstraint("name", "label", "bucket", name=op.f("pk_kpi_rollups")),
    )
    op.create_index("ix_kpi_rollups_bucket", "kpi_rollups", ["bucket"])
    op.create_table(
        "alert_episodes",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("last_value", sa.Float(), nullable=True),
        sa.Column("last_evaluated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("details", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.CheckConstraint("resolved_at IS NULL OR resolved_at >= started_at", name=op.f("ck_alert_episodes_resolved_after_start")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_episodes")),
        sa.UniqueConstraint("name", "started_at", name=op.f("uq_alert_episodes_name_started_at")),
    )
    op.create_index(
        "ix_alert_episodes_open", "alert_episodes", ["name"], unique=True, postgresql_where=sa.text("resolved_at IS NULL")
    )
    op.add_column("jobs", sa.Column("traceparent", sa.Text(), nullable=True))
    op.add_column("outbox", sa.Column("traceparent", sa.Text(), nullable=True))
    op.add_column("requests", sa.Column("traceparent", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("requests", "traceparent")
    op.drop_column("outbox", "traceparent")
    op.drop_column("jobs", "traceparent")
    op.drop_index("ix_alert_episodes_open", table_name="alert_episodes")
    op.drop_table("alert_episodes")
    op.drop_index("ix_kpi_rollups_bucket", table_name="kpi_rollups")
    op.drop_table("kpi_rollups")
    op.drop_table("kpi_deltas")

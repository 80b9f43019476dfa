"""Indexes for the periodic passes and the plan step's read, so that each costs what it takes, not what the tables
hold (issue 15):

- ``ix_jobs_request``: a request's jobs in order (a plan step's conversation, the approvals of a waiting agent,
  superseding a round) — before this, every such read scanned every job ever run;
- ``ix_jobs_pending`` / ``ix_jobs_enqueued`` / ``ix_jobs_leased``: the dispatcher's three cases (due new jobs by
  priority, enqueued ones never claimed, running ones whose lease expired), each read a batch at a time;
- ``ix_jobs_due`` leads with the status now: read by run_at alone, a scan for the jobs due walked every enqueued job
  waiting its turn (the planner took it for the commonest priority, whose rows it cannot tell from history's);
- ``ix_agents_hard_deadline`` / ``ix_agents_soft_deadline``: active agents by deadline (the deadline pass);
- ``ix_schedules_due``: enabled schedules by next fire time.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_ACTIVE = "phase IN ('planning', 'executing', 'waiting_approval')"


_LIVE = "status IN ('pending', 'enqueued', 'running')"


def upgrade() -> None:
    op.drop_index("ix_jobs_due", table_name="jobs")
    op.create_index("ix_jobs_due", "jobs", ["status", "run_at"], unique=False, postgresql_where=sa.text(_LIVE))
    op.create_index("ix_jobs_request", "jobs", ["request_id", "created_at", "key"], unique=False)
    op.create_index(
        "ix_jobs_pending", "jobs", ["priority", "run_at"], unique=False, postgresql_where=sa.text("status = 'pending'")
    )
    op.create_index(
        "ix_jobs_enqueued", "jobs", ["enqueued_at"], unique=False, postgresql_where=sa.text("status = 'enqueued'")
    )
    op.create_index(
        "ix_jobs_leased", "jobs", ["lease_until"], unique=False, postgresql_where=sa.text("status = 'running'")
    )
    op.create_index(
        "ix_agents_hard_deadline",
        "agents",
        ["hard_deadline", "id"],
        unique=False,
        postgresql_where=sa.text(f"{_ACTIVE} AND hard_deadline IS NOT NULL"),
    )
    op.create_index(
        "ix_agents_soft_deadline",
        "agents",
        ["soft_deadline", "id"],
        unique=False,
        postgresql_where=sa.text(f"{_ACTIVE} AND priority = 'normal' AND soft_deadline IS NOT NULL"),
    )
    op.create_index(
        "ix_schedules_due", "schedules", ["next_fire_at", "name"], unique=False, postgresql_where=sa.text("enabled")
    )


def downgrade() -> None:
    op.drop_index("ix_schedules_due", table_name="schedules")
    op.drop_index("ix_agents_soft_deadline", table_name="agents")
    op.drop_index("ix_agents_hard_deadline", table_name="agents")
    op.drop_index("ix_jobs_leased", table_name="jobs")
    op.drop_index("ix_jobs_enqueued", table_name="jobs")
    op.drop_index("ix_jobs_pending", table_name="jobs")
    op.drop_index("ix_jobs_request", table_name="jobs")
    op.drop_index("ix_jobs_due", table_name="jobs")
    op.create_index("ix_jobs_due", "jobs", ["run_at"], unique=False, postgresql_where=sa.text(_LIVE))

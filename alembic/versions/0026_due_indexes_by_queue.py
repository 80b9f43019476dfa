"""The dispatcher's three due cases are indexed by queue first, so back-pressure holds back one job queue, not all.

A full ``keel.jobs.low`` (``KEEL_DISPATCH_MAX_QUEUE_DEPTH``) used to stop every publish, the normal queue's and the
recoveries too. The dispatcher now asks the queues' depths before it takes a batch and reads the due jobs of the
queues with room only; with the queue leading each index, the jobs of a held queue are not read at all (a filter
on the old indexes would walk them, every tick, in a backlog that is as long as the queue is full).

- ``ix_jobs_pending``: (queue, priority, run_at) of pending jobs — one range per queue and priority;
- ``ix_jobs_enqueued``: (queue, enqueued_at) of enqueued jobs — messages that were never claimed;
- ``ix_jobs_leased``: (queue, lease_until) of running jobs — leases that ran out.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

_INDEXES = (
    ("ix_jobs_pending", ["priority", "run_at"], "status = 'pending'"),
    ("ix_jobs_enqueued", ["enqueued_at"], "status = 'enqueued'"),
    ("ix_jobs_leased", ["lease_until"], "status = 'running'"),
)


def upgrade() -> None:
    for name, columns, where in _INDEXES:
        op.drop_index(name, table_name="jobs")
        op.create_index(name, "jobs", ["queue", *columns], unique=False, postgresql_where=sa.text(where))


def downgrade() -> None:
    for name, columns, where in _INDEXES:
        op.drop_index(name, table_name="jobs")
        op.create_index(name, "jobs", columns, unique=False, postgresql_where=sa.text(where))

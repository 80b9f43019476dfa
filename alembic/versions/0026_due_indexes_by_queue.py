"""The dispatcher's three due cases are indexed by queue first, so back-pressure holds back one job queue, not all.

A full ``keel.jobs.low`` (``KEEL_DISPATCH_MAX_QUEUE_DEPTH``) used to stop every publish, the normal queue's and the
recoveries too. The dispatcher now asks the queues' depths before it takes a batch and reads the due jobs of the
queues with room only; with the queue leading each index, the jobs of a held queue are not read at all (a filter
on the old indexes would walk them, every tick, in a backlog that is as long as the queue is full).

- ``ix_jobs_pending``: (queue, priority, run_at) of pending jobs — one range per queue and priority;
- ``ix_jobs_enqueued``: (queue, enqueued_at) of enqueued jobs — messages that were never claimed;
- ``ix_jobs_leased``: (queue, lease_until) of running jobs — leases that ran out.

Built beside traffic: each new index is built ``CONCURRENTLY`` under a name of its own, the old one dropped
``CONCURRENTLY`` and the new one renamed to its name — no step blocks the jobs table's writes (on a table of millions
of finished jobs a plain build would stop every claim and outcome while it ran). Outside a transaction (Alembic's
``autocommit_block``): a run cut short leaves an invalid ``…_next`` index (dropped and built again by the next run) or
a finished one (kept, and put in place of the old); until it ends, the dispatcher reads through whichever exists. The downgrade runs in its
transaction, as every other does (one that is refused further down changes nothing), and blocks writes to jobs while
it builds.

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
    ("ix_jobs_pending", "priority, run_at", "status = 'pending'"),
    ("ix_jobs_enqueued", "enqueued_at", "status = 'enqueued'"),
    ("ix_jobs_leased", "lease_until", "status = 'running'"),
)


def _built(name: str, columns: str) -> bool:
    """Whether index ``name`` exists, is valid and is on ``columns`` (an earlier run's finished build); never in
    offline mode (``--sql``), whose script builds it again."""
    if op.get_context().as_sql:
        return False
    row = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i"
                " WHERE i.indexrelid = to_regclass(:name)"
            ),
            {"name": name},
        )
        .first()
    )
    return row is not None and bool(row[0]) and f"USING btree ({columns}) WHERE" in str(row[1])


def _rebuild(name: str, columns: str, where: str) -> None:
    """Index ``name`` rebuilt over ``columns`` without a lock that blocks writes; repeatable after any interruption:
    a ``…_next`` an earlier run finished is kept (it may be the only one left), any other is built again."""
    building = f"{name}_next"
    if not _built(building, columns):
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {building}")  # invalid (a build cut short), or not ours
        op.execute(f"CREATE INDEX CONCURRENTLY {building} ON jobs ({columns}) WHERE {where}")
    op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    op.execute(f"ALTER INDEX {building} RENAME TO {name}")


def upgrade() -> None:
    with op.get_context().autocommit_block():
        for name, columns, where in _INDEXES:
            _rebuild(name, f"queue, {columns}", where)


def downgrade() -> None:
    # In the downgrade's transaction (it blocks writes to jobs while the three build): a downgrade past an earlier
    # revision that is refused must leave this one as it was.
    for name, columns, where in _INDEXES:
        op.execute(f"DROP INDEX {name}")
        op.execute(f"CREATE INDEX {name} ON jobs ({columns}) WHERE {where}")

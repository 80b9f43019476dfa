"""A job's queue is one the dispatcher reads: ``ck_jobs_queue``.

The dispatcher publishes the due jobs of ``keel.jobs`` and ``keel.jobs.low`` only (models/tables.py JOB_QUEUES). A job
written with any other queue — a bug, a hand-made insert — would never be published, nor recovered when its lease ran
out: lost without a word. The table now refuses it.

Added beside traffic: the constraint is added ``NOT VALID`` (a catalog change, under a lock held for an instant and
waited for at most ``LOCK_TIMEOUT`` at a time, so a long transaction on jobs never queues every writer behind the
upgrade), then validated in a transaction of its own, which reads the table under a lock that blocks no write. Jobs
already on another queue are named and the upgrade refused, changing nothing: they are for an operator to move.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-03
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

from models.migrations import UpgradeRefused

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

QUEUES = ("keel.jobs", "keel.jobs.low")
LOCK_TIMEOUT = "2s"
ATTEMPTS = 30


def _briefly(statement: str) -> None:
    """Run ``statement`` (which takes a strong lock for an instant) without queueing writers behind it for long; in
    autocommit, so the lock ends with the statement."""
    bind = op.get_bind()
    bind.execute(sa.text(f"SET lock_timeout = '{LOCK_TIMEOUT}'"))
    try:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                bind.execute(sa.text(statement))
                return
            except sa.exc.OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) != "55P03" or attempt == ATTEMPTS:  # lock_not_available
                    raise
                time.sleep(min(attempt, 5))
    finally:
        bind.execute(sa.text("RESET lock_timeout"))


def _refuse_strays(allowed: str) -> None:
    """Refuse, changing nothing, while jobs sit on other queues: VALIDATE would fail on them at every run (and the
    constraint, added NOT VALID, would refuse every update of them meanwhile: an agent's cancel, say)."""
    if op.get_context().as_sql:
        return
    found = op.get_bind().execute(
        sa.text(f"SELECT key, queue FROM jobs WHERE queue NOT IN ({allowed}) ORDER BY key LIMIT 5")
    )
    strays = found.fetchall()
    if strays:
        named = ", ".join(f"{key!r} on {queue!r}" for key, queue in strays)
        raise UpgradeRefused(
            f"cannot upgrade to 0027: jobs sit on queues the dispatcher does not read ({named}{', …' * (len(strays) == 5)});"
            f" move them to one it reads (UPDATE jobs SET queue = 'keel.jobs' WHERE queue NOT IN ({allowed})) or delete"
            " them, then upgrade again; nothing was changed by 0027"
        )


def upgrade() -> None:
    allowed = ", ".join(f"'{queue}'" for queue in QUEUES)
    _refuse_strays(allowed)
    with op.get_context().autocommit_block():
        _briefly("ALTER TABLE jobs DROP CONSTRAINT IF EXISTS ck_jobs_queue")  # an earlier run's, cut short
        _briefly(f"ALTER TABLE jobs ADD CONSTRAINT ck_jobs_queue CHECK (queue IN ({allowed})) NOT VALID")
        op.execute("ALTER TABLE jobs VALIDATE CONSTRAINT ck_jobs_queue")


def downgrade() -> None:
    op.execute("ALTER TABLE jobs DROP CONSTRAINT IF EXISTS ck_jobs_queue")  # in the downgrade's transaction

"""Leaner triggers on a job's path, each guarding exactly what it guarded before.

- ``journal_agent_exists`` is dropped from ``audit.journal`` (and so from its partitions): the append guard (0017)
  reads the agent's row under a stronger lock (``FOR NO KEY UPDATE`` against ``FOR KEY SHARE``) on every append and
  refuses an event of a missing agent with the same error and message (``journal: agent … does not exist (or was
  deleted)``); the journal refuses every UPDATE, so ``OF agent_id`` guarded nothing more. One plpgsql call and one
  row lock less per event.
- ``jobs_guard`` and ``jobs_kpis`` fire only for an UPDATE that sets one of the columns they read
  (``UPDATE OF …``): a lease renewal (``lease_until``) or a staged outcome (``result``) cannot change any of them,
  and now skips both (the guard's plpgsql call, and the KPI trigger's WHEN clause, which PostgreSQL parses again
  for every statement that evaluates it).

Catalog changes only, under ACCESS EXCLUSIVE locks on the journal and on jobs, held for milliseconds: taken with
``lock_timeout`` 2s and tried again (30 times, as 0017), so a long reader (a ``keel audit verify`` snapshot) makes
the migration wait, not every append and claim queue behind it. The journal's refusal of an event of a missing agent
is the append guard's now: an event that is also ill-timed is refused for its time first.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Callable

import time

import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

#: The columns ``keel_jobs_guard()`` compares (0002), and those ``jobs_kpis``' WHEN clause and ``keel_kpi_jobs()``
#: compare (0009).
_GUARDED = "key, agent_id, status, fencing_token"
_COUNTED = "status, fencing_token, error_attempts, tokens, cost, failed_tokens, failed_cost"


def _fire_on(trigger: str, columns: str | None) -> None:
    """Define ``trigger`` on jobs again as it is now, but firing for an UPDATE of ``columns`` (None: of any)."""
    bind = op.get_bind()
    definition = bind.exec_driver_sql(
        f"SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = '{trigger}'"
        " AND tgrelid = 'public.jobs'::regclass"
    ).scalar_one()
    head, on, rest = definition.partition(" ON public.jobs ")
    if not on or " UPDATE" not in head:
        raise RuntimeError(f"migration 0029 cannot read trigger {trigger}: {definition}")
    head = head[: head.index(" UPDATE") + len(" UPDATE")] + (f" OF {columns}" if columns else "")
    bind.exec_driver_sql(f"DROP TRIGGER {trigger} ON jobs")
    bind.exec_driver_sql(f"{head}{on}{rest}".replace("%", "%%"))


#: How long each try waits for its locks, and how often it tries (as 0017).
LOCK_TIMEOUT = "2s"
ATTEMPTS = 30


def _briefly(change: Callable[[], None]) -> None:
    """Run ``change`` with the locks it takes waited for at most :data:`LOCK_TIMEOUT`, tried again until it gets them."""
    bind = op.get_bind()
    bind.execute(sa.text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    for attempt in range(1, ATTEMPTS + 1):
        try:
            with bind.begin_nested():
                change()
            break
        except sa.exc.OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != "55P03" or attempt == ATTEMPTS:  # lock_not_available
                raise
            time.sleep(min(attempt, 5))
    bind.execute(sa.text("SET LOCAL lock_timeout = 0"))


def upgrade() -> None:
    def change() -> None:
        op.execute("DROP TRIGGER journal_agent_exists ON audit.journal")
        _fire_on("jobs_guard", _GUARDED)
        _fire_on("jobs_kpis", _COUNTED)

    _briefly(change)


def downgrade() -> None:
    def change() -> None:
        _fire_on("jobs_guard", None)
        _fire_on("jobs_kpis", None)
        op.execute(
            "CREATE TRIGGER journal_agent_exists BEFORE INSERT OR UPDATE OF agent_id ON audit.journal"
            " FOR EACH ROW EXECUTE FUNCTION keel_agent_exists()"
        )

    _briefly(change)

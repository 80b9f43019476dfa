"""The KPIs, computed from the tables (for `keel demo` and `keel kpi`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from uuid import UUID

from psycopg.rows import dict_row

from models.db import Database

#: The demo's agents are named with this prefix, so that `keel kpi` can leave them out of a user's figures.
DEMO_PREFIX = "demo-"

# Every figure can be narrowed to some agents (%(ids)s; NULL: all of them), leaving out those whose name starts
# with %(skip)s (NULL: none). Deleted agents' work counts too: their jobs, events and deliveries are kept.
_KPIS = """
WITH all_agents AS (SELECT id, name FROM agents UNION ALL SELECT agent_id, name FROM audit.deleted_agents),
     mine_agents AS (SELECT id FROM all_agents WHERE (%(ids)s::uuid[] IS NULL OR id = ANY(%(ids)s::uuid[]))
                     AND (%(skip)s::text IS NULL OR NOT starts_with(name, %(skip)s::text))),
     mine_jobs AS (SELECT * FROM jobs WHERE agent_id IN (SELECT id FROM mine_agents)),
     mine_events AS (SELECT * FROM audit.journal WHERE agent_id IN (SELECT id FROM mine_agents)),
     mine_log AS (SELECT d.* FROM delivery_log d JOIN outbox o ON o.key = d.key
                  WHERE o.agent_id IN (SELECT id FROM mine_agents))
SELECT
  (SELECT count(*) FROM mine_events WHERE kind = 'suppressed')
  + (SELECT coalesce(sum(json_array_length(details->'jobs_suppressed')), 0) FROM mine_events
     WHERE details->'jobs_suppressed' IS NOT NULL)
  + (SELECT coalesce(sum(json_array_length(details->'messages_suppressed')), 0) FROM mine_events
     WHERE details->'messages_suppressed' IS NOT NULL)                                   AS suppressed_duplicates,
  (SELECT count(*) FROM (SELECT key FROM mine_log GROUP BY key HAVING count(*) > 1) d)   AS keys_confirmed_twice,
  (SELECT count(*) FROM mine_log)                                                        AS deliveries,
  (SELECT coalesce(sum(attempts), 0) FROM mine_jobs WHERE operation = 'plan')           AS model_calls,
  (SELECT coalesce(sum(attempts), 0) FROM mine_jobs WHERE operation = 'tool')           AS tool_calls,
  (SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - run_at))
     FROM mine_jobs WHERE status = 'succeeded')                                         AS p95_step_seconds,
  (SELECT count(*) FILTER (WHERE status = 'succeeded')::float / nullif(count(*), 0) FROM mine_jobs
     WHERE error_attempts <> '{}'::jsonb)                                               AS recovery_rate,
  (SELECT count(*) FROM mine_jobs WHERE error_attempts <> '{}'::jsonb)                  AS jobs_that_failed_once,
  (SELECT coalesce(sum(failed_tokens), 0)::bigint FROM mine_jobs)                       AS retry_tokens,
  (SELECT coalesce(sum(failed_cost), 0) FROM mine_jobs)                                 AS retry_cost,
  (SELECT count(*) FILTER (WHERE phase = 'failed')::float / nullif(count(*), 0) FROM agents
     WHERE request_id IS NOT NULL AND id IN (SELECT id FROM mine_agents))               AS failure_rate
"""


def kpis(db: Database, agent_ids: Sequence[UUID] | None = None, *, skip_prefix: str | None = None) -> dict[str, Any]:
    """The KPIs over all agents, or over ``agent_ids`` only; without agents named ``skip_prefix``…"""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_KPIS, {"ids": None if agent_ids is None else list(agent_ids), "skip": skip_prefix})
        row = cur.fetchone() or {}
        conn.rollback()
    return dict(row)


def request_outcomes(db: Database) -> list[dict[str, Any]]:
    """Each agent's current request: how it ended and why (the last transition's policy decision)."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT a.name, a.request_id, a.phase, a.spent_tokens, a.spent_cost,"
            " (SELECT j.decision FROM audit.journal j WHERE j.agent_id = a.id AND j.kind = 'transition'"
            "  ORDER BY j.seq DESC LIMIT 1) AS why"
            " FROM agents a WHERE a.request_id IS NOT NULL ORDER BY a.name"
        )
        rows = cur.fetchall()
        conn.rollback()
    return rows


# --- TEMPORARY (alerts branch) ----------------------------------------------------------------------------------
# A minimal stand-in for the KPI helper's `Kpis`, `Gauges`, `window(db, since)` and `gauges(db)` (the contract in
# /work/notes/contract.md), so that the alerts can be built and tested on this branch. Only the figures the alerts'
# tests drive are computed (side-effect duplicates, dead letters, the oldest due job); the rest are zero or None.
# The lead replaces this whole block with the KPI helper's implementation at merge.


@dataclass(frozen=True, slots=True)
class Kpis:
    suppressed_duplicates: dict[str, float] = field(default_factory=dict)
    confirmations: float = 0
    side_effect_duplicates: float = 0
    duplicate_rate: float | None = None
    requests_done: float = 0
    requests_failed: float = 0
    failure_rate: float | None = None
    mean_request_seconds: float | None = None
    p95_request_seconds: float | None = None
    p95_transition_seconds: float | None = None
    jobs_failed_once: float = 0
    jobs_recovered: float = 0
    recovery_rate: float | None = None
    spent_tokens: float = 0
    spent_cost: float = 0
    retry_tokens: float = 0
    retry_cost: float = 0
    retry_cost_share: float | None = None
    fenced_outcomes: float = 0
    lease_takeovers: float = 0
    budget_stops: float = 0
    deadline_stops: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Gauges:
    jobs_by_status: dict[str, float] = field(default_factory=dict)
    oldest_due_job_age_seconds: float = 0
    outbox_backlog: dict[str, float] = field(default_factory=dict)
    outbox_oldest_age_seconds: dict[str, float] = field(default_factory=dict)
    dead_letters: dict[str, float] = field(default_factory=dict)


def window(db: Database, since: timedelta) -> Kpis:
    """TEMPORARY: confirmations and side-effect duplicates over the last ``since`` only."""
    with db.connection() as conn:
        row = conn.execute(
            "SELECT count(*), count(*) - count(DISTINCT key) FROM delivery_log"
            " WHERE confirmed_at >= clock_timestamp() - %s",
            (since,),
        ).fetchone()
        conn.rollback()
    confirmations, duplicates = row if row else (0, 0)
    return Kpis(
        confirmations=float(confirmations),
        side_effect_duplicates=float(duplicates),
        duplicate_rate=duplicates / confirmations if confirmations else None,
    )


def gauges(db: Database) -> Gauges:
    """TEMPORARY: dead letters per channel and the oldest due job's age."""
    with db.connection() as conn:
        dead = dict(conn.execute("SELECT channel, count(*)::float FROM outbox WHERE status = 'dead' GROUP BY channel"))
        row = conn.execute(
            "SELECT coalesce(extract(epoch FROM clock_timestamp() - min(run_at))::float, 0) FROM jobs"
            " WHERE status IN ('pending', 'enqueued') AND run_at <= clock_timestamp()"
        ).fetchone()
        conn.rollback()
    return Gauges(dead_letters=dead, oldest_due_job_age_seconds=row[0] if row else 0.0)
